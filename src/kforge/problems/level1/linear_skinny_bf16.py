"""A skinny GEMM in bf16: y = x @ W^T for M = 16 token rows, W (N, K) as nn.Linear stores it:
Llama-3-70B's MLP down projection (K = 28672 -> N = 8192) at a decode batch of 16. The
reference is torch's linear (cuBLAS).

Memory-bound: 2 x 16 x N x K FLOPs (7.5 GFLOP) against the weight's N x K x 2 bytes
(470 MB) read once: ~16 FLOPs a byte, where the H100 balances at ~260. The floor is the
weight at HBM bandwidth, about 0.16 ms at ~3 TB/s; x and y are kilobytes.

Tiny size: 13 rows, N = 77, K = 100.
"""

import torch
from torch import nn

M, N, K = 16, 8192, 28672

tags = ["gemm", "level1", "bf16", "gemv", "decode"]
compute_dtype = "bf16"
tiny_sizes = {"M": 13, "N": 77, "K": 100}
forbidden_ops = ["aten::mm", "aten::matmul", "aten::addmm", "aten::bmm", "aten::linear", "aten::mv"]
tolerance = {"atol": 2e-2, "rtol": 2e-2}  # as gemv_bf16.py: W scaled by 1/sqrt(K), outputs ~N(0, 1)


def flops(inputs):
    x, w = inputs
    return 2 * x.shape[0] * x.shape[1] * w.shape[0]


def bytes_moved(inputs):
    x, w = inputs
    return (x.numel() + w.numel() + x.shape[0] * w.shape[0]) * x.element_size()


class Model(nn.Module):
    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, w)


def get_inputs():
    return [torch.randn(M, K).to(torch.bfloat16), (torch.randn(N, K) / K**0.5).to(torch.bfloat16)]


def get_init_inputs():
    return []

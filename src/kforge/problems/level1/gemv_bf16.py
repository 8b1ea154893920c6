"""Decode GEMV in bf16: y = x @ W^T for a handful of tokens (BATCH 1..16), W stored N x K as
nn.Linear keeps it, fp32 accumulation. The reference is torch's linear (cuBLAS).

Memory-bound: the weight is read once, N * K * 2 bytes, and dominates everything else
(x and y are kilobytes). At Llama-3-8B's fused gate_up (N = 28672, K = 4096): 235 MB,
about 78 us at ~3 TB/s; 2 * BATCH * N * K FLOPs are nothing beside it.
"""

import torch
from torch import nn

BATCH, N, K = 1, 6144, 4096

tags = ["serving", "level1", "bf16", "gemv"]
compute_dtype = "bf16"
tiny_sizes = {"BATCH": 3, "N": 77, "K": 100}
forbidden_ops = ["aten::mm", "aten::matmul", "aten::addmm", "aten::bmm", "aten::linear", "aten::mv"]
# W is scaled by 1/sqrt(K), so outputs are ~N(0, 1): fp32 sums in any order, rounded to
# bf16, differ by about one step (2^-7 near 1).
tolerance = {"atol": 2e-2, "rtol": 2e-2}


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
    return [torch.randn(BATCH, K).to(torch.bfloat16), (torch.randn(N, K) / K**0.5).to(torch.bfloat16)]


def get_init_inputs():
    return []

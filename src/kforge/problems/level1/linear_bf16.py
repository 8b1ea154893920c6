"""y = x @ W^T in bf16 with fp32 accumulation: a linear layer without bias, W stored N x K
(out_features x in_features, as nn.Linear keeps it). The LLM shapes of `kforge bench gemm`.

2*M*N*K flops over (M*K + N*K + M*N) * 2 bytes. Compute-bound at M = 4096; at M = 16
the weight dominates the bytes and the floor is reading it once from HBM.
"""

import torch
from torch import nn

M, N, K = 4096, 4096, 4096  # tokens, out_features, in_features

tags = ["gemm", "level1", "bf16", "linear"]
compute_dtype = "bf16"
tiny_sizes = {"M": 67, "N": 48, "K": 72}
forbidden_ops = ["aten::mm", "aten::matmul", "aten::addmm", "aten::bmm", "aten::linear"]
tolerance = {"atol": 0.125, "rtol": 1.6e-2}  # as matmul_bf16.py: one bf16 step, with room


def flops(inputs):
    x, w = inputs
    return 2 * x.shape[0] * x.shape[1] * w.shape[0]


class Model(nn.Module):
    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, w)


def get_inputs():
    return [torch.randn(M, K).to(torch.bfloat16), torch.randn(N, K).to(torch.bfloat16)]


def get_init_inputs():
    return []

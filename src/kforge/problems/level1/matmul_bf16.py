"""C = A @ B in bf16 with fp32 accumulation (cuBLAS on tensor cores): the bf16 GEMM ladder's target.

2*M*N*K flops over (M*K + K*N + M*N) * 2 bytes: at 4096^3, 137 GFLOP against 101 MB,
compute-bound. The floor is the bf16 tensor-core rate (989 TFLOP/s on an H100 SXM's
data sheet, ~790 measured by torch.mm: 0.17 ms at 4096^3).
"""

import torch
from torch import nn

M = N = K = 4096

# kforge metadata (optional; KernelBench ignores it)
tags = ["gemm", "level1", "bf16"]
compute_dtype = "bf16"
tiny_sizes = {"M": 67, "N": 48, "K": 72}  # M is no multiple of anything; TMA needs N, K multiples of 8
forbidden_ops = ["aten::mm", "aten::matmul", "aten::addmm", "aten::bmm", "aten::linear"]
# Entries are sums of K products of standard normals (|C| ~ sqrt(K) = 64 at K = 4096),
# rounded to bf16 (a relative step of 2^-8 = 0.4%): two correct kernels that sum in
# different orders can land one bf16 step apart. rtol 1.6e-2 allows that with room;
# atol 0.125 covers entries near zero, where fp32 summation order alone moves ~1e-3.
tolerance = {"atol": 0.125, "rtol": 1.6e-2}


def flops(inputs):
    a, b = inputs
    return 2 * a.shape[0] * a.shape[1] * b.shape[1]


class Model(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.matmul(a, b)


def get_inputs():
    return [torch.randn(M, K).to(torch.bfloat16), torch.randn(K, N).to(torch.bfloat16)]


def get_init_inputs():
    return []

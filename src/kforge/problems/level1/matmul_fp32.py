"""C = A @ B in fp32 with TF32 off: cuBLAS SGEMM on CUDA cores, the fp32 GEMM ladder's target.

2*M*N*K flops over (M*K + K*N + M*N) * 4 bytes: at 4096^3, 137 GFLOP against 201 MB,
compute-bound. The floor is the fp32 FMA rate (67 TFLOP/s on an H100 SXM: 2.05 ms).
"""

import torch
from torch import nn

M = N = K = 4096

# kforge metadata (optional; KernelBench ignores it)
tags = ["gemm", "level1", "fp32"]
compute_dtype = "fp32"
tiny_sizes = {"M": 67, "N": 45, "K": 71}  # not multiples of any tile or of 4: tails get tested
# A candidate must compute the product itself, not hand it back to cuBLAS.
forbidden_ops = ["aten::mm", "aten::matmul", "aten::addmm", "aten::bmm", "aten::linear"]
# fp32 sums of K = 4096 products of standard normals (entries ~ N(0, 64^2)) in two
# different orders differ by up to ~1e-3 (measured: 8e-4 on 256 x 256 outputs), so the
# default fp32 tolerance (1e-4) would fail correct kernels on entries near zero. 4e-3 is
# 6e-5 of a typical entry; a dropped or doubled product moves an entry by ~1.
tolerance = {"atol": 4e-3, "rtol": 1e-4}


def flops(inputs):
    a, b = inputs
    return 2 * a.shape[0] * a.shape[1] * b.shape[1]


class Model(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        # IEEE fp32, whatever the process-wide setting: TF32 would be a different problem.
        previous = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            return torch.matmul(a, b)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = previous


def get_inputs():
    return [torch.randn(M, K), torch.randn(K, N)]


def get_init_inputs():
    return []

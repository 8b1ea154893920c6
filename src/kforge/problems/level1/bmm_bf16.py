"""Batched matrix multiply in bf16: C[b] = A[b] @ B[b] for BATCH independent products
(torch.bmm, cuBLAS's batched GEMM), fp32 accumulation: the shape of attention's score and
value products, or of experts applied to their own tokens.

2 x BATCH x M x N x K FLOPs over 2 x BATCH x (M K + K N + M N) bytes: at 64 x 1024^3,
137 GFLOP over 403 MB: compute-bound, about 0.18 ms at ~790 TFLOP/s. Each product alone
(2.1 GFLOP) is too small to fill an H100 for long: the batch has to go into one launch.

Tiny size: 3 products of 37 x 72 by 72 x 40 (K and N multiples of 8: TMA reads 16-byte rows).
"""

import torch
from torch import nn

BATCH, M, N, K = 64, 1024, 1024, 1024

tags = ["gemm", "level1", "bf16", "batched"]
compute_dtype = "bf16"
tiny_sizes = {"BATCH": 3, "M": 37, "N": 40, "K": 72}
forbidden_ops = ["aten::bmm", "aten::baddbmm", "aten::matmul", "aten::mm", "aten::addmm", "aten::einsum"]
tolerance = {"atol": 0.125, "rtol": 1.6e-2}  # as matmul_bf16.py: one bf16 step of entries ~N(0, K), with room


def flops(inputs):
    a, b = inputs
    return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]


class Model(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.bmm(a, b)


def get_inputs():
    return [torch.randn(BATCH, M, K).to(torch.bfloat16), torch.randn(BATCH, K, N).to(torch.bfloat16)]


def get_init_inputs():
    return []

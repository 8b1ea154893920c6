"""Batched NVFP4 GEMV (GPU MODE's Blackwell problem, run on Hopper): c[l] = A[l] @ B[l]^T for
L batches of an M x K matrix A and a 1 x K vector B, both in NVFP4 (`formats.quantize_nvfp4`:
E2M1 codes two a byte along K, one float8_e4m3fn scale per 16 k, one fp32 global scale),
c [L, M, 1] fp16 with fp32 sums. The reference dequantizes both with PyTorch
(`formats.dequantize_nvfp4`, fp32) and multiplies (torch.bmm), then rounds to fp16.

Memory-bound: A is M*K/2 bytes of codes plus M*K/16 of scales (4.5 bits a value), B and c
are kilobytes. The first shape of the set, (M, K, L) = (7168, 16384, 1): 58.7 + 7.3 MB =
66.1 MB, 22.0 us at 3.0 TB/s; 2*L*M*K = 235 MFLOP. The other two, (4096, 7168, 8) and
(7168, 2048, 4), move 132.2 and 33.1 MB (44.1 and 11.0 us); set M, K, L to run them.
"""

import torch
from torch import nn

from kforge.kernels.quant.formats import dequantize_nvfp4, quantize_nvfp4

M, K, L = 7168, 16384, 1

tags = ["quant", "level1", "nvfp4", "gemv", "fp16"]
precision = "as_drawn"  # quantized payloads and their scales keep their format: not exposed
compute_dtype = "fp16"
tiny_sizes = {"M": 24, "K": 160, "L": 2}
forbidden_ops = ["aten::mm", "aten::matmul", "aten::bmm", "aten::baddbmm", "aten::addmm", "aten::mv"]
# B is scaled by 1/sqrt(K) so that c ~ N(0, 1) (A's and B's quantization errors are part of
# the inputs, not of the comparison); fp16 rounds c to 2^-11 relative, fp32 sums of K
# products in another order differ by ~1e-6.
tolerance = {"atol": 2e-3, "rtol": 2e-3}


def flops(inputs):
    a = inputs[0]
    return 2 * a.shape[0] * a.shape[1] * 2 * a.shape[2]


def bytes_moved(inputs):
    a, a_scales, a_gs, b, b_scales, b_gs = inputs
    return (sum(t.numel() * t.element_size() for t in (a, a_scales, a_gs, b, b_scales, b_gs))
            + a.shape[0] * a.shape[1] * 2)


class Model(nn.Module):
    def forward(self, a, a_scales, a_gs, b, b_scales, b_gs) -> torch.Tensor:
        a_values = dequantize_nvfp4(a, a_scales, a_gs)
        b_values = dequantize_nvfp4(b, b_scales, b_gs)
        return torch.bmm(a_values, b_values.transpose(1, 2)).half()


def get_inputs():
    a, a_scales, a_gs = quantize_nvfp4(torch.randn(L, M, K))
    b, b_scales, b_gs = quantize_nvfp4(torch.randn(L, 1, K) / K**0.5)
    return [a, a_scales, a_gs, b, b_scales, b_gs]


def get_init_inputs():
    return []

"""NVFP4 GEMM on Hopper, C = A @ B^T with A [M, K] and B [N, K] in NVFP4 (E2M1 codes, an E4M3
scale per 16 values, a power-of-two fp32 tensor scale), C bf16, against bf16 cuBLAS on
the same numbers (inputs 6 and 7: the dequantized operands, exact in bf16, since an E2M1
value times an E4M3 scale has at most 6 significant bits).

At M = 4096, N = 7168, K = 16384: 962 GFLOP, 0.13 GB packed; Hopper has no FP4 tensor
cores, so the kernel widens tiles for the fp16/fp8 ones: the bar is cuBLAS bf16 (~1.2 ms
at ~790 TFLOP/s).
"""

import math

import torch
from torch import nn

from kforge.kernels.quant.formats import dequantize_nvfp4, quantize_nvfp4

M, N, K = 4096, 7168, 16384
# randn in NVFP4: a tensor scale of 2^-9 puts block amaxes up to ~4.5 under E4M3's 448 x 6
GLOBAL = 2.0**-9

tags = ["quant", "nvfp4", "gemm", "bench"]
precision = "as_drawn"  # quantized payloads and their scales keep their format: not exposed
compute_dtype = "bf16"
tiny_sizes = {"M": 40, "N": 72, "K": 256}
tolerance = {"atol": 2e-2, "rtol": 2e-2}


def flops(inputs):
    a, b = inputs[0], inputs[3]
    return 2 * a.shape[0] * b.shape[0] * 2 * a.shape[1]


def bytes_moved(inputs):
    return sum(x.numel() * x.element_size() for x in inputs[:6]) + 2 * inputs[0].shape[0] * inputs[3].shape[0]


class Model(nn.Module):
    def forward(self, a, a_scales, a_gs, b, b_scales, b_gs, a_bf16, b_bf16):
        return torch.matmul(a_bf16, b_bf16.t())


def _nvfp4(rows, scale):
    packed, scales, gs = quantize_nvfp4(scale * torch.randn(rows, K), torch.tensor(GLOBAL * scale))
    return packed, scales, gs, dequantize_nvfp4(packed, scales, gs).bfloat16()


def get_inputs():
    a, a_scales, a_gs, a_bf16 = _nvfp4(M, 1.0)
    b, b_scales, b_gs, b_bf16 = _nvfp4(N, 2.0 ** -round(math.log2(K) / 2))  # ~ 1 / sqrt(K): C ~ N(0, 1)
    return [a, a_scales, a_gs, b, b_scales, b_gs, a_bf16, b_bf16]


def get_init_inputs():
    return []

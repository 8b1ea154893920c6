"""W4A16 decode GEMV: y = x @ W^T for one token, W [N, K] stored as 4-bit integers with one
bf16 scale per 128 consecutive k (`formats.quantize_int4`: qweight [N, K/2] uint8, two
nibbles a byte, scales [N, K/128] bf16). The reference is what a user writes eagerly:
dequantize to bf16 with PyTorch (`formats.dequantize_int4`), then F.linear (cuBLAS).

Memory-bound: the packed weight is N*K/2 bytes plus the scales N*K/128*2, everything else
kilobytes. At Llama-3-8B's up projection (N = 14336, K = 4096): 29.36 + 0.92 MB = 30.3 MB,
10.1 us at 3.0 TB/s, against 117 MB (39 us) for the same layer in bf16; 2*N*K = 117 MFLOP
are nothing beside it. The eager reference moves far more: it writes and re-reads the
117 MB bf16 weight it dequantizes.
"""

import torch
from torch import nn

from kforge.kernels.quant.formats import dequantize_int4, quantize_int4

BATCH, N, K, GROUP = 1, 14336, 4096, 128

tags = ["quant", "level1", "w4a16", "gemv", "bf16"]
precision = "as_drawn"  # quantized payloads and their scales keep their format: not exposed
compute_dtype = "bf16"
tiny_sizes = {"N": 40, "K": 256}
forbidden_ops = ["aten::mm", "aten::matmul", "aten::addmm", "aten::bmm", "aten::linear", "aten::mv"]
# W is N(0, 1/K) before quantization, so outputs are ~N(0, 1). A kernel summing exact q * s
# in fp32 differs from the reference's bf16-rounded weights by ~2^-9 of |y| and from its
# rounding by one bf16 step (2^-7 near 1).
tolerance = {"atol": 2e-2, "rtol": 2e-2}


def flops(inputs):
    x, qweight, _ = inputs
    return 2 * x.shape[0] * x.shape[1] * qweight.shape[0]


def bytes_moved(inputs):
    x, qweight, scales = inputs
    return (qweight.numel() + scales.numel() * scales.element_size()
            + (x.numel() + x.shape[0] * qweight.shape[0]) * x.element_size())


class Model(nn.Module):
    def forward(self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, dequantize_int4(qweight, scales, GROUP))


def get_inputs():
    qweight, scales = quantize_int4(torch.randn(N, K) / K**0.5, GROUP)
    return [torch.randn(BATCH, K).to(torch.bfloat16), qweight, scales]


def get_init_inputs():
    return []

"""W4A16 GEMV / small-batch GEMM, y = x @ W^T with W stored as INT4 (group 128, bf16 scales),
against cuBLAS's bf16 GEMV on the same weights.

x [B, K] bf16, W [N, K] as `formats.quantize_int4` packs it (qweight [N, K // 2] uint8,
scales [N, K // 128] bf16), y [B, N] bf16. The codes are random in -8..7 and the scales
powers of two, so W's bf16 copy (input 4, what the reference multiplies) holds exactly the
values the packed form does. The roof is the packed form's bytes: at N = 14336, K = 4096,
29.4 MB of codes + 0.9 MB of scales, ~10 us at 3 TB/s; the bf16 GEMV reads 117 MB.
"""

import torch
from torch import nn

B, N, K = 1, 14336, 4096
GROUP = 128

tags = ["quant", "int4", "gemv", "bench"]
precision = "as_drawn"  # quantized payloads and their scales keep their format: not exposed
tiny_sizes = {"B": 3, "N": 40, "K": 256}
tolerance = {"atol": 2e-2, "rtol": 2e-2}  # fp32 sums in different orders, one bf16 rounding


def flops(inputs):
    x, qweight = inputs[0], inputs[1]
    return 2 * x.shape[0] * qweight.shape[0] * x.shape[1]


def bytes_moved(inputs):
    x, qweight, scales = inputs[:3]
    return (x.numel() + scales.numel() + x.shape[0] * qweight.shape[0]) * 2 + qweight.numel()


class Model(nn.Module):
    def forward(self, x, qweight, scales, w_bf16):
        return torch.nn.functional.linear(x, w_bf16)


def get_inputs():
    codes = torch.randint(-8, 8, (N, K), dtype=torch.int8)
    scales = torch.pow(2.0, torch.randint(-8, -4, (N, K // GROUP)).float()).bfloat16()
    nibbles = (codes & 0xF).to(torch.uint8)
    qweight = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
    w = (codes.float() * scales.float().repeat_interleave(GROUP, dim=1)).bfloat16()
    return [torch.randn(B, K).bfloat16(), qweight, scales, w]


def get_init_inputs():
    return []

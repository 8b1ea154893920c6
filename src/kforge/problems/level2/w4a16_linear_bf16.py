"""A W4A16 linear layer at small batch, bf16 activations: y = x W^T with W stored as 4-bit
integers and one bf16 scale per 128 inputs of each output row (the `quant.formats` INT4
layout: two values a byte along K, the even k in the low nibble, two's complement).

The reference is what a user writes without a fused kernel: unpack the nibbles, sign-
extend, multiply by the scales (each repeated over its group) in fp32, round to bf16,
then F.linear. Dequantizing materializes the bf16 weight (and its int and fp32
intermediates, ~2.5 GB of traffic at this size) before the GEMV reads it back. A fused
kernel reads the packed weight (4.125 bits a value) once and dequantizes in registers.

Sizes: Llama-3-8B's gate/up width (N = 14336, K = 4096), 16 tokens (batched decode):
the packed weight is 29.4 MB + 0.9 MB of scales, ~10 us at ~3 TB/s, where eager
dequantization alone takes ~0.8 ms. Tiny size: 3 tokens, K = 256, N = 40.
"""

import torch
import torch.nn.functional as F
from torch import nn

TOKENS, IN_FEATURES, OUT_FEATURES, GROUP = 16, 4096, 14336, 128

tags = ["level2", "bf16", "int4", "quantize", "gemv", "fusion"]
precision = "as_drawn"  # quantized payloads and their scales keep their format: not exposed
compute_dtype = "bf16"
tiny_sizes = {"TOKENS": 3, "IN_FEATURES": 256, "OUT_FEATURES": 40}
forbidden_ops = ["aten::mm", "aten::matmul", "aten::addmm", "aten::bmm", "aten::linear"]
# Outputs ~N(0, 4): both sides multiply the same bf16 weights (the kernel dequantizes to
# the reference's values) in fp32; summation order and the output rounding remain.
tolerance = {"atol": 2e-2, "rtol": 2e-2}


def flops(inputs):
    (x,) = inputs
    return 2 * x.shape[0] * x.shape[1] * OUT_FEATURES


class Model(nn.Module):
    def __init__(self, in_features: int, out_features: int, group: int):
        super().__init__()
        self.group = group
        packed = torch.randint(0, 256, (out_features, in_features // 2), dtype=torch.uint8)
        # scales as quantize_int4 makes them from weights of ~U(+-0.05): amax / 7 ~ 0.007
        scales = (0.005 + 0.004 * torch.rand(out_features, in_features // group)).to(torch.bfloat16)
        self.register_buffer("qweight", packed)
        self.register_buffer("scales", scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        low, high = self.qweight & 0x0F, self.qweight >> 4
        codes = torch.stack((low, high), dim=-1).flatten(-2).to(torch.int16)  # k = 2j low, 2j + 1 high
        values = codes - 16 * (codes >= 8).to(torch.int16)  # 4-bit two's complement
        scales = self.scales.float().repeat_interleave(self.group, dim=1)
        weight = (values.float() * scales).to(torch.bfloat16)
        return F.linear(x, weight)


def get_inputs():
    return [torch.randn(TOKENS, IN_FEATURES).to(torch.bfloat16)]


def get_init_inputs():
    return [IN_FEATURES, OUT_FEATURES, GROUP]

"""W4A16 matmul on kforge's Triton kernel (`kernels/quant/w4a16.py`): the packed INT4 weight is
read once and dequantized in registers, the bf16 weight never materialized. The buffers
are created as the reference's, under the same seed. On a CPU the kernel runs under
Triton's interpreter.
"""

import torch
from torch import nn

from kforge.kernels.quant.w4a16 import w4a16_matmul


class ModelNew(nn.Module):
    def __init__(self, in_features: int, out_features: int, group: int):
        super().__init__()
        self.group = group
        packed = torch.randint(0, 256, (out_features, in_features // 2), dtype=torch.uint8)
        scales = (0.005 + 0.004 * torch.rand(out_features, in_features // group)).to(torch.bfloat16)
        self.register_buffer("qweight", packed)
        self.register_buffer("scales", scales)

    def forward(self, x):
        return w4a16_matmul(x, self.qweight, self.scales, group=self.group)

"""Bias add and exact GELU in one streaming Triton kernel (`kernels/fused/bias_act.py`): x read
once, y written once. The bias is created as the reference's, under the same seed. On a
CPU the kernel runs under Triton's interpreter.
"""

import torch
from torch import nn

from kforge.kernels.fused.bias_act import bias_act


class ModelNew(nn.Module):
    def __init__(self, ffn: int):
        super().__init__()
        self.bias = nn.Parameter((0.1 * torch.randn(ffn)).to(torch.bfloat16))

    def forward(self, x):
        return bias_act(x, self.bias, "gelu")

"""Depthwise causal conv1d, bias and silu in one pass (`kernels/fused/causal_conv1d.py`): x read
once, y written once, the 4 taps unrolled into FMAs. The nn.Conv1d is built as the
reference's, so under the same seed its weights are equal. On a CPU the kernel runs under
Triton's interpreter.
"""

import torch
from torch import nn

from kforge.kernels.fused.causal_conv1d import causal_conv1d


class ModelNew(nn.Module):
    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        self.conv1d = nn.Conv1d(channels, channels, kernel_size, groups=channels, padding=kernel_size - 1, bias=True,
                                dtype=torch.bfloat16)

    def forward(self, x):
        return causal_conv1d(x, self.conv1d.weight, self.conv1d.bias, activation="silu")

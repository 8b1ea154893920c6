"""Mamba's short convolution, bf16: y = silu(depthwise causal conv1d(x) + b), as Mamba's
reference path computes it: nn.Conv1d(C, C, 4, groups=C, padding=3), keep the first L
outputs, then F.silu.

The reference is those two launches: the convolution (cuDNN) writes L + 3 outputs per
row, the slice is a view, silu reads it and writes y. A fused kernel reads x once and
writes y once, the 4 taps and the bias applied in fp32 registers.

Sizes: Mamba-2.8B's inner width 5120, 8 sequences of 4096 tokens: x is 8 x 5120 x 4096
bf16 (335 MB). Eager moves >= 1.34 GB (~0.45 ms at ~3 TB/s), the floor 0.67 GB
(~0.22 ms). Tiny size: 2 x 6 channels x 37.
"""

import torch
import torch.nn.functional as F
from torch import nn

BATCH, CHANNELS, LENGTH, KERNEL = 8, 5120, 4096, 4

tags = ["level2", "bf16", "conv", "activation", "fusion"]
tiny_sizes = {"BATCH": 2, "CHANNELS": 6, "LENGTH": 37}
# Eager rounds the convolution to bf16 before silu; fused rounds once.
tolerance = {"atol": 2e-2, "rtol": 2e-2}


def bytes_moved(inputs):
    (x,) = inputs
    return (2 * x.numel() + x.shape[1] * (KERNEL + 1)) * x.element_size()  # x read, y written, taps and bias once


class Model(nn.Module):
    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        self.conv1d = nn.Conv1d(channels, channels, kernel_size, groups=channels, padding=kernel_size - 1, bias=True,
                                dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self.conv1d(x)[..., : x.shape[-1]])


def get_inputs():
    return [torch.randn(BATCH, CHANNELS, LENGTH).to(torch.bfloat16)]


def get_init_inputs():
    return [CHANNELS, KERNEL]

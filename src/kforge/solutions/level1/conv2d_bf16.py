"""The 3 x 3 convolution as an implicit GEMM on tensor cores (`kforge.kernels.conv.conv2d`:
channels-last patches gathered tile by tile, never materialized). The module builds the
same nn.Conv2d as the problem's Model, in the same order under the same seed, so it holds
the same weight; the weight's GEMM layout (R S C, K) is derived once, here, and kept as a
buffer. cuDNN is expected to stay ahead (the kernel's docstring says why). On a CPU the
kernel runs under the Triton interpreter with one small tile.
"""

import torch
from torch import nn

from kforge.kernels.conv.conv2d import conv2d_nhwc, conv_weight_matrix
from kforge.problems.level1 import conv2d_bf16 as problem


class ModelNew(nn.Module):
    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, problem.KERNEL, stride=problem.STRIDE,
                              padding=problem.PADDING, bias=False)
        self.conv.to(dtype=torch.bfloat16, memory_format=torch.channels_last)
        self.register_buffer("weight_matrix", conv_weight_matrix(self.conv.weight.detach()), persistent=False)

    def forward(self, x):
        return conv2d_nhwc(x, self.conv.weight, stride=problem.STRIDE, padding=problem.PADDING,
                           weight_matrix=self.weight_matrix)

"""Transpose on kforge's tiled Triton kernel (`kforge.kernels.layout.transpose`): 64 x 64 tiles
read along x's rows and written along out's, turned through shared memory. On a CPU it runs
under the Triton interpreter.
"""

from torch import nn

from kforge.kernels.layout.transpose import transpose_forward


class ModelNew(nn.Module):
    def forward(self, x):
        return transpose_forward(x)

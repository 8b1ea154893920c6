"""Batched GEMM in one persistent Triton launch (`kforge.kernels.gemm_batched.bmm`: 3-D TMA
descriptors built on the device, wgmma, tiles of every matrix walked by one program per SM),
rather than kforge's CUDA GEMM once per matrix (64 launches of a 3 us product would be
host-bound). On a CPU it runs under the Triton interpreter with one small tile.
"""

from torch import nn

from kforge.kernels.gemm_batched.bmm import bmm


class ModelNew(nn.Module):
    def forward(self, a, b):
        return bmm(a, b)

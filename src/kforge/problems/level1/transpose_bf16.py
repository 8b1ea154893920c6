"""Transpose of a bf16 matrix into a new row-major tensor: out = x.t().contiguous(), as
before a GEMM that wants the other layout, or between attention's head-major and
token-major layouts.

Pure data movement: M x N x 2 bytes read and written. At 16384 x 16384: 1.07 GB, about
0.36 ms at ~3 TB/s. Reading along rows and writing along columns is what makes it hard:
one of the two sides walks memory with a stride of a whole row.

Tiny size: 67 x 45, multiples of nothing.
"""

import torch
from torch import nn

M, N = 16384, 16384

tags = ["layout", "level1", "bf16"]
tiny_sizes = {"M": 67, "N": 45}
# .contiguous() and .clone() copy through aten::clone. (aten::copy_ cannot be forbidden: the
# Triton interpreter itself copies its results back with it on a CPU.)
forbidden_ops = ["aten::clone", "aten::_to_copy"]
tolerance = {"atol": 0.0, "rtol": 0.0}  # a copy: exact


def bytes_moved(inputs):
    (x,) = inputs
    return 2 * x.numel() * x.element_size()


class Model(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.t().contiguous()


def get_inputs():
    return [torch.randn(M, N).to(torch.bfloat16)]


def get_init_inputs():
    return []

"""Cumulative sum along rows in fp32: y[i, j] = x[i, 0] + ... + x[i, j] (torch.cumsum, dim=-1),
over ROWS rows of COLS, as in top-p sampling's running sum of sorted probabilities or a
linear recurrence's prefix sums.

Memory-bound: read once, write once, 2 x ROWS x COLS x 4 bytes: at 4096 x 32768, 1.07 GB,
about 0.36 ms at ~3 TB/s.

Tiny size: 2 rows of 17000, longer than one register tile, so the CPU run takes the same
chunked path (a scan per chunk plus a carry) as the full size.
"""

import torch
from torch import nn

ROWS, COLS = 4096, 32768

tags = ["reduction", "scan", "level1", "fp32"]
tiny_sizes = {"ROWS": 2, "COLS": 17000}
forbidden_ops = ["aten::cumsum", "aten::_cumsum", "aten::cumsum_"]
# Prefix sums of N(0, 1) reach a few hundred; a sequential fp32 scan and a blocked one sum in
# different orders and drift apart by ~1e-4 (measured 4e-4 over 20000). A dropped carry or
# element moves a whole stretch of the row by O(1).
tolerance = {"atol": 5e-3, "rtol": 1e-4}


def flops(inputs):
    (x,) = inputs
    return x.numel()


def bytes_moved(inputs):
    (x,) = inputs
    return 2 * x.numel() * x.element_size()


class Model(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cumsum(x, dim=-1)


def get_inputs():
    return [torch.randn(ROWS, COLS)]


def get_init_inputs():
    return []

"""Row statistics of bf16 activations: the mean and the (unbiased) variance of each row, in
fp32, written the way model code usually writes them: upcast, then mean and var.

Memory-bound: the floor is one read of x (ROWS x HIDDEN x 2 bytes) and 8 bytes a row out:
at 32768 x 8192, 537 MB, about 0.18 ms at ~3 TB/s. The eager reference writes an fp32
copy of x and reads it twice more (14 bytes an element against 2). The rows have a mean
of 3 and a spread of 2, so a variance taken as E[x^2] - E[x]^2 would show its
cancellation.

Tiny size: 5 rows of 1000 (two to a program, the last program half empty).
"""

import torch
from torch import nn

ROWS, HIDDEN = 32768, 8192

tags = ["reduction", "level1", "bf16"]
tiny_sizes = {"ROWS": 5, "HIDDEN": 1000}
forbidden_ops = ["aten::var", "aten::var_mean", "aten::mean", "aten::std", "aten::std_mean"]
# fp32 sums of thousands of terms in different orders: ~1e-6 relative apart.
tolerance = {"atol": 1e-4, "rtol": 1e-4}


def bytes_moved(inputs):
    (x,) = inputs
    return x.numel() * x.element_size() + 8 * x.shape[0]


class Model(nn.Module):
    def forward(self, x: torch.Tensor):
        h = x.float()
        return h.mean(-1), h.var(-1)


def get_inputs():
    return [(3 + 2 * torch.randn(ROWS, HIDDEN)).to(torch.bfloat16)]


def get_init_inputs():
    return []

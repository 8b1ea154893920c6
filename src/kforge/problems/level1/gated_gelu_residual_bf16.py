"""An elementwise chain in bf16: out = residual + sigmoid(gate) * gelu(x) (GELU's tanh form),
a gated residual branch. Eager PyTorch runs it as four kernels, one per op (gelu, sigmoid,
product, sum), each a full pass over memory and a rounding to bf16.

Memory-bound: the floor is three tensors read and one written once, 4 x ROWS x HIDDEN x 2
bytes: at 8192 x 8192, 537 MB, about 0.18 ms at ~3 TB/s, where eager moves 10 tensors'
worth (1.34 GB).

Tiny size: 7 x 300 (two programs, the second with a tail).
"""

import torch
from torch import nn

ROWS, HIDDEN = 8192, 8192

tags = ["elementwise", "activation", "level1", "bf16"]
tiny_sizes = {"ROWS": 7, "HIDDEN": 300}
forbidden_ops = ["aten::gelu", "aten::sigmoid"]
# |out| up to ~6. Eager rounds to bf16 after each of its four ops, a fused kernel once:
# a few bf16 steps (2^-8 relative each) apart near the largest outputs.
tolerance = {"atol": 3e-2, "rtol": 2e-2}


def flops(inputs):
    x = inputs[0]
    return 20 * x.numel()  # GELU's polynomial and sigmoid, the gate's sigmoid, product, sum


def bytes_moved(inputs):
    x = inputs[0]
    return 4 * x.numel() * x.element_size()


class Model(nn.Module):
    def forward(self, x: torch.Tensor, gate: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return residual + torch.sigmoid(gate) * torch.nn.functional.gelu(x, approximate="tanh")


def get_inputs():
    return [torch.randn(ROWS, HIDDEN).to(torch.bfloat16) for _ in range(3)]


def get_init_inputs():
    return []

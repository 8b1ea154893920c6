"""Bias add and exact GELU on a linear layer's output, bf16: y = gelu(x + b), Megatron-LM's
"bias_gelu" fusion (its MLP runs the first GEMM without the bias, to fuse it here).

The reference is the eager pair: the add (read x, write x + b) and F.gelu (read, write):
8 bytes per element over two launches. A fused kernel reads x once and writes y once.

Sizes: 16384 tokens through a 4096-wide model's 16384-wide MLP: x is 16384 x 16384 bf16
(537 MB). Eager moves 2.1 GB (~0.72 ms at ~3 TB/s), the floor is 1.07 GB (~0.36 ms).
Tiny size: 5 x 1000.
"""

import torch
import torch.nn.functional as F
from torch import nn

TOKENS, FFN = 16384, 16384

tags = ["level2", "bf16", "activation", "elementwise", "fusion"]
tiny_sizes = {"TOKENS": 5, "FFN": 1000}
# Eager rounds x + b to bf16 before GELU; a fused kernel does not: about one bf16 step.
tolerance = {"atol": 2e-2, "rtol": 2e-2}


def bytes_moved(inputs):
    (x,) = inputs
    return (2 * x.numel() + x.shape[-1]) * x.element_size()  # x read, y written, the bias once


class Model(nn.Module):
    def __init__(self, ffn: int):
        super().__init__()
        self.bias = nn.Parameter((0.1 * torch.randn(ffn)).to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x + self.bias)


def get_inputs():
    return [torch.randn(TOKENS, FFN).to(torch.bfloat16)]


def get_init_inputs():
    return [FFN]

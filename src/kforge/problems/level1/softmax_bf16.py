"""Softmax over a vocabulary in bf16: probabilities = softmax(logits) row by row, as a sampler
computes them from a language model's last logits. Llama 3's vocabulary (128256) for
TOKENS rows. The reference is torch.softmax on the bf16 logits (fp32 inside, bf16 out).

Memory-bound: the logits read once and the probabilities written once, 2 x TOKENS x VOCAB
x 2 bytes; one exp an element is nothing beside that. At 2048 x 128256: 1.05 GB, about
0.35 ms at ~3 TB/s. A 250 KB row is too long for one pass in registers: a kernel reads it
twice (statistics, then normalize), and only L2 keeps the second read off HBM.

Tiny size: 2 rows of 17000, longer than one register tile, so the CPU run takes the
same two-pass path as the full size.
"""

import torch
from torch import nn

TOKENS, VOCAB = 2048, 128256

tags = ["reduction", "softmax", "level1", "bf16"]
tiny_sizes = {"TOKENS": 2, "VOCAB": 17000}
forbidden_ops = ["aten::_softmax", "aten::softmax"]
# Probabilities of 128k logits are ~1e-5 each, so the bf16 default (atol 1e-2) would pass an
# all-zero output. Two kernels that round one fp32 value once differ by at most one bf16 step
# (2^-8 relative; the Triton interpreter truncates instead of rounding: 2^-7): rtol 1e-2,
# and an atol far below any probability here.
tolerance = {"atol": 1e-9, "rtol": 1e-2}


def flops(inputs):
    (x,) = inputs
    return 5 * x.numel()  # max, subtract, exp, sum, scale


def bytes_moved(inputs):
    (x,) = inputs
    return 2 * x.numel() * x.element_size()


class Model(nn.Module):
    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits, dim=-1)


def get_inputs():
    return [(2 * torch.randn(TOKENS, VOCAB)).to(torch.bfloat16)]


def get_init_inputs():
    return []

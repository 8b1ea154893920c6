"""Attention probabilities the eager way, bf16: P = softmax(mask(S / sqrt(d))), causal, from a
(batch, heads, N, N) score tensor, as Hugging Face's GPT-2 "eager" attention computes them.

The reference is that chain: divide by sqrt(head_dim) (read, write), torch.where against a
lower-triangular bool buffer with the dtype's minimum (read scores and mask, write),
softmax (read, write): ~13 bytes per score over three launches. A fused kernel reads
only the visible scores (key j <= query i; the mask is an index compare), scales and
normalizes them in fp32 registers, and writes P once, zeros above the diagonal included.

Sizes: GPT-2-like attention over 2048 tokens, batch 2, 32 heads: 268M scores, 537 MB per
bf16 tensor. Eager ~3.5 GB (~1.2 ms at ~3 TB/s); the floor is 1.5 tensors (0.8 GB,
~0.27 ms). Tiny size: 1 x 2 heads x 37 x 37.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

BATCH, HEADS, SEQ, HEAD_DIM = 2, 32, 2048, 128

tags = ["level2", "bf16", "softmax", "attention", "fusion"]
tiny_sizes = {"BATCH": 1, "HEADS": 2, "SEQ": 37}
# Probabilities in [0, 1]: eager rounds S / sqrt(d) to bf16 before the softmax (half a
# step of |s| <= ~5 moves a probability by up to ~1% of itself); outputs round once.
tolerance = {"atol": 1e-3, "rtol": 2e-2}


def bytes_moved(inputs):
    (scores,) = inputs
    n = scores.shape[-1]
    per_matrix = n * (n + 1) // 2 + n * n  # the visible scores read, P written
    return scores.shape[0] * scores.shape[1] * per_matrix * scores.element_size()


class Model(nn.Module):
    def __init__(self, max_positions: int, head_dim: int):
        super().__init__()
        self.head_dim = head_dim
        causal = torch.tril(torch.ones((max_positions, max_positions), dtype=torch.bool))
        self.register_buffer("bias", causal.view(1, 1, max_positions, max_positions), persistent=False)

    def forward(self, scores: torch.Tensor) -> torch.Tensor:
        n = scores.shape[-1]
        attn_weights = scores / math.sqrt(self.head_dim)
        mask_value = torch.full([], torch.finfo(attn_weights.dtype).min, dtype=attn_weights.dtype,
                                device=attn_weights.device)
        attn_weights = torch.where(self.bias[:, :, :n, :n], attn_weights, mask_value)
        return F.softmax(attn_weights, dim=-1)


def get_inputs():
    # q . k over 128 dims of N(0, 1) values: scores ~ N(0, 128), softmax arguments ~ N(0, 1)
    return [(math.sqrt(HEAD_DIM) * torch.randn(BATCH, HEADS, SEQ, SEQ)).to(torch.bfloat16)]


def get_init_inputs():
    return [SEQ, HEAD_DIM]

"""The LM head and its cross-entropy without the logits (`kernels/fused/linear_cross_entropy.py`):
a persistent TMA GEMM whose epilogue reduces each logits tile to a per-row max and sum of
exponentials (and picks out the target's logit), then a small kernel merges them per row;
the mean over the tokens not ignored is two tiny reductions in PyTorch. The nn.Linear is
built as the reference's. On a CPU both kernels run under Triton's interpreter.
"""

import torch
from torch import nn

from kforge.kernels.fused.linear_cross_entropy import linear_cross_entropy

IGNORE_INDEX = -100  # the problem's


class ModelNew(nn.Module):
    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.lm_head = nn.Linear(hidden, vocab, bias=False, dtype=torch.bfloat16)

    def forward(self, x, targets):
        return linear_cross_entropy(x, self.lm_head.weight, targets, ignore_index=IGNORE_INDEX)

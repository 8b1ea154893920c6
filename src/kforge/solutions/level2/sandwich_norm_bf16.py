"""Gemma's post-norm, the residual add and the next pre-norm in one row pass
(`kernels/fused/sandwich_norm.py`): x and the residual read once, h and y written once.
The two weights are created in the reference's order (post, then pre), so under the same
seed they are equal. On a CPU the kernel runs under Triton's interpreter.
"""

import torch
from torch import nn

from kforge.kernels.fused.sandwich_norm import sandwich_norm


class ModelNew(nn.Module):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.eps = eps
        self.post_weight = nn.Parameter((0.1 * torch.randn(hidden)).to(torch.bfloat16))
        self.pre_weight = nn.Parameter((0.1 * torch.randn(hidden)).to(torch.bfloat16))

    def forward(self, x, residual):
        return sandwich_norm(x, residual, self.post_weight, self.pre_weight, self.eps, weight_offset=1.0)

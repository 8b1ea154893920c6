"""QK-norm and RoPE of q and k in one Triton launch (`kernels/fused/qk_norm_rope.py`): each head
row read once, normalized, weighted and rotated in fp32 registers, written once, with
cos/sin from the cached table of `serving/rope.py`. The norm weights are created in the
reference's order (q, then k). On a CPU the kernel runs under Triton's interpreter.
"""

import torch
from torch import nn

from kforge.kernels.fused.qk_norm_rope import qk_norm_rope
from kforge.kernels.serving.rope import cos_sin_table


class ModelNew(nn.Module):
    def __init__(self, head_dim: int, rope_theta: float, max_position: int, eps: float):
        super().__init__()
        self.q_weight = nn.Parameter((1 + 0.1 * torch.randn(head_dim)).to(torch.bfloat16))
        self.k_weight = nn.Parameter((1 + 0.1 * torch.randn(head_dim)).to(torch.bfloat16))
        self.head_dim, self.rope_theta, self.max_position, self.eps = head_dim, rope_theta, max_position, eps

    def forward(self, q, k, position_ids):
        table = cos_sin_table(self.max_position, self.head_dim, self.rope_theta, q.device)  # built once, cached
        return qk_norm_rope(q, k, position_ids, table, q_weight=self.q_weight, k_weight=self.k_weight, eps=self.eps)

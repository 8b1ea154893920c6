"""RoPE and causal attention on two of kforge's Triton kernels: `kernels/fused/qk_norm_rope.py`
(no norm weights: plain RoPE) rotates q and k in one pass into new (batch, seq, heads,
head_dim) tensors, from the cached fp32 cos/sin table of `serving/rope.py`; then
`attention/flash_forward.py` reads them through transposed views (its TMA descriptors take
any strides) and writes its output in the same layout, which is the layout returned.
On a CPU both kernels run under Triton's interpreter.
"""

from torch import nn

from kforge.kernels.attention.flash_forward import flash_attention_forward
from kforge.kernels.fused.qk_norm_rope import qk_norm_rope
from kforge.kernels.serving.rope import cos_sin_table


class ModelNew(nn.Module):
    def __init__(self, head_dim: int, rope_theta: float, max_position: int):
        super().__init__()
        self.head_dim, self.rope_theta, self.max_position = head_dim, rope_theta, max_position

    def forward(self, q, k, v, position_ids):
        table = cos_sin_table(self.max_position, self.head_dim, self.rope_theta, q.device)  # built once, cached
        q, k = qk_norm_rope(q, k, position_ids, table)
        out, _ = flash_attention_forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
        return out.transpose(1, 2)

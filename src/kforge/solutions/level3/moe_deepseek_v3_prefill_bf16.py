"""The DeepSeek-V3 MoE layer on kforge's MoE kernels (problem: the file of the same name in
problems/level3): `kernels/moe/deepseek.moe_layer`.

The router's GEMM is the reference's (the same fp32 F.linear); its selection is kforge's Triton
router, which evaluates the sigmoid in float64 and ranks as the reference's topk does, so the
chosen experts are the same. Then one dispatch (histogram, scan, scatter) for the 8 routed
experts and the shared one (appended as expert 256 at weight 1), one gathered copy of x, the
gate-up grouped GEMM with SwiGLU fused, the down grouped GEMM (both in the contiguous layout,
all 257 experts in one launch each) and the combine, a gather-and-sum per token. Where eager
runs 257 loop iterations of ~10 kernels and a host sync each, this runs ~12 launches and no sync.

The weights are the reference's, drawn in its order under the same seed: nn.Linear's default
init, then the normal draw, per projection, but written straight into the stacked
w13 (E + 1, 2I, H) and w2 (E + 1, H, I), so the 22.6 GB exist once.
"""

import math

import torch
from torch import nn

from kforge.kernels.moe.deepseek import MoEConfig, moe_layer


def _draw_(weight: torch.Tensor) -> torch.Tensor:
    """In place, what the reference's `_linear` draws for an (out, in) weight: nn.Linear's
    kaiming-uniform init, then normal with std 1/sqrt(in) (the same random stream, consumed in
    the same amounts)."""
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    return nn.init.normal_(weight, std=weight.shape[1] ** -0.5)


class ModelNew(nn.Module):
    def __init__(self, hidden: int, inter: int, experts: int, top_k: int, n_group: int, topk_group: int,
                 shared: int, scaling: float):
        super().__init__()
        if shared != 1:
            raise ValueError("this solution stacks one shared expert of the routed experts' width")
        self.config = MoEConfig(hidden, inter, experts, top_k, n_group, topk_group, shared, scaling)
        with torch.no_grad():
            self.register_buffer("gate_weight", _draw_(torch.empty(experts, hidden, dtype=torch.bfloat16)))
            self.register_buffer("bias", torch.randn(experts) * 0.05)
            w13 = torch.empty(experts + 1, 2 * inter, hidden, dtype=torch.bfloat16)
            w2 = torch.empty(experts + 1, hidden, inter, dtype=torch.bfloat16)
            for e in range(experts + 1):  # the routed experts, then the shared one: gate, up, down each
                _draw_(w13[e, :inter]), _draw_(w13[e, inter:]), _draw_(w2[e])
        self.register_buffer("w13", w13)
        self.register_buffer("w2", w2)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.view(-1, shape[-1])
        return moe_layer(x, self.gate_weight, self.bias, self.w13, self.w2, self.config).view(shape)

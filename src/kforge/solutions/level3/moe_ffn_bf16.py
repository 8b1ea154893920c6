"""The Mixtral MoE feed-forward layer on kforge's grouped GEMM (problem: the file of the same
name in problems/level3).

The router runs exactly as the reference's (the same F.linear, fp32 softmax, top-k and
renormalization): a token sent to another expert would be wrong by its whole size, so
the routing is not the place to differ. Everything after it is `kernels/moe/ffn.py`: the
(token, slot) assignments sorted by expert without a host sync, one gather, then two
grouped GEMM launches for all experts, the first with SwiGLU fused (silu(W1 x) * W3 x never
leaves the chip as two projections), the second with the routing weight and the scatter
back to token order fused, and a sum over each token's two rows. Where the eager loop runs
~8 x 10 kernels, a torch.where host sync per expert and 24 cuBLAS GEMMs of ~512 rows (each
with its partial last wave), this runs ~15 small routing ops and two GEMMs of ~4600 rows.
On the CPU the grouped GEMM runs under the Triton interpreter.
"""

import torch
import torch.nn.functional as F
from torch import nn

from kforge.kernels.moe.ffn import moe_ffn


def _linear(in_features: int, out_features: int) -> nn.Linear:
    layer = nn.Linear(in_features, out_features, bias=False, dtype=torch.bfloat16)
    nn.init.normal_(layer.weight, std=in_features**-0.5)
    return layer


class ModelNew(nn.Module):
    def __init__(self, hidden: int, mlp: int, experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.gate = _linear(hidden, experts)
        # the reference's experts, drawn in its order (w1, w2, w3 each) under the same seed, then stacked:
        # w13[e] = [W1_e; W3_e] (gate rows first), w2[e] = W2_e
        w13, w2 = [], []
        for _ in range(experts):
            w1_e, w2_e, w3_e = _linear(hidden, mlp), _linear(mlp, hidden), _linear(hidden, mlp)
            w13.append(torch.cat((w1_e.weight, w3_e.weight)).detach())
            w2.append(w2_e.weight.detach())
        self.register_buffer("w13", torch.stack(w13))
        self.register_buffer("w2", torch.stack(w2))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = hidden_states.shape
        x = hidden_states.view(-1, hidden)
        routing_weights = F.softmax(self.gate(x), dim=1, dtype=torch.float)
        routing_weights, selected = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(x.dtype)
        return moe_ffn(x, selected, routing_weights, self.w13, self.w2).view(batch, seq, hidden)

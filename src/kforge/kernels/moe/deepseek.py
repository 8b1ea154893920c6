"""A DeepSeek-V3-shaped mixture-of-experts layer on kforge's MoE kernels, launch by launch.

For token x_t (hidden H), E routed experts and S shared ones, each a SwiGLU MLP of width I:

    logits = x_t Wg^T in fp32                        router (E, H)
    ids, w = sigmoid, bias-steered, group-limited top-k of E, weights renormalized and times
             routed_scaling_factor                 (`gating.py`; DeepSeek-V3 section 2.1.2)
    y_t    = sum_j w_tj FFN_{ids_tj}(x_t) + sum_s FFN_{E + s}(x_t)
    FFN_e(v) = W2_e (silu(W_gate_e v) * (W_up_e v))

Seven launches, none waiting on the device:
1. the router's GEMM (cuBLAS, fp32, as the model computes it) and `gating.gating_forward`;
2. `gating.append_shared_experts`: the shared experts become experts E .. E + S - 1 at weight 1,
   so one dispatch and one pair of grouped GEMMs run them with the routed ones;
3. `dispatch.dispatch`: the assignments sorted by expert, runs padded to `align` rows, and
   `grouped_gemm.contiguous_m_indices`, the contiguous layout's group per row;
4. a gather of each row's token (index_select);
5. the gate-up grouped GEMM with SwiGLU in its epilogue (contiguous layout): h = silu(xs
   W_gate^T) * (xs W_up^T), (rows, I), the (rows, 2I) projection never stored;
6. the down grouped GEMM: (rows, H);
7. `dispatch.combine`: each token's rows weighted and summed in fp32 in slot order, one rounding.

Weights: w13 (E + S, 2I, H) as [W_gate_e; W_up_e] per expert (gate rows first), w2 (E + S, H, I),
the shared experts last. FLOPs 6 * tokens * (top_k + S) * H * I in the experts (padding rows
on top: at align 128 and DeepSeek-V3's prefill sizes about a third of the computed rows),
2 * tokens * E * H in the router. Minimum bytes: the weights of every expert that receives a
token (3 H I each: 257 x 3 x 7168 x 2048 x 2 bytes = 22.6 GB when all are reached, as at prefill;
~223 of 257 at 64 tokens), x read and y written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kforge.kernels.moe.dispatch import combine, dispatch
from kforge.kernels.moe.gating import Gating, append_shared_experts, gating_forward
from kforge.kernels.moe.grouped_gemm import ROW_ALIGN, contiguous_m_indices, grouped_gemm_contiguous

INTERPRETER_ALIGN = 16  # under the interpreter, short runs: padding costs Python-speed rows


@dataclass(frozen=True)
class MoEConfig:
    """A DeepSeek-style MoE layer's sizes and router."""

    hidden: int
    inter: int  # each expert's width (the shared experts' too)
    experts: int  # routed
    top_k: int
    n_group: int
    topk_group: int
    shared: int
    routed_scaling_factor: float

    @property
    def gating(self) -> Gating:
        return Gating("sigmoid", self.top_k, self.n_group, self.topk_group, True, self.routed_scaling_factor)


DEEPSEEK_V3 = MoEConfig(hidden=7168, inter=2048, experts=256, top_k=8, n_group=8, topk_group=4, shared=1,
                        routed_scaling_factor=2.5)
SMALL = MoEConfig(hidden=64, inter=32, experts=16, top_k=4, n_group=4, topk_group=2, shared=1,
                  routed_scaling_factor=2.5)


def check_moe_layer(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor, w13: torch.Tensor,
                    w2: torch.Tensor, config: MoEConfig) -> None:
    """Raise a one-line ValueError unless the tensors make one layer of `config`."""
    c = config
    want = {"x": (None, c.hidden), "gate_weight": (c.experts, c.hidden), "bias": (c.experts,),
            "w13": (c.experts + c.shared, 2 * c.inter, c.hidden), "w2": (c.experts + c.shared, c.hidden, c.inter)}
    for name, t in (("x", x), ("gate_weight", gate_weight), ("bias", bias), ("w13", w13), ("w2", w2)):
        shape = want[name]
        if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
            raise ValueError(f"{name} must be {tuple('tokens' if s is None else s for s in shape)}, got "
                             f"{tuple(t.shape)}")


def moe_layer(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              config: MoEConfig, *, align: int | None = None) -> torch.Tensor:
    """y (tokens, H) in x's dtype (module docstring). `align` (default ROW_ALIGN on a GPU,
    INTERPRETER_ALIGN on the CPU) pads each expert's run; the GEMMs' tiles divide it."""
    check_moe_layer(x, gate_weight, bias, w13, w2, config)
    tokens = x.shape[0]
    if tokens == 0:
        return x.new_zeros(x.shape)
    align = align or (ROW_ALIGN if x.is_cuda else INTERPRETER_ALIGN)
    logits = F.linear(x.float(), gate_weight.float())
    ids, weights = gating_forward(logits, config.gating, bias)
    ids, weights = append_shared_experts(ids, weights, config.experts, config.shared)
    layout = dispatch(ids, weights, config.experts + config.shared, align)
    m_indices = contiguous_m_indices(layout)
    xs = x.index_select(0, layout.source_rows)
    h = grouped_gemm_contiguous(xs, w13, m_indices, gated=True, align=align)
    out = grouped_gemm_contiguous(h, w2, m_indices, align=align)
    return combine(out, layout.slots, weights, x.dtype)


def moe_layer_reference(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor, w13: torch.Tensor,
                        w2: torch.Tensor, config: MoEConfig) -> torch.Tensor:
    """The layer in float64 expert by expert, on the routing of `gating.gating_reference` (the
    tests' oracle: the routing is checked bit for bit elsewhere, the arithmetic here)."""
    from kforge.kernels.moe.gating import gating_reference

    ids, weights = gating_reference(F.linear(x.float(), gate_weight.float()), config.gating, bias)
    ids, weights = append_shared_experts(ids, weights, config.experts, config.shared)
    inter = config.inter
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for e in range(config.experts + config.shared):
        token, slot = (ids == e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        gate_up = x[token].double() @ w13[e].double().T
        h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out.index_add_(0, token, weights[token, slot, None].double() * (h @ w2[e].double().T))
    return out


def moe_layer_flops(tokens: int, config: MoEConfig) -> int:
    """Useful FLOPs: the router's GEMM and each token's top_k + shared expert MLPs (padding rows
    not counted)."""
    c = config
    return 2 * tokens * c.experts * c.hidden + 6 * tokens * (c.top_k + c.shared) * c.hidden * c.inter

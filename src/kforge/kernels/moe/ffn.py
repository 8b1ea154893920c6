"""A mixture-of-experts SwiGLU feed-forward layer on the grouped GEMM (Mixtral's experts).

For token t routed to experts e_tj with weights w_tj (j < top_k, from the caller's router):

    y_t = sum_j w_tj * W2[e_tj] (silu(W1[e_tj] x_t) * (W3[e_tj] x_t))

Four steps, two of them GEMM launches, none waiting on the device:
1. `routing.sort_by_expert`: the (t, j) assignments sorted by expert, runs padded to the
   tile height (a few small PyTorch ops);
2. gather: xs[r] = x[token of row r] (one index_select; (rows, H) read and written once);
3. grouped GEMM, gated: h = silu(xs W1^T) * (xs W3^T) over all experts at once;
4. grouped GEMM, scaled scatter: row r of h W2^T times its routing weight, stored at its
   assignment's row t * top_k + j; then y_t = the sum of its top_k adjacent rows.

Weights: w13 (E, 2I, H) is [W1_e; W3_e] stacked per expert (gate rows first), w2 (E, H, I).
FLOPs: 6 * tokens * top_k * H * I (plus the padding rows). Minimum bytes: every expert's
weights that receives a token read once, x read and y written (`moe_ffn_min_bytes`).
"""

from __future__ import annotations

import torch

from kforge.kernels.moe.grouped_gemm import ROW_ALIGN, grouped_gemm
from kforge.kernels.moe.routing import sort_by_expert

INTERPRETER_ALIGN = 32  # under the interpreter, short runs: padding costs Python-speed rows


def check_moe_inputs(x: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> None:
    """Raise ValueError on shapes that do not make one layer (the GEMMs check the rest)."""
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"x must be (tokens, H), w13 (E, 2I, H) and w2 (E, H, I); got {tuple(x.shape)}, "
                         f"{tuple(w13.shape)}, {tuple(w2.shape)}")
    experts, two_inter, hidden = w13.shape
    if hidden != x.shape[1] or two_inter % 2 or w2.shape != (experts, hidden, two_inter // 2):
        raise ValueError(f"with x {tuple(x.shape)}, w13 must be (E, 2I, H) and w2 (E, H, I); got {tuple(w13.shape)} "
                         f"and {tuple(w2.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids must be (tokens={x.shape[0]}, top_k), got {tuple(topk_ids.shape)}")


def moe_ffn(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
            w2: torch.Tensor, *, align: int | None = None) -> torch.Tensor:
    """y (tokens, H) in x's dtype: each token's top_k experts' SwiGLU outputs, weighted and summed.

    x (tokens, H); topk_ids, topk_weights (tokens, top_k); w13 (E, 2I, H); w2 (E, H, I).
    `align` (default ROW_ALIGN on a GPU, INTERPRETER_ALIGN on the CPU) pads each expert's
    rows; the GEMMs' autotuned tiles divide it.
    """
    check_moe_inputs(x, topk_ids, w13, w2)
    tokens, top_k = topk_ids.shape
    if tokens == 0:
        return x.new_zeros(x.shape)
    align = align or (ROW_ALIGN if x.is_cuda else INTERPRETER_ALIGN)
    layout = sort_by_expert(topk_ids, topk_weights, w13.shape[0], align)
    xs = x.index_select(0, layout.source_rows)
    h = grouped_gemm(xs, w13, layout.block_experts, layout.used_rows, gated=True, align=align)
    y = grouped_gemm(h, w2, layout.block_experts, layout.used_rows, row_scale=layout.weights,
                     dest_rows=layout.dest_rows, out_size=tokens * top_k, align=align)
    return y.view(tokens, top_k, -1).sum(1) if top_k > 1 else y


def moe_ffn_reference(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                      w2: torch.Tensor) -> torch.Tensor:
    """The layer in float64, token slot by token slot (the tests' oracle)."""
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for j in range(topk_ids.shape[1]):
        w13_t, w2_t = w13[topk_ids[:, j]].double(), w2[topk_ids[:, j]].double()  # (tokens, 2I, H), (tokens, H, I)
        gate_up = torch.einsum("th,tnh->tn", x.double(), w13_t)
        h = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out += topk_weights[:, j, None].double() * torch.einsum("ti,thi->th", h, w2_t)
    return out


def moe_ffn_min_bytes(tokens: int, hidden: int, inter: int, experts_used: int, itemsize: int = 2) -> int:
    """HBM bytes the layer must move: the weights of the experts in use (3 H I each) read once,
    x read and y written once."""
    return (experts_used * 3 * hidden * inter + 2 * tokens * hidden) * itemsize

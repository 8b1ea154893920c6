"""Mixture-of-experts routing as PyTorch operators: `moe_gate` (logits to top_k experts and
weights), `moe_dispatch` (assignments to the grouped GEMM's expert-sorted, padded rows, with
an optional capacity) and `moe_combine` (expert outputs back to tokens, weighted and summed).

    ids, w = moe_gate(logits, top_k=8, scoring="sigmoid", bias=bias, n_group=8, topk_group=4,
                      routed_scaling_factor=2.5)               # DeepSeek-V3's router
    layout = moe_dispatch(ids, w, num_experts=256, align=128, capacity=cap)
    y = moe_combine(expert_out, layout.slots, w)               # expert_out: (layout.rows, H)

and the grouped GEMMs in DeepGEMM's two layouts (`kforge::grouped_gemm`, bf16/fp16/fp32 or
FP8 e4m3 with 1 x 128 / 128 x 128 block scales, plain or with SwiGLU fused):

    out = grouped_gemm_contiguous(x, w, m_indices)              # x [M, K], a group a row, -1 padding
    out = grouped_gemm_masked(x, w, masked_m, gated=True)       # x [E, max_m, K], masked_m[e] rows valid
    out = grouped_gemm_contiguous(xq, wq, m_indices, x_scale=xs, w_scale=ws)   # FP8, bf16 out

`torch.library` custom ops (`kforge::moe_gate`, `kforge::moe_dispatch`, `kforge::moe_combine`,
`kforge::grouped_gemm`) with fake implementations, so torch.compile sees opaque nodes; inference
only. The grouped GEMMs run `kernels/moe/grouped_gemm.grouped_gemm_layout` on a CUDA device and
its fp32 reference elsewhere (rows the kernel leaves unwritten are zeros there; on the GPU they
are whatever the allocation held). On a
CUDA device they run the Triton kernels of `kforge.kernels.moe.gating` and `.dispatch`;
anything else (the CPU) runs their PyTorch references (`gating_reference`,
`routing.sort_by_expert`, `combine_reference`), which the kernels match bit for bit (the
softmax router's weights to fp32 rounding). The math, the tie rule and the layout are in
those modules' docstrings.
"""

from __future__ import annotations

import torch

from kforge.kernels.moe.dispatch import check_combine, combine_reference
from kforge.kernels.moe.gating import Gating, check_gating, gating_reference, kernel_limitation
from kforge.kernels.moe.grouped_gemm import ROW_ALIGN, check_layout_inputs, grouped_gemm_layout_reference
from kforge.kernels.moe.routing import ExpertRows, check_routing, padded_rows, sort_by_expert


@torch.library.custom_op("kforge::moe_gate", mutates_args=())
def _moe_gate(logits: torch.Tensor, bias: torch.Tensor | None, scoring: str, top_k: int, n_group: int,
              topk_group: int, renormalize: bool, routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    gate = Gating(scoring, top_k, n_group, topk_group, renormalize, routed_scaling_factor)
    if logits.is_cuda and kernel_limitation(logits, gate) is None:
        from kforge.kernels.moe.gating import gating_forward

        return gating_forward(logits, gate, bias)
    return gating_reference(logits, gate, bias)


@_moe_gate.register_fake
def _(logits, bias, scoring, top_k, n_group, topk_group, renormalize, routed_scaling_factor):
    return (logits.new_empty((logits.shape[0], top_k), dtype=torch.int32),
            logits.new_empty((logits.shape[0], top_k), dtype=torch.float32))


def moe_gate(logits: torch.Tensor, top_k: int, *, scoring: str = "softmax", bias: torch.Tensor | None = None,
             n_group: int = 1, topk_group: int = 1, renormalize: bool = True,
             routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids int32, topk_weights fp32), each (tokens, top_k), experts in rank order
    (largest score first, the lowest id among equals)."""
    gate = Gating(scoring, int(top_k), int(n_group), int(topk_group), bool(renormalize), float(routed_scaling_factor))
    check_gating(logits, gate, bias)
    return _moe_gate(logits, bias, gate.scoring, gate.top_k, gate.n_group, gate.topk_group, gate.renormalize,
                     gate.routed_scaling_factor)


@torch.library.custom_op("kforge::moe_dispatch", mutates_args=())
def _moe_dispatch(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, align: int, capacity: int,
                  capacities: torch.Tensor | None) -> list[torch.Tensor]:
    cap = capacities if capacities is not None else (None if capacity < 0 else capacity)
    if topk_ids.is_cuda:
        from kforge.kernels.moe.dispatch import dispatch

        layout = dispatch(topk_ids, topk_weights, num_experts, align, capacity=cap)
    else:
        layout = sort_by_expert(topk_ids, topk_weights, num_experts, align, capacity=cap)
    return [layout.source_rows, layout.dest_rows, layout.weights, layout.block_experts, layout.used_rows,
            layout.counts, layout.kept, layout.slots]


@_moe_dispatch.register_fake
def _(topk_ids, topk_weights, num_experts, align, capacity, capacities):
    tokens, top_k = topk_ids.shape
    rows = padded_rows(tokens * top_k, num_experts, align, None if capacities is not None or capacity < 0 else capacity)
    empty = topk_ids.new_empty
    return [empty(rows, dtype=torch.int64), empty(rows, dtype=torch.int32), empty(rows, dtype=torch.float32),
            empty(rows // align, dtype=torch.int32), empty(1, dtype=torch.int32),
            empty(num_experts, dtype=torch.int64), empty(num_experts, dtype=torch.int64),
            empty((tokens, top_k), dtype=torch.int32)]


def moe_dispatch(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, align: int, *,
                 capacity: int | torch.Tensor | None = None) -> ExpertRows:
    """The assignments sorted by expert, each expert's run padded to `align` rows, at most
    `capacity` assignments an expert (an int for every expert, or an (E,) integer tensor),
    the rest dropped in token order (`kforge.kernels.moe.routing`)."""
    check_routing(topk_ids, topk_weights, num_experts, align)
    per_expert = capacity if isinstance(capacity, torch.Tensor) else None
    scalar = -1 if capacity is None or per_expert is not None else int(capacity)
    if per_expert is None and capacity is not None and scalar < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    return ExpertRows(int(align), *_moe_dispatch(topk_ids, topk_weights, int(num_experts), int(align), scalar,
                                                 per_expert))


@torch.library.custom_op("kforge::moe_combine", mutates_args=())
def _moe_combine(expert_out: torch.Tensor, slots: torch.Tensor, topk_weights: torch.Tensor | None,
                 out_dtype: torch.dtype) -> torch.Tensor:
    if expert_out.is_cuda:
        from kforge.kernels.moe.dispatch import combine

        return combine(expert_out, slots, topk_weights, out_dtype)
    return combine_reference(expert_out, slots, topk_weights, out_dtype)


@_moe_combine.register_fake
def _(expert_out, slots, topk_weights, out_dtype):
    return expert_out.new_empty((slots.shape[0], expert_out.shape[1]), dtype=out_dtype)


def moe_combine(expert_out: torch.Tensor, slots: torch.Tensor, topk_weights: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y (tokens, H) = sum_j topk_weights[t, j] * expert_out[slots[t, j]] (dropped slots, -1,
    add 0), summed in fp32 in slot order and rounded once to out_dtype (default expert_out's);
    topk_weights=None when the grouped GEMM has applied them."""
    check_combine(expert_out, slots, topk_weights)
    return _moe_combine(expert_out, slots, topk_weights, out_dtype or expert_out.dtype)


@torch.library.custom_op("kforge::grouped_gemm", mutates_args=())
def _grouped_gemm(x: torch.Tensor, weight: torch.Tensor, groups: torch.Tensor, x_scale: torch.Tensor | None,
                  w_scale: torch.Tensor | None, layout: str, gated: bool, align: int) -> torch.Tensor:
    if x.is_cuda:
        from kforge.kernels.moe.grouped_gemm import grouped_gemm_layout

        return grouped_gemm_layout(x, weight, groups, layout, gated=gated, x_scale=x_scale, w_scale=w_scale,
                                   align=align)
    out_dtype = torch.bfloat16 if x.dtype == torch.float8_e4m3fn else x.dtype
    return grouped_gemm_layout_reference(x, weight, groups, layout, gated=gated, x_scale=x_scale, w_scale=w_scale,
                                         dtype=torch.float32, fill=0.0).to(out_dtype)


@_grouped_gemm.register_fake
def _(x, weight, groups, x_scale, w_scale, layout, gated, align):
    n = weight.shape[1] // 2 if gated else weight.shape[1]
    return x.new_empty((*x.shape[:-1], n), dtype=torch.bfloat16 if x.dtype == torch.float8_e4m3fn else x.dtype)


def grouped_gemm_contiguous(x: torch.Tensor, weight: torch.Tensor, m_indices: torch.Tensor, *, gated: bool = False,
                            x_scale: torch.Tensor | None = None, w_scale: torch.Tensor | None = None,
                            align: int = ROW_ALIGN) -> torch.Tensor:
    """out [M, N]: row r of x [M, K] times weight[m_indices[r]]^T (weight [E, N, K]); groups
    concatenated along M, each run starting at a multiple of `align` rows, m_indices -1 on
    padding rows (not written). gated: weight [E, 2N, K] as [gate; up], out silu(gate) * up.
    FP8: e4m3 x and weight with x_scale [M, K/128] and w_scale [E, ceil(NW/128), K/128], bf16 out."""
    check_layout_inputs(x, weight, m_indices, "contiguous", gated, x_scale, w_scale, int(align))
    return _grouped_gemm(x, weight, m_indices, x_scale, w_scale, "contiguous", bool(gated), int(align))


def grouped_gemm_masked(x: torch.Tensor, weight: torch.Tensor, masked_m: torch.Tensor, *, gated: bool = False,
                        x_scale: torch.Tensor | None = None, w_scale: torch.Tensor | None = None) -> torch.Tensor:
    """out [E, max_m, N]: for each expert e, its first masked_m[e] rows of x [E, max_m, K] times
    weight[e]^T; rows past masked_m[e] not written. gated and FP8 as grouped_gemm_contiguous
    (x_scale [E, max_m, K/128])."""
    check_layout_inputs(x, weight, masked_m, "masked", gated, x_scale, w_scale, 1)
    return _grouped_gemm(x, weight, masked_m, x_scale, w_scale, "masked", bool(gated), 1)

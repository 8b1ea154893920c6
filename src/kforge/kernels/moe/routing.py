"""Routed tokens sorted by expert: the row layout the grouped GEMM reads.

A router sends token t to top_k experts, topk_ids[t, j] with weight topk_weights[t, j].
Call each (t, j) an assignment, numbered a = t * top_k + j. Expert e receives the n_e
assignments with topk_ids = e (ragged; n_e may be 0). The grouped GEMM wants them as one
matrix whose row tiles each belong to a single expert, so:

- the assignments are sorted by expert, stably (within an expert, token order);
- expert e's run starts at row P_e = sum_{e' < e} ceil(n_e' / align) * align: every run is
  padded to a multiple of `align` rows (the largest tile height the GEMM uses), so a tile
  of BM rows (BM dividing align) never straddles two experts;
- per row, what the GEMM needs: the token it reads (`source_rows`), the assignment its
  result belongs to (`dest_rows`: the output row a = t * top_k + j, or -1 on a padding
  row, whose result is dropped), the routing weight (`weights`, 0 on padding), and per
  block of `align` rows its expert (`block_experts`).

Padding costs at most align - 1 rows an expert (E * (align - 1) rows in all, an upper
bound the buffers are sized for); the rows actually used, `used_rows`, stay on the device.

A capacity bounds an expert's rows (the straggler and its memory): expert e keeps its
first kept_e = min(n_e, capacity_e) assignments in assignment order (token order) and
drops the rest, which get no row (n_e above reads kept_e); `kept` counts what stays,
`slots` gives every assignment its row or -1, so the combine can gather each token's rows
(`dispatch.combine_reference`).
`expert_capacity` is the usual ceil(capacity_factor * tokens * top_k / experts).

This is the reference `dispatch.dispatch` (Triton) matches bit for bit.

Everything is a handful of PyTorch ops that never wait for the device (no bincount, no
nonzero, no .item(): those would stall the host until the router has run), so the GEMM
launches queue behind them. Expert ids outside [0, E) are the caller's bug: scatter_add_
refuses them (a device assert on CUDA).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertRows:
    """The assignments sorted by expert, each expert's run padded to `align` rows; `rows`
    (the first dimension of every per-row tensor) is the padded upper bound."""

    align: int
    source_rows: torch.Tensor  # (rows,) int64: the token a row reads (0 on padding: any real row will do)
    dest_rows: torch.Tensor  # (rows,) int32: the assignment t * top_k + j a row computes; -1 on padding
    weights: torch.Tensor  # (rows,) fp32: the assignment's routing weight; 0 on padding
    block_experts: torch.Tensor  # (rows // align,) int32: the expert of each block of `align` rows
    used_rows: torch.Tensor  # (1,) int32: rows in use, sum_e ceil(kept_e / align) * align
    counts: torch.Tensor  # (E,) int64: assignments per expert
    kept: torch.Tensor  # (E,) int64: assignments per expert within its capacity (= counts without one)
    slots: torch.Tensor  # (tokens, top_k) int32: the row of each assignment; -1 if dropped

    @property
    def rows(self) -> int:
        return self.source_rows.shape[0]


def padded_rows(assignments: int, num_experts: int, align: int, capacity: int | None = None) -> int:
    """Rows the padded layout may need: every expert's run rounded up to `align`, at worst;
    with a capacity, no run longer than the capacity rounded up."""
    rows = -(-(assignments + num_experts * (align - 1)) // align) * align
    if capacity is None:
        return rows
    return min(rows, num_experts * (-(-capacity // align) * align))


def expert_capacity(tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """ceil(capacity_factor * tokens * top_k / num_experts): a capacity factor of 1 holds a
    perfectly balanced routing exactly."""
    if not capacity_factor > 0:
        raise ValueError(f"the capacity factor must be > 0, got {capacity_factor}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    return math.ceil(capacity_factor * tokens * top_k / num_experts)


def capacity_tensor(capacity: int | torch.Tensor | None, num_experts: int, device) -> torch.Tensor:
    """Per-expert capacities, (E,) int64 on `device`: None is unbounded, an int every expert's."""
    if isinstance(capacity, torch.Tensor):
        if capacity.shape != (num_experts,) or capacity.is_floating_point() or capacity.device != torch.device(device):
            raise ValueError(f"a per-expert capacity must be integer ({num_experts},) on {device}; got "
                             f"{tuple(capacity.shape)} {capacity.dtype} on {capacity.device}")
        return capacity.long()
    if capacity is not None and capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    bound = torch.iinfo(torch.int32).max if capacity is None else capacity
    return torch.full((num_experts,), bound, dtype=torch.int64, device=device)


def check_routing(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, align: int) -> None:
    """Raise ValueError on routing the layout cannot take (ids are checked by scatter_add_)."""
    if topk_ids.dim() != 2 or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids and topk_weights must both be (tokens, top_k); got {tuple(topk_ids.shape)} and "
                         f"{tuple(topk_weights.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64) or not topk_weights.is_floating_point():
        raise ValueError(f"topk_ids must be int32/int64 and topk_weights floating point; got {topk_ids.dtype} and "
                         f"{topk_weights.dtype}")
    if topk_ids.device != topk_weights.device:
        raise ValueError(f"topk_ids ({topk_ids.device}) and topk_weights ({topk_weights.device}) are on different "
                         f"devices")
    if num_experts < 1 or align < 1:
        raise ValueError(f"num_experts and align must be >= 1, got {num_experts} and {align}")


def sort_by_expert(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, align: int, *,
                   capacity: int | torch.Tensor | None = None) -> ExpertRows:
    """The padded expert-sorted layout of the assignments (see the module docstring).
    `capacity`: None (keep all), an int (every expert's) or an (E,) integer tensor."""
    check_routing(topk_ids, topk_weights, num_experts, align)
    device = topk_ids.device
    tokens, top_k = topk_ids.shape
    experts = topk_ids.reshape(-1).long()
    assignments = experts.numel()
    rows = padded_rows(assignments, num_experts, align, None if isinstance(capacity, torch.Tensor) else capacity)
    caps = capacity_tensor(capacity, num_experts, device)

    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, experts,
                                                                                      torch.ones_like(experts))
    order = torch.argsort(experts, stable=True)  # assignment ids, expert by expert
    kept = torch.minimum(counts, caps)
    padded = (kept + align - 1) // align * align
    run_ends = padded.cumsum(0)
    run_starts = run_ends - padded  # first padded row of each expert
    sorted_starts = counts.cumsum(0) - counts  # first position of each expert in `order`
    expert_of = experts[order]
    rank = torch.arange(assignments, device=device) - sorted_starts[expert_of]  # within the expert, token order
    keep = rank < caps[expert_of]
    # a dropped assignment goes to row `rows`, one past the end, cut off below: no host sync
    row_of = torch.where(keep, run_starts[expert_of] + rank, rows)

    source_rows = torch.zeros(rows + 1, dtype=torch.int64, device=device).index_copy_(0, row_of, order // top_k)
    dest_rows = torch.full((rows + 1,), -1, dtype=torch.int32, device=device).index_copy_(0, row_of, order.int())
    weights = torch.zeros(rows + 1, dtype=torch.float32, device=device).index_copy_(
        0, row_of, topk_weights.reshape(-1)[order].float())
    slots = torch.empty(assignments, dtype=torch.int32, device=device).index_copy_(
        0, order, torch.where(keep, row_of, -1).int())
    block_starts = torch.arange(0, rows, align, device=device)
    # blocks past used_rows get E (clamped to a valid id): the GEMM never reaches them
    block_experts = torch.searchsorted(run_ends, block_starts, right=True).clamp_(max=num_experts - 1).int()
    return ExpertRows(align, source_rows[:rows], dest_rows[:rows], weights[:rows], block_experts,
                      run_ends[-1:].int(), counts, kept, slots.view(tokens, top_k))

"""MoE dispatch and combine in Triton: the routed assignments into the grouped GEMM's
expert-sorted rows, and the expert outputs back into tokens.

Dispatch gives the layout `routing.sort_by_expert` defines (its reference, matched bit for
bit): assignment a = t * top_k + j of expert e = topk_ids[t, j] gets row
run_start[e] + rank_a, rank_a being the number of earlier assignments (in a's order, i.e.
token order) to the same expert, when rank_a < capacity_e; otherwise it is dropped.
A counting sort, in four launches over blocks of BLOCK assignments:

1. histogram: each block counts its assignments per expert (`tl.histogram`), (blocks, E);
2. scan: per expert, the exclusive prefix sum of those counts over the blocks (where each
   block's assignments to e start within e's run) and the total n_e;
3. layout, one program: kept_e = min(n_e, capacity_e), runs padded to `align` and their
   starts (an exclusive scan over the experts), used_rows, and the expert of every
   `align`-row block (how many run ends lie at or before its first row);
4. scatter: each block ranks its assignments among the block's own to the same expert
   (a BLOCK x BLOCK comparison, no atomics), adds the block's offset from 2, and writes
   the row's token, assignment and weight and the assignment's row (`slots`).
No step depends on the order in which programs run, so the layout is the same every run,
and nothing waits for the device (no host sync): the grouped GEMM's launches queue behind.

Combine: y_t = sum_j w_tj * out[slots[t, j]] over the token's kept assignments (a dropped
one adds 0), in fp32, j in order, rounded once to the output dtype. One program gathers one
token's rows (a BLOCK_H slice of them): no atomics, so the sum's order is fixed and the
result bit-identical to `combine_reference`. Contraction into FMAs is turned off so each
product rounds as PyTorch's does. With the weights already applied (the grouped GEMM's
`row_scale`), pass weights=None: a plain sum.

Bytes: dispatch reads the ids and weights a few times and writes a row's token, assignment
and weight (16 bytes a row), a few MB at DeepSeek-V3's 4096 tokens x top-8; combine reads
tokens * top_k rows of the expert output and writes tokens rows: its floor is that traffic
over the copy bandwidth. Not measured on a GPU yet.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kforge.kernels.moe.routing import ExpertRows, capacity_tensor, check_routing, padded_rows

BLOCK = 64  # assignments a program: the rank's BLOCK x BLOCK comparison stays in registers
SCAN_BLOCKS = 64  # blocks a scan step covers
SCAN_EXPERTS = 32  # experts a scan program covers
ROW_BLOCKS = 64  # align-row blocks a step of the layout kernel labels
COMBINE_H = 256  # hidden columns a combine program sums


@triton.jit
def histogram_kernel(ids_ptr, block_counts_ptr, A, E, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr):
    b = tl.program_id(0)
    a = b * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(ids_ptr + a, mask=a < A, other=-1).to(tl.int32)
    ok = (e >= 0) & (e < E)  # an id out of range is the caller's bug: counted nowhere, written nowhere
    counts = tl.histogram(tl.where(ok, e, 0), BLOCK_E, mask=ok)
    bins = tl.arange(0, BLOCK_E)
    tl.store(block_counts_ptr + b * E + bins, counts, mask=bins < E)


@triton.jit
def scan_kernel(block_counts_ptr, block_offsets_ptr, counts_ptr, num_blocks, E,
                SCAN_BLOCKS: tl.constexpr, SCAN_EXPERTS: tl.constexpr):
    e = tl.program_id(0) * SCAN_EXPERTS + tl.arange(0, SCAN_EXPERTS)[None, :]
    running = tl.zeros([SCAN_EXPERTS], dtype=tl.int32)
    for start in range(0, num_blocks, SCAN_BLOCKS):
        b = start + tl.arange(0, SCAN_BLOCKS)[:, None]
        mask = (b < num_blocks) & (e < E)
        c = tl.load(block_counts_ptr + b * E + e, mask=mask, other=0)
        tl.store(block_offsets_ptr + b * E + e, running[None, :] + tl.cumsum(c, 0) - c, mask=mask)
        running += tl.sum(c, 0)
    tl.store(counts_ptr + e, running[None, :].to(tl.int64), mask=e < E)


@triton.jit
def layout_kernel(counts_ptr, capacity_ptr, kept_ptr, run_starts_ptr, used_rows_ptr, block_experts_ptr, E,
                  row_blocks, ALIGN: tl.constexpr, BLOCK_E: tl.constexpr, ROW_BLOCKS: tl.constexpr):
    e = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + e, mask=e < E, other=0)
    kept = tl.minimum(counts, tl.load(capacity_ptr + e, mask=e < E, other=0))
    padded = (kept + ALIGN - 1) // ALIGN * ALIGN
    run_ends = tl.cumsum(padded, 0)
    tl.store(kept_ptr + e, kept, mask=e < E)
    tl.store(run_starts_ptr + e, run_ends - padded, mask=e < E)
    tl.store(used_rows_ptr, tl.sum(padded).to(tl.int32))
    # a block's expert: the number of runs that end at or before its first row (runs of
    # experts without rows end where they start, so they are skipped), clamped to E - 1
    ends = tl.where(e < E, run_ends, 1 << 62)[None, :]
    for start in range(0, row_blocks, ROW_BLOCKS):
        block = start + tl.arange(0, ROW_BLOCKS)
        done = tl.sum((ends <= block[:, None].to(tl.int64) * ALIGN).to(tl.int32), 1)
        tl.store(block_experts_ptr + block, tl.minimum(done, E - 1), mask=block < row_blocks)


@triton.jit
def scatter_kernel(ids_ptr, weights_ptr, block_offsets_ptr, capacity_ptr, run_starts_ptr, source_rows_ptr,
                   dest_rows_ptr, row_weights_ptr, slots_ptr, A, E, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    a = b * BLOCK + i
    e = tl.load(ids_ptr + a, mask=a < A, other=-1).to(tl.int32)
    ok = (e >= 0) & (e < E)
    # rank within the block among the same expert: the earlier assignments with the same id
    same = (e[:, None] == e[None, :]) & (i[None, :] < i[:, None])
    rank = tl.sum(same.to(tl.int32), 1) + tl.load(block_offsets_ptr + b * E + e, mask=ok, other=0)
    keep = ok & (rank < tl.load(capacity_ptr + e, mask=ok, other=0))
    row = tl.load(run_starts_ptr + e, mask=keep, other=0) + rank
    tl.store(source_rows_ptr + row, (a // TOP_K).to(tl.int64), mask=keep)
    tl.store(dest_rows_ptr + row, a, mask=keep)
    tl.store(row_weights_ptr + row, tl.load(weights_ptr + a, mask=keep, other=0.0).to(tl.float32), mask=keep)
    tl.store(slots_ptr + a, tl.where(keep, row, -1).to(tl.int32), mask=a < A)


def dispatch(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, align: int, *,
             capacity: int | torch.Tensor | None = None) -> ExpertRows:
    """`routing.sort_by_expert` in four Triton launches: the same ExpertRows, bit for bit."""
    check_routing(topk_ids, topk_weights, num_experts, align)
    device = topk_ids.device
    tokens, top_k = topk_ids.shape
    assignments = tokens * top_k
    rows = padded_rows(assignments, num_experts, align, None if isinstance(capacity, torch.Tensor) else capacity)
    caps = capacity_tensor(capacity, num_experts, device)
    ids = topk_ids.contiguous().view(-1)
    weights = topk_weights.contiguous().view(-1)
    blocks = max(1, triton.cdiv(assignments, BLOCK))
    block_e = triton.next_power_of_2(num_experts)

    block_counts = torch.empty(blocks, num_experts, dtype=torch.int32, device=device)
    block_offsets = torch.empty_like(block_counts)
    counts = torch.empty(num_experts, dtype=torch.int64, device=device)
    kept = torch.empty_like(counts)
    run_starts = torch.empty_like(counts)
    used_rows = torch.empty(1, dtype=torch.int32, device=device)
    block_experts = torch.empty(rows // align, dtype=torch.int32, device=device)
    source_rows = torch.zeros(rows, dtype=torch.int64, device=device)  # padding rows read token 0
    dest_rows = torch.full((rows,), -1, dtype=torch.int32, device=device)
    row_weights = torch.zeros(rows, dtype=torch.float32, device=device)
    slots = torch.empty(tokens, top_k, dtype=torch.int32, device=device)

    histogram_kernel[(blocks,)](ids, block_counts, assignments, num_experts, BLOCK=BLOCK, BLOCK_E=block_e)
    scan_kernel[(triton.cdiv(num_experts, SCAN_EXPERTS),)](block_counts, block_offsets, counts, blocks, num_experts,
                                                            SCAN_BLOCKS=SCAN_BLOCKS, SCAN_EXPERTS=SCAN_EXPERTS)
    layout_kernel[(1,)](counts, caps, kept, run_starts, used_rows, block_experts, num_experts, rows // align,
                        ALIGN=align, BLOCK_E=block_e, ROW_BLOCKS=ROW_BLOCKS)
    scatter_kernel[(blocks,)](ids, weights, block_offsets, caps, run_starts, source_rows, dest_rows, row_weights,
                              slots, assignments, num_experts, TOP_K=top_k, BLOCK=BLOCK)
    return ExpertRows(align, source_rows, dest_rows, row_weights, block_experts, used_rows, counts, kept, slots)


class ExpertLoad(NamedTuple):
    """One expert's share of a dispatch, as the grouped GEMM sees it."""

    expert: int
    routed: int  # assignments sent to it
    kept: int  # within its capacity
    dropped: int  # beyond it, in token order
    tiles: int  # align-row tiles its run takes
    padding: int  # rows of those tiles that hold no assignment
    utilization: float | None  # kept / (tiles * align): the share of the tiles' rows doing real work; None if no tile


def expert_loads(layout: ExpertRows) -> list[ExpertLoad]:
    """Per expert: routed, kept, dropped, tiles, padding rows, tile utilization (reads the
    counts on the host)."""
    loads = []
    for e, (routed, kept) in enumerate(zip(layout.counts.tolist(), layout.kept.tolist(), strict=True)):
        tiles = -(-kept // layout.align)
        loads.append(ExpertLoad(e, routed, kept, routed - kept, tiles, tiles * layout.align - kept,
                                kept / (tiles * layout.align) if tiles else None))
    return loads


# --- combine -------------------------------------------------------------------------------------

def check_combine(expert_out: torch.Tensor, slots: torch.Tensor, topk_weights: torch.Tensor | None) -> None:
    if expert_out.dim() != 2 or slots.dim() != 2 or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"expert_out must be (rows, H) and slots integer (tokens, top_k); got "
                         f"{tuple(expert_out.shape)} and {tuple(slots.shape)} {slots.dtype}")
    if topk_weights is not None and topk_weights.shape != slots.shape:
        raise ValueError(f"topk_weights {tuple(topk_weights.shape)} must match slots {tuple(slots.shape)}")
    if slots.device != expert_out.device or (topk_weights is not None and topk_weights.device != slots.device):
        raise ValueError("expert_out, slots and topk_weights must be on one device")


def combine_reference(expert_out: torch.Tensor, slots: torch.Tensor, topk_weights: torch.Tensor | None = None,
                      out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y (tokens, H): sum over j of topk_weights[t, j] * expert_out[slots[t, j]], dropped
    slots (-1) adding 0; fp32, j in order, rounded once to out_dtype (expert_out's)."""
    check_combine(expert_out, slots, topk_weights)
    tokens, top_k = slots.shape
    acc = torch.zeros(tokens, expert_out.shape[1], dtype=torch.float32, device=expert_out.device)
    for j in range(top_k):
        rows = slots[:, j].long()
        term = expert_out[rows.clamp(min=0)].float()
        if topk_weights is not None:
            term = topk_weights[:, j, None].float() * term
        acc = acc + torch.where(rows[:, None] >= 0, term, 0.0)
    return acc.to(out_dtype or expert_out.dtype)


@triton.jit
def combine_kernel(out_ptr, expert_ptr, slots_ptr, weights_ptr, H, stride_expert, stride_out,
                   TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, WEIGHTED: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        row = tl.load(slots_ptr + t * TOP_K + j).to(tl.int64)
        term = tl.load(expert_ptr + row * stride_expert + h, mask=(h < H) & (row >= 0), other=0.0).to(tl.float32)
        if WEIGHTED:
            term = tl.load(weights_ptr + t * TOP_K + j).to(tl.float32) * term
        acc = acc + tl.where(row >= 0, term, 0.0)
    tl.store(out_ptr + t * stride_out + h, acc.to(out_ptr.dtype.element_ty), mask=h < H)


def combine(expert_out: torch.Tensor, slots: torch.Tensor, topk_weights: torch.Tensor | None = None,
            out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`combine_reference` in one Triton launch, bit for bit."""
    check_combine(expert_out, slots, topk_weights)
    tokens, top_k = slots.shape
    hidden = expert_out.shape[1]
    out = torch.empty(tokens, hidden, dtype=out_dtype or expert_out.dtype, device=expert_out.device)
    if tokens == 0 or hidden == 0:
        return out
    expert_out = expert_out if expert_out.stride(1) == 1 else expert_out.contiguous()
    block_h = min(COMBINE_H, triton.next_power_of_2(hidden))
    weights = topk_weights.contiguous() if topk_weights is not None else slots
    combine_kernel[(tokens, triton.cdiv(hidden, block_h))](
        out, expert_out, slots.contiguous(), weights, hidden, expert_out.stride(0), out.stride(0), TOP_K=top_k,
        BLOCK_H=block_h, WEIGHTED=topk_weights is not None, enable_fp_fusion=False)
    return out

"""MLA decode (FlashMLA's contract): every query head of a request attends to one shared latent
cache, in two Triton kernels (split-KV partials, then a combine). On a Hopper GPU `mla_decode`
runs kernel 1 in CUDA instead (`decode_hopper.py`: 1.3-3.1x these kernels on the H200) for the
inputs it takes; these kernels are the fallback, the FP8 cache's path and the CPU's.

DeepSeek-V2/V3 cache one latent per token, c_t (512 dims) and a RoPE key k_r,t (64 dims), for
all heads at once. With the up-projections absorbed into the query (q'_h = W_UK,h^T q_nope,h,
512 dims, next to the 64 RoPE dims q_r,h) and the value projection applied after attention,
each head h is plain attention with head dim 576 for the keys and 512 for the values, over
rows of the same cache:

    K_t = [c_t, k_r,t] (576),  V_t = c_t (the first 512 of the same row),
    out[b, i, h] = sum_t softmax_t(scale * q[b, i, h] . K_t) V_t,   t < limit(b, i),
    lse[b, h, i] = log sum_t exp(scale * q[b, i, h] . K_t)          (natural log, fp32).

Causal over the s_q query tokens of a speculative step: query i of s_q sees the first
limit(b, i) = n_b - s_q + i + 1 tokens (n_b = cache_seqlens[b], which counts the s_q new
tokens); without `causal`, all n_b. A query with no visible token (n_b = 0, or n_b < s_q
under causal) gets out = 0 and lse = -inf (the log of an empty sum).

Work: per visible (query row, token), 2 x 576 FLOPs for the scores and 2 x 512 for P V;
bytes: 576 x 2 per cached token (bf16) once, shared by all h_q x s_q rows. So the arithmetic
intensity is ~1.9 FLOP/byte per row: at h_q x s_q = 16 (DeepSeek-V3 decode on 8 GPUs) it is
memory-bound (~30 FLOP/B against the H100's ~300), at 128 rows and above it is compute-bound.

Kernel 1, one program per (request, block of BLOCK_M query rows, split of the context), or,
scheduled (below), one program a resident slot taking such work from a queue:
- The rows are (query token i, head h) pairs flattened i-major, so one program holds many
  heads: the cache tile is read once per block of rows, and the scores are one tl.dot of
  [BLOCK_M, 512] x [512, BLOCK_N] plus [BLOCK_M, 64] x [64, BLOCK_N] (two dots because Triton's
  tiles are powers of two: 576 = 512 + 64).
- Each tile of BLOCK_N tokens gathers its pages per token through the block table (page ids
  widened to int64: a pool may pass 2^31 elements) and reads each token's 576 values once; the
  first 512 serve as K and as V (acc += P V reuses the loaded tile, no second read).
- Online softmax in log2 units (log2(e) folded into the scale); a row whose tiles are all
  masked keeps m = -inf and is guarded so exp2(-inf - -inf) never makes a NaN.
- A request in one split is normalised and written as out and lse; a split of several writes
  its partial out (normalised, fp32) and its lse to a workspace.
Kernel 2, one program per (request, query row): lse = log sum_s exp(lse_s), out = sum_s
exp(lse_s - lse) out_s, over the splits the request has.

Splits. G = batch x ceil(h_q s_q / BLOCK_M) programs a split run on `resident_per_sm` x SMs
slots at once, so a launch takes ceil(G x splits / slots) waves of one split's length each;
the split count to take minimises waves x split length, the fewest splits within 5% of the
best, none shorter than MIN_SPLIT_TOKENS (a split's partials, BLOCK_M x 512 x 4 bytes written
and read, must stay small next to its split x 1152 bytes of cache). On the H200 the waves are
what counted: at batch 128 and 16 rows, 2 splits (256 programs, one wave) took 390 us, 3
splits (384 programs, two waves) 495 us, 4 splits 394 (mla-decode-sweep.txt).
- By default the lengths decide, on the device (`mla_decode_schedule_kernel`, one program in
  front of the call; no host read, so a CUDA graph may hold it): it applies that rule to the
  actual lengths, giving request b ceil(len_b / size) items, and kernel 1 runs persistent, one
  program a slot, each taking the next item from an atomic queue (items differ in length; a
  fixed share per program lost 10% on a ragged batch). H200, against the host plan below
  (mla-decode-sweep.txt, part 8): ragged batches 1.13-1.55x faster (batch 128, 16 heads,
  lengths in [1, 8192]: 359 -> 294 us), full ones 0.89-1.00x (batch 128, 16 heads: 0.97x;
  batch 32: 0.89x): the schedule's launch and loops, and the scheduled build's spills (below),
  in shares not measured.
- `config` with a split_size, or batches past MAX_SCHEDULED_BATCH: `plan_mla_decode` sizes
  splits on the host from the block table's width, for the longest request; a program whose
  split starts past its request's length exits at once.

Tiles: BLOCK_M = 64 rows (fewer if h_q x s_q is smaller, at least 16 for tl.dot) on 8 warps;
16 and 32 rows on 4 warps; BLOCK_N = 32 tokens, 2 stages. The fp32 accumulator is BLOCK_M x
512 (128 KB at 64 rows), the reason BLOCK_N stays at 32. What Triton 3.6 makes of it for
sm_90, compiled offline (bf16, causal, split; `tests/kernels/test_mla_decode.py` checks
these): at BLOCK_M = 64, 226-255 registers a thread, 144 KB of shared memory (one program an
SM), wgmma for both dots; BLOCK_N = 64 needs 216 KB and 255 registers, 4 warps spill 1.8 KB
a thread, and one stage spills too. At 16 and 32 rows on 4 warps, mma.sync (a warpgroup's M
is 64); 32 rows spill (10 instructions, 36 with the schedule's loop), kept because the H200
ran them 1.7x faster than 8 warps. fp32 inputs (a check, not a speed) take 32 x 16 tiles on
8 warps. `config` overrides every choice (sweeps, the interpreter tests).

Measured on the H200 (`kforge bench mla`, bf16, batch 128, the host plan): 16 rows at 66-73%
of the copy rate (2.9-4.1x eager), 32 rows at 50-54%; from 64 rows on 155-162 TFLOP/s, 20% of
the matmul rate, whatever the row block (16- and 32-row blocks were slower there): the
64-row tile's dots, K = 32 tokens deep for P V, are the limit, not the plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kforge.device import sm_count

LOG2E = 1.4426950408889634
H100_SMS = 132
PROGRAMS_PER_SM = 2  # sparse prefill's list splits
MIN_SPLIT_TOKENS = 256
SPLIT_TOLERANCE = 0.05
MAX_WAVES = 8
MAX_SCHEDULED_BATCH = 4096
MAX_SCHEDULE_CHUNKS = 64
SCHEDULE_SLACK = 4  # the scheduled grid's items, in resident slots' worth
SM_SHARED_BYTES = 227 * 1024
SM_REGISTERS = 65536
MAX_THREAD_REGISTERS = 255
LATENT_DIM = 576  # the cache row a tile holds: 512 latent + 64 RoPE values
MAX_COMBINE_BLOCK = 16
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
PAGE_SIZES = (16, 32, 64, 128, 256)
FP8_GROUP = 128  # latent values sharing one scale in the FP8 cache (FlashMLA's)
_FP8_GROUP = tl.constexpr(FP8_GROUP)  # the same, for the kernel


@triton.jit
def mla_decode_split_kernel(
        q_ptr, cache_ptr, block_table_ptr, seqlens_ptr, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
        stride_qb, stride_qs, stride_qh, stride_cp, stride_ct, stride_table,
        h_q, s_q, max_pages, num_splits, split_size, qk_scale,
        scale_ptr, rope_ptr, stride_sp, stride_st, stride_rp, stride_rt, schedule_ptr, batch,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_V: tl.constexpr, D_ROPE: tl.constexpr,
        PAGE_SIZE: tl.constexpr, CAUSAL: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
        FP8_CACHE: tl.constexpr = False, SCHEDULED: tl.constexpr = False, BLOCK_B: tl.constexpr = 1):
    m_blocks = tl.cdiv(s_q * h_q, BLOCK_M)
    if SCHEDULED:  # persistent: each program takes the next of the schedule's items x row blocks until none
        # is left (a queue, not a fixed share: items differ in length, as the hardware's own scheduling)
        work_total = tl.load(schedule_ptr + 1 + batch) * m_blocks
        work = tl.atomic_add(schedule_ptr + 2 + batch, 1)
        while work < work_total:
            item = work // m_blocks
            offs_b = tl.arange(0, BLOCK_B)  # read each time, not held through the work (registers)
            starts = tl.load(schedule_ptr + 1 + offs_b, mask=offs_b < batch, other=2147483647)
            request = tl.sum((starts <= item).to(tl.int32), 0) - 1  # the last request starting at or before it
            size = tl.load(schedule_ptr)
            first = tl.load(schedule_ptr + 1 + request)
            # a request of one item is written whole (the combine skips it); else partials item-major
            whole = tl.load(schedule_ptr + 2 + request) - first == 1
            _attend_split(q_ptr, cache_ptr, block_table_ptr, seqlens_ptr, out_ptr, lse_ptr, part_out_ptr,
                          part_lse_ptr, stride_qb, stride_qs, stride_qh, stride_cp, stride_ct, stride_table,
                          h_q, s_q, max_pages, qk_scale, scale_ptr, rope_ptr, stride_sp, stride_st, stride_rp,
                          stride_rt, request, work % m_blocks, (item - first) * size, size, whole,
                          item.to(tl.int64) * (s_q * h_q),
                          BLOCK_M, BLOCK_N, D_V, D_ROPE, PAGE_SIZE, CAUSAL, DOT_PRECISION, FP8_CACHE, 1)
            work = tl.atomic_add(schedule_ptr + 2 + batch, 1)
    else:
        request = tl.program_id(0) // m_blocks
        split = tl.program_id(1)
        start = split * split_size
        if SPLIT:
            if start >= tl.minimum(tl.load(seqlens_ptr + request), max_pages * PAGE_SIZE):
                return  # the combine reads only the splits a request has
        _attend_split(q_ptr, cache_ptr, block_table_ptr, seqlens_ptr, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
                      stride_qb, stride_qs, stride_qh, stride_cp, stride_ct, stride_table,
                      h_q, s_q, max_pages, qk_scale, scale_ptr, rope_ptr, stride_sp, stride_st, stride_rp, stride_rt,
                      request, tl.program_id(0) % m_blocks, start, split_size, not SPLIT,
                      (request * (s_q * h_q)).to(tl.int64) * num_splits + split,
                      BLOCK_M, BLOCK_N, D_V, D_ROPE, PAGE_SIZE, CAUSAL, DOT_PRECISION, FP8_CACHE, num_splits)


@triton.jit
def _attend_split(q_ptr, cache_ptr, block_table_ptr, seqlens_ptr, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
                  stride_qb, stride_qs, stride_qh, stride_cp, stride_ct, stride_table,
                  h_q, s_q, max_pages, qk_scale, scale_ptr, rope_ptr, stride_sp, stride_st, stride_rp, stride_rt,
                  request, m_block, start, split_size, whole, partial_base,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_V: tl.constexpr, D_ROPE: tl.constexpr,
                  PAGE_SIZE: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
                  FP8_CACHE: tl.constexpr, row_stride):
    """One program's work: BLOCK_M query rows of `request` over its tokens [start, start +
    split_size), then the answer (`whole`) or a partial at partial_base + row x row_stride (row
    stride: the static plan keeps a row's splits together, the schedule an item's rows)."""
    rows_total = s_q * h_q
    # clamped to the block-table row, so an unchecked length never reads past it
    length = tl.minimum(tl.load(seqlens_ptr + request), max_pages * PAGE_SIZE)
    end = tl.minimum(start + split_size, length)

    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    real = rows < rows_total
    token_of_row = rows // h_q  # the query token i of s_q
    head = rows % h_q
    if CAUSAL:
        limit = length - s_q + token_of_row + 1
    else:
        limit = tl.zeros([BLOCK_M], tl.int32) + length
    offs_v = tl.arange(0, D_V)
    offs_r = tl.arange(0, D_ROPE)
    q_rows = q_ptr + request.to(tl.int64) * stride_qb + token_of_row * stride_qs + head * stride_qh
    q_nope = tl.load(q_rows[:, None] + offs_v[None, :], mask=real[:, None], other=0.0)
    q_rope = tl.load(q_rows[:, None] + D_V + offs_r[None, :], mask=real[:, None], other=0.0)
    table = block_table_ptr + request.to(tl.int64) * stride_table

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_V], tl.float32)
    for tile in range(start, end, BLOCK_N):
        offs_n = tile + tl.arange(0, BLOCK_N)
        live = offs_n < end
        page = tl.load(table + offs_n // PAGE_SIZE, mask=live, other=0).to(tl.int64)
        token_rows = cache_ptr + page * stride_cp + (offs_n % PAGE_SIZE) * stride_ct
        if FP8_CACHE:  # e4m3 latent x its group's fp32 scale, rounded to q's dtype for both dots
            slot = offs_n % PAGE_SIZE
            latent = tl.load(token_rows[:, None] + offs_v[None, :], mask=live[:, None], other=0.0)
            groups = tl.arange(0, D_V // _FP8_GROUP)
            scale = tl.load((scale_ptr + page * stride_sp + slot * stride_st)[:, None] + groups[None, :],
                            mask=live[:, None], other=0.0)  # [BLOCK_N, D_V / 128]
            grouped = tl.reshape(latent.to(tl.float32), [BLOCK_N, D_V // _FP8_GROUP, _FP8_GROUP]) * scale[:, :, None]
            kv = tl.reshape(grouped, [BLOCK_N, D_V]).to(q_nope.dtype)
            k_rope = tl.load((rope_ptr + page * stride_rp + slot * stride_rt)[:, None] + offs_r[None, :],
                             mask=live[:, None], other=0.0)
        else:
            kv = tl.load(token_rows[:, None] + offs_v[None, :], mask=live[:, None], other=0.0)  # K's first 512, V
            k_rope = tl.load(token_rows[:, None] + D_V + offs_r[None, :], mask=live[:, None], other=0.0)
        s = tl.dot(q_nope, tl.trans(kv), input_precision=DOT_PRECISION)
        s = tl.dot(q_rope, tl.trans(k_rope), s, input_precision=DOT_PRECISION) * qk_scale
        visible = live[None, :] & (offs_n[None, :] < limit[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(kv.dtype), kv, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    seen = l_i > 0.0
    out = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
    lse2 = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    flat = request * rows_total + rows  # (request, query token, head), flattened
    if whole:
        _store_final(out_ptr, lse_ptr, out, lse2, flat, request, head, token_of_row, real, h_q, s_q, D_V)
    else:
        _store_partial(part_out_ptr, part_lse_ptr, out, lse2, partial_base + rows.to(tl.int64) * row_stride, real, D_V)


@triton.jit
def _store_partial(part_out_ptr, part_lse_ptr, out, lse2, partial, real, D_V: tl.constexpr):
    """A split's normalised output (fp32) and its lse (log2 units) at `partial`."""
    offs_v = tl.arange(0, D_V)
    tl.store(part_lse_ptr + partial, lse2, mask=real)
    tl.store(part_out_ptr + partial[:, None] * D_V + offs_v[None, :], out, mask=real[:, None])


@triton.jit
def _store_final(out_ptr, lse_ptr, out, lse2, flat, request, head, token_of_row, real, h_q, s_q, D_V: tl.constexpr):
    """The answer: out in its dtype, lse (batch, h_q, s_q) in natural-log units."""
    offs_v = tl.arange(0, D_V)
    tl.store(out_ptr + flat.to(tl.int64)[:, None] * D_V + offs_v[None, :], out.to(out_ptr.dtype.element_ty),
             mask=real[:, None])
    tl.store(lse_ptr + (request * h_q + head) * s_q + token_of_row, lse2 * 0.6931471805599453, mask=real)  # x ln 2


@triton.jit
def mla_decode_schedule_kernel(seqlens_ptr, schedule_ptr, batch, max_tokens, m_blocks, slots, max_chunks,
                               BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr,
                               TOLERANCE: tl.constexpr):
    """One program: the split size for these lengths, and each request's first work item.

    For c = 1..max_chunks splits of the longest request (each a multiple of BLOCK_N, none under
    MIN_SPLIT but the whole), the items are sum_b ceil(len_b / size) and the time ~ the waves of
    items x m_blocks programs on `slots` times (size + one tile, a split's fixed cost); the
    fewest splits within TOLERANCE of the best win. Writes schedule = [size, first item of
    request 0..batch-1, total items, 0 (the split kernel's queue)]: request b owns items
    [schedule[1 + b], schedule[2 + b])."""
    offs_b = tl.arange(0, BLOCK_B)
    lens = tl.load(seqlens_ptr + offs_b, mask=offs_b < batch, other=0)
    lens = tl.maximum(tl.minimum(lens, max_tokens), 0)
    longest = tl.maximum(tl.max(lens, 0), 1)
    best = float("inf")
    for c in range(1, max_chunks + 1):
        size = tl.cdiv(tl.cdiv(longest, c), BLOCK_N) * BLOCK_N
        items = tl.sum(tl.cdiv(lens, size), 0)
        cost = tl.cdiv(items * m_blocks, slots).to(tl.float32) * (size + BLOCK_N).to(tl.float32)
        best = tl.where((c == 1) | (size >= MIN_SPLIT), tl.minimum(best, cost), best)
    chosen = tl.cdiv(longest, BLOCK_N) * BLOCK_N  # one split: always allowed
    found = 0
    for c in range(1, max_chunks + 1):
        size = tl.cdiv(tl.cdiv(longest, c), BLOCK_N) * BLOCK_N
        items = tl.sum(tl.cdiv(lens, size), 0)
        cost = tl.cdiv(items * m_blocks, slots).to(tl.float32) * (size + BLOCK_N).to(tl.float32)
        take = (found == 0) & ((c == 1) | (size >= MIN_SPLIT)) & (cost <= best * (1.0 + TOLERANCE))
        chosen = tl.where(take, size, chosen)
        found = tl.where(take, 1, found)
    counts = tl.cdiv(lens, chosen)
    ends = tl.cumsum(counts, 0)
    tl.store(schedule_ptr, chosen)
    tl.store(schedule_ptr + 1 + offs_b, ends - counts, mask=offs_b < batch)
    tl.store(schedule_ptr + 1 + batch, tl.sum(counts, 0))
    tl.store(schedule_ptr + 2 + batch, 0)  # the split kernel's work queue


@triton.jit
def mla_decode_combine_kernel(part_out_ptr, part_lse_ptr, seqlens_ptr, out_ptr, lse_ptr,
                              h_q, s_q, max_tokens, num_splits, split_size, schedule_ptr,
                              D_V: tl.constexpr, BLOCK_S: tl.constexpr, SCHEDULED: tl.constexpr = False):
    flat = tl.program_id(0)  # (request, query token, head)
    rows_total = s_q * h_q
    request = flat // rows_total
    row = flat % rows_total
    if SCHEDULED:  # the request's items, partials item-major (stride: a row of every item)
        first_item = tl.load(schedule_ptr + 1 + request)
        written = tl.load(schedule_ptr + 2 + request) - first_item
        if written == 1:  # kernel 1 wrote the answer itself
            return
        first = first_item.to(tl.int64) * rows_total + row
        step = rows_total
    else:
        length = tl.minimum(tl.load(seqlens_ptr + request), max_tokens)
        written = tl.cdiv(length, split_size)  # kernel 1 skipped the splits past the length
        first = flat.to(tl.int64) * num_splits
        step = 1
    offs_s = tl.arange(0, BLOCK_S)
    offs_v = tl.arange(0, D_V)

    top = tl.full([BLOCK_S], float("-inf"), tl.float32)
    for s0 in range(0, written, BLOCK_S):  # the largest lse first, so no weight overflows
        top = tl.maximum(top, tl.load(part_lse_ptr + first + (s0 + offs_s) * step, mask=s0 + offs_s < written,
                                      other=float("-inf")))
    top_max = tl.max(top, 0)
    top_safe = tl.where(top_max == float("-inf"), 0.0, top_max)

    weights = tl.zeros([BLOCK_S], tl.float32)
    acc = tl.zeros([BLOCK_S, D_V], tl.float32)
    for s0 in range(0, written, BLOCK_S):
        mine = s0 + offs_s < written
        at = first + (s0 + offs_s) * step
        w = tl.math.exp2(tl.load(part_lse_ptr + at, mask=mine, other=float("-inf")) - top_safe)
        weights += w
        acc += w[:, None] * tl.load(part_out_ptr + at[:, None] * D_V + offs_v[None, :], mask=mine[:, None], other=0.0)
    total = tl.sum(weights, 0)
    seen = total > 0.0
    out = tl.where(seen, tl.sum(acc, 0) / tl.where(seen, total, 1.0), 0.0)
    lse2 = tl.where(seen, top_safe + tl.math.log2(tl.where(seen, total, 1.0)), float("-inf"))
    tl.store(out_ptr + flat.to(tl.int64) * D_V + offs_v, out.to(out_ptr.dtype.element_ty))
    tl.store(lse_ptr + (request * h_q + row % h_q) * s_q + row // h_q, lse2 * 0.6931471805599453)  # x ln 2


@dataclass(frozen=True)
class MlaPlan:
    """How a call splits: BLOCK_M query rows and BLOCK_N tokens a tile, splits of
    `split_size` tokens (a multiple of block_n), `num_splits` for the longest request."""

    block_m: int
    block_n: int
    split_size: int
    num_splits: int
    num_warps: int = 8
    num_stages: int = 2

    @property
    def split(self) -> bool:
        return self.num_splits > 1


def resident_per_sm(block_m: int, block_n: int, num_stages: int, num_warps: int, element_size: int) -> int:
    """Programs of one tiling an SM holds: the register file at 255 registers a thread (Triton's
    builds of these tiles take 210-255), and shared memory (`num_stages` cache tiles of BLOCK_N
    x 576 and the BLOCK_M x 576 query tile, within 227 KB). 2 at 16 and 32 rows on 4 warps, 1 at
    64 on 8: the H200 sweep's wave pattern read the same (the module docstring)."""
    by_registers = SM_REGISTERS // (num_warps * 32 * MAX_THREAD_REGISTERS)
    by_shared = SM_SHARED_BYTES // ((num_stages * block_n + block_m) * LATENT_DIM * element_size)
    return max(1, min(by_registers, by_shared))


def _wave_split(programs: int, max_tokens: int, block_n: int, slots: int) -> int:
    """The split size (a multiple of block_n, none under MIN_SPLIT_TOKENS but the whole) that
    finishes first when `programs` programs a split run on `slots` resident at once: time ~
    waves x (split length + one tile, a split's fixed cost), as the device schedule counts it.
    For w waves the best count is the most that fit in them, floor(w x slots / programs), so
    only those for w up to MAX_WAVES are tried (past a few waves more splits only trade
    rounding). The fewest splits within SPLIT_TOLERANCE of the best win: the model leaves out
    the combine's read and the partials' write."""
    tokens = max(1, max_tokens)
    most = max(1, math.ceil(tokens / MIN_SPLIT_TOKENS))
    counts = sorted({1, most} | {min(most, w * slots // max(1, programs)) for w in range(1, MAX_WAVES + 1)} - {0})
    costs = []
    for splits in counts:
        size = math.ceil(math.ceil(tokens / splits) / block_n) * block_n
        if splits == 1 or size >= MIN_SPLIT_TOKENS:
            costs.append((math.ceil(programs * splits / slots) * (size + block_n), size))
    best = min(cost for cost, _ in costs)
    return next(size for cost, size in costs if cost <= best * (1 + SPLIT_TOLERANCE))


def plan_mla_decode(batch: int, rows: int, max_tokens: int, num_sms: int = H100_SMS,
                    config: dict | None = None, element_size: int = 2) -> MlaPlan:
    """Tiles and splits for `batch` requests of `rows` = h_q x s_q query rows each, the longest
    at most `max_tokens` (module docstring: "Splits"), inputs of `element_size` bytes (fp32 tiles
    are halved both ways: 64 x 32 spills and overflows shared memory). `config` (BLOCK_M,
    BLOCK_N, split_size, num_warps, num_stages, each optional) overrides the choice."""
    config = dict(config or {})
    wide = element_size > 2
    block_m = config.pop("BLOCK_M", min(32 if wide else 64, max(16, triton.next_power_of_2(rows))))
    block_n = config.pop("BLOCK_N", 16 if wide else 32)
    num_warps = config.pop("num_warps", 4 if block_m <= 32 and not wide else 8)
    num_stages = config.pop("num_stages", 2)
    if "split_size" in config:
        split_size = config.pop("split_size")
    else:
        split_size = _wave_split(batch * math.ceil(rows / block_m), max_tokens, block_n,
                                 num_sms * resident_per_sm(block_m, block_n, num_stages, num_warps, element_size))
    if config:
        raise ValueError(f"unknown config keys {sorted(config)}: use BLOCK_M, BLOCK_N, split_size, num_warps, "
                         f"num_stages")
    for name, value in (("BLOCK_M", block_m), ("BLOCK_N", block_n)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 16 (tl.dot), got {value}")
    if split_size < block_n or split_size % block_n:
        raise ValueError(f"split_size must be a positive multiple of BLOCK_N ({block_n}), got {split_size}")
    num_splits = max(1, math.ceil(max_tokens / split_size))
    if num_splits > 65535:
        raise ValueError(f"{num_splits} splits exceed the grid's 65535: use larger splits")
    return MlaPlan(block_m, block_n, split_size, num_splits, num_warps, num_stages)


def schedule_chunks(plan: MlaPlan, batch: int, rows: int, max_tokens: int, num_sms: int, element_size: int) -> int:
    """The most splits a request may get when the device schedules the splits from the lengths
    (`mla_decode_schedule_kernel`, which tries each count up to it), or 0 for the host's plan
    alone (`chunks_for`), with this plan's resident programs an SM."""
    slots = num_sms * resident_per_sm(plan.block_m, plan.block_n, plan.num_stages, plan.num_warps, element_size)
    return chunks_for(plan.num_splits, batch * math.ceil(rows / plan.block_m), slots, batch, max_tokens)


def chunks_for(host_splits: int, programs: int, slots: int, batch: int, max_tokens: int) -> int:
    """The schedule's most items a request, for `programs` programs a split on `slots` resident
    ones, or 0: batches past MAX_SCHEDULED_BATCH (the schedule reads all lengths in one block),
    host plans past MAX_SCHEDULE_CHUNKS splits (a few long requests: the schedule's loop would
    cost more than balancing saves), or one split at most. At least the host plan's count (what
    full-length requests want), and up to SCHEDULE_SLACK x the slots' worth of items for shorter
    ones, capped at MAX_SCHEDULE_CHUNKS; the partials' buffer holds batch x it."""
    if batch > MAX_SCHEDULED_BATCH or host_splits > MAX_SCHEDULE_CHUNKS:
        return 0
    most = max(1, math.ceil(max_tokens / MIN_SPLIT_TOKENS))
    wanted = math.ceil(SCHEDULE_SLACK * slots / programs)
    chunks = min(most, max(host_splits, min(wanted, MAX_SCHEDULE_CHUNKS)))
    return chunks if chunks > 1 else 0


def schedule_block(batch: int) -> int:
    """The lengths the schedule reads in one block: at least 128 (smaller blocks made ptxas emit up to
    hundreds of spill instructions in kernel 1's scheduled 64-row build, which reads the same block;
    2 at 128 and up, tests/kernels/test_mla_decode.py compiles 128 and 4096)."""
    return max(128, triton.next_power_of_2(batch))


def launch_schedule(cache_seqlens: torch.Tensor, max_tokens: int, m_blocks: int, slots: int, chunks: int,
                    block_n: int) -> torch.Tensor:
    """`mla_decode_schedule_kernel` on the lengths: the (batch + 3,) int32 schedule it writes."""
    batch = cache_seqlens.shape[0]
    schedule = _empty((batch + 3,), torch.int32, cache_seqlens.device)
    mla_decode_schedule_kernel[(1,)](
        cache_seqlens, schedule, batch, max_tokens, m_blocks, slots, chunks, BLOCK_B=schedule_block(batch),
        BLOCK_N=block_n, MIN_SPLIT=MIN_SPLIT_TOKENS, TOLERANCE=SPLIT_TOLERANCE, num_warps=4)
    return schedule


def check_mla_inputs(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                     cache_seqlens: torch.Tensor, head_dim_v: int, softmax_scale: float | None,
                     same_device: bool = True) -> float:
    """Raise ValueError on anything the kernels cannot take (shapes, dtypes, devices, strides; no
    device read); return the softmax scale (default 1/sqrt(q's head dim), as FlashMLA).
    `same_device` False: kv_cache is a stand-in of the shape only (the FP8 cache checks its own)."""
    if q.dim() != 4:
        raise ValueError(f"q must be 4-D (batch, s_q, h_q, head_dim), got {tuple(q.shape)}")
    if kv_cache.dim() != 4 or kv_cache.shape[2] != 1:
        raise ValueError(f"kv_cache must be (num_pages, page_size, 1, head_dim): one latent head, got "
                         f"{tuple(kv_cache.shape)}")
    batch, s_q, h_q, head_dim = q.shape
    num_pages, page_size, _, cache_dim = kv_cache.shape
    if cache_dim != head_dim:
        raise ValueError(f"q's head dim {head_dim} differs from the cache's {cache_dim}")
    rope = head_dim - head_dim_v
    for name, value in (("head_dim_v", head_dim_v), ("head_dim - head_dim_v", rope)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 16 (DeepSeek: 512 + 64 = 576), got {value}")
    if page_size not in PAGE_SIZES:
        raise ValueError(f"page_size {page_size} is not supported (supported: {', '.join(map(str, PAGE_SIZES))})")
    if num_pages == 0 or s_q == 0 or h_q == 0:
        raise ValueError(f"empty pool or query: q {tuple(q.shape)}, kv_cache {tuple(kv_cache.shape)}")
    if q.dtype != kv_cache.dtype or q.dtype not in DTYPES:
        raise ValueError(f"q and kv_cache must share one dtype of bfloat16, float16, float32; got {q.dtype} and "
                         f"{kv_cache.dtype}")
    if q.stride(3) != 1 or kv_cache.stride(3) != 1:
        raise ValueError(f"q and kv_cache need a contiguous head dim, got strides {q.stride()} and "
                         f"{kv_cache.stride()}")
    if block_table.dim() != 2 or block_table.shape[0] != batch or block_table.shape[1] == 0:
        raise ValueError(f"block_table must be (batch={batch}, max_pages >= 1), got {tuple(block_table.shape)}")
    if cache_seqlens.shape != (batch,):
        raise ValueError(f"cache_seqlens must be (batch={batch},), got {tuple(cache_seqlens.shape)}")
    if block_table.dtype != torch.int32 or cache_seqlens.dtype != torch.int32:
        raise ValueError(f"block_table and cache_seqlens must be int32, got {block_table.dtype} and "
                         f"{cache_seqlens.dtype}")
    devices = {t.device for t in (q, *((kv_cache,) if same_device else ()), block_table, cache_seqlens)}
    if len(devices) != 1:
        raise ValueError(f"the inputs are on different devices: {sorted(map(str, devices))}")
    if block_table.stride(1) != 1 or cache_seqlens.stride(0) != 1:
        raise ValueError("block_table rows and cache_seqlens must be contiguous")
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    if not math.isfinite(scale):
        raise ValueError(f"softmax_scale must be finite, got {scale}")
    return scale


def check_mla_table_values(block_table: torch.Tensor, cache_seqlens: torch.Tensor, num_pages: int,
                           page_size: int) -> None:
    """Raise ValueError unless every length is in [0, the block-table row's tokens] and every page a
    request's tokens occupy is a page of the pool. One device-to-host read."""
    lengths = cache_seqlens.long()
    max_pages = block_table.shape[1]
    occupied = torch.arange(max_pages, device=lengths.device) * page_size < lengths[:, None]
    bad_page = occupied & ((block_table < 0) | (block_table >= num_pages))
    negative, too_long = lengths < 0, lengths > max_pages * page_size
    if not any(torch.stack([negative.any(), too_long.any(), bad_page.any()]).tolist()):
        return
    if negative.any() or too_long.any():
        b = int((negative | too_long).nonzero()[0])
        raise ValueError(f"cache_seqlens[{b}] = {int(lengths[b])} is outside [0, {max_pages * page_size}] "
                         f"({max_pages} pages x {page_size} tokens)")
    b, j = (int(i) for i in bad_page.nonzero()[0])
    raise ValueError(f"block_table[{b}, {j}] = {int(block_table[b, j])} is not a page of the pool "
                     f"(0..{num_pages - 1}) but request {b} keeps tokens there")


def _empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer the kernels write, uninitialised: each element is written before it is read
    (the tests fill these with NaN to prove it)."""
    return torch.empty(shape, dtype=dtype, device=device)


def mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor,
               head_dim_v: int = 512, *, softmax_scale: float | None = None, causal: bool = False,
               validate: bool = True, config: dict | None = None,
               backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(out (batch, s_q, h_q, head_dim_v) in q's dtype, lse (batch, h_q, s_q) fp32) of q
    (batch, s_q, h_q, head_dim) over the latent cache (num_pages, page_size, 1, head_dim) through
    block_table (batch, max_pages) int32 and cache_seqlens (batch,) int32.

    `validate` reads the lengths and page ids back once to refuse bad ones; pass False where the
    tables are trusted (a serving loop, a CUDA graph): lengths are then clamped to the block-table
    row. Splits are sized on the device from the lengths (module docstring: "Splits"); `config`
    fixes the tiling (see `plan_mla_decode`), and with a split_size the splits, on the host.
    `backend`: "triton" (these kernels), "cuda" (decode_hopper.py: DeepSeek's dims, bf16/fp16,
    pages of 64-256, sm_90), or "auto": the CUDA kernel wherever it takes the inputs and no
    `config` is given."""
    if backend not in ("auto", "triton", "cuda"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'cuda', got {backend!r}")
    if backend != "triton" and not config:
        from kforge.kernels.mla import decode_hopper

        scale = check_mla_inputs(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale)
        if backend == "cuda":
            return decode_hopper.mla_decode_hopper(q, kv_cache, block_table, cache_seqlens, head_dim_v,
                                                   softmax_scale=softmax_scale, causal=causal, validate=validate)
        if decode_hopper.hopper_unsupported(q, kv_cache, head_dim_v, scale) is None:
            return decode_hopper.run_checked(q, kv_cache, block_table, cache_seqlens, head_dim_v, scale, causal,
                                             validate, None)
    elif backend == "cuda":
        raise ValueError("config tunes the Triton kernels: backend 'cuda' takes none")
    else:
        scale = check_mla_inputs(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale)
    if validate:
        check_mla_table_values(block_table, cache_seqlens, kv_cache.shape[0], kv_cache.shape[1])
    cache_args = (kv_cache, kv_cache.stride(0), kv_cache.stride(1))
    return _launch(q, cache_args, None, block_table, cache_seqlens, head_dim_v, kv_cache.shape[1], scale, causal,
                   config)


@dataclass(frozen=True)
class Fp8LatentCache:
    """The latent cache in FP8, as FlashMLA keeps it: per token, the 512 latent values in e4m3 with
    one fp32 scale per 128 (656 bytes with the RoPE part, against 1152 in bf16), and the 64 RoPE
    values in q's dtype (they are few, and rotated values lose more to rounding).

    latent (num_pages, page_size, head_dim_v) float8_e4m3fn, scales (num_pages, page_size,
    head_dim_v / 128) fp32, rope (num_pages, page_size, rope_dim) bf16 or fp16."""

    latent: torch.Tensor
    scales: torch.Tensor
    rope: torch.Tensor

    @classmethod
    def quantize(cls, kv_cache: torch.Tensor, head_dim_v: int = 512) -> Fp8LatentCache:
        """From a (num_pages, page_size, 1, head_dim) cache: each group of 128 latent values scaled
        so its largest magnitude is e4m3's largest (448); an all-zero group keeps scale 1."""
        rows = kv_cache[:, :, 0]
        pages, page_size, _ = rows.shape
        groups = rows[..., :head_dim_v].float().reshape(pages, page_size, head_dim_v // FP8_GROUP, FP8_GROUP)
        largest = groups.abs().amax(-1)
        scales = torch.where(largest > 0, largest / torch.finfo(torch.float8_e4m3fn).max, 1.0)
        latent = (groups / scales[..., None]).reshape(pages, page_size, head_dim_v).to(torch.float8_e4m3fn)
        return cls(latent, scales, rows[..., head_dim_v:].contiguous())

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The (num_pages, page_size, 1, head_dim) cache the kernel computes with: each latent value
        times its scale, rounded to `dtype` (as the kernel rounds it for its dots), then the RoPE part."""
        pages, page_size, width = self.latent.shape
        groups = self.latent.float().reshape(pages, page_size, width // FP8_GROUP, FP8_GROUP) * self.scales[..., None]
        latent = groups.reshape(pages, page_size, width).to(dtype)
        return torch.cat([latent, self.rope.to(dtype)], -1)[:, :, None]


def check_fp8_cache(q: torch.Tensor, cache: Fp8LatentCache) -> int:
    """Raise ValueError unless `cache` is an FP8 latent cache `q` can attend to; return head_dim_v."""
    latent, scales, rope = cache.latent, cache.scales, cache.rope
    if latent.dim() != 3 or latent.dtype != torch.float8_e4m3fn:
        raise ValueError(f"the FP8 cache's latent must be float8_e4m3fn (num_pages, page_size, head_dim_v), got "
                         f"{latent.dtype} {tuple(latent.shape)}")
    pages, page_size, head_dim_v = latent.shape
    if head_dim_v % FP8_GROUP:
        raise ValueError(f"head_dim_v must be a multiple of {FP8_GROUP} (one scale per {FP8_GROUP}), got {head_dim_v}")
    if scales.shape != (pages, page_size, head_dim_v // FP8_GROUP) or scales.dtype != torch.float32:
        raise ValueError(f"the FP8 cache's scales must be fp32 {(pages, page_size, head_dim_v // FP8_GROUP)}, got "
                         f"{scales.dtype} {tuple(scales.shape)}")
    if rope.dim() != 3 or rope.shape[:2] != (pages, page_size) or rope.dtype != q.dtype:
        raise ValueError(f"the FP8 cache's rope must be (num_pages, page_size, rope_dim) in q's dtype {q.dtype}, got "
                         f"{rope.dtype} {tuple(rope.shape)}")
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"an FP8 cache is read into bf16 or fp16 dots: q must be one of them, got {q.dtype}")
    if latent.stride(2) != 1 or scales.stride(2) != 1 or rope.stride(2) != 1:
        raise ValueError("the FP8 cache's tensors need a contiguous last dim")
    if len({latent.device, scales.device, rope.device, q.device}) != 1:
        raise ValueError("the FP8 cache and q are on different devices")
    return head_dim_v


def mla_decode_fp8(q: torch.Tensor, cache: Fp8LatentCache, block_table: torch.Tensor, cache_seqlens: torch.Tensor,
                   *, softmax_scale: float | None = None, causal: bool = False, validate: bool = True,
                   config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`mla_decode` over an FP8 latent cache (`Fp8LatentCache`): each tile's latent is scaled back
    and rounded to q's dtype in registers, then the same dots and softmax run. q (batch, s_q, h_q,
    head_dim_v + rope_dim) in bf16 or fp16."""
    head_dim_v = check_fp8_cache(q, cache)
    pages, page_size, _ = cache.latent.shape
    # the shape checks shared with the bf16 cache, on a stand-in of the cache's logical shape
    stand_in = torch.empty((pages, page_size, 1, q.shape[3]), dtype=q.dtype, device="meta")
    scale = check_mla_inputs(q, stand_in, block_table, cache_seqlens, head_dim_v, softmax_scale, same_device=False)
    if cache.rope.shape[2] != q.shape[3] - head_dim_v:
        raise ValueError(f"q's head dim {q.shape[3]} is not the cache's {head_dim_v} + {cache.rope.shape[2]}")
    if validate:
        check_mla_table_values(block_table, cache_seqlens, pages, page_size)
    cache_args = (cache.latent, cache.latent.stride(0), cache.latent.stride(1))
    fp8_args = (cache.scales, cache.rope, cache.scales.stride(0), cache.scales.stride(1), cache.rope.stride(0),
                cache.rope.stride(1))
    return _launch(q, cache_args, fp8_args, block_table, cache_seqlens, head_dim_v, page_size, scale, causal, config)


def _launch(q, cache_args, fp8_args, block_table, cache_seqlens, head_dim_v: int, page_size: int, scale: float,
            causal: bool, config: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Both kernels on checked inputs: the bf16/fp16/fp32 cache (fp8_args None) or the FP8 one."""
    batch, s_q, h_q, head_dim = q.shape
    out = _empty((batch, s_q, h_q, head_dim_v), q.dtype, q.device)
    lse = _empty((batch, h_q, s_q), torch.float32, q.device)
    if batch == 0:
        return out, lse
    max_pages = block_table.shape[1]
    rows = s_q * h_q
    num_sms = sm_count(q.device) if q.is_cuda else H100_SMS
    max_tokens = max_pages * page_size
    plan = plan_mla_decode(batch, rows, max_tokens, num_sms, config, q.element_size())
    m_blocks = triton.cdiv(rows, plan.block_m)
    chunks = 0 if config and "split_size" in config else schedule_chunks(plan, batch, rows, max_tokens, num_sms,
                                                                         q.element_size())
    cache, stride_cp, stride_ct = cache_args
    scales, rope, stride_sp, stride_st, stride_rp, stride_rt = fp8_args or (out, out, 0, 0, 0, 0)  # unread: bf16
    if chunks:  # splits sized on the device from the lengths (module docstring: "Splits")
        block_b = schedule_block(batch)
        slots = num_sms * resident_per_sm(plan.block_m, plan.block_n, plan.num_stages, plan.num_warps,
                                          q.element_size())
        schedule = launch_schedule(cache_seqlens, max_tokens, m_blocks, slots, chunks, plan.block_n)
        part_out = _empty((batch * chunks, rows, head_dim_v), torch.float32, q.device)
        part_lse = _empty((batch * chunks, rows), torch.float32, q.device)
        # persistent: one program a resident slot, walking the items
        grid, num_splits = (min(slots, batch * chunks * m_blocks), 1), chunks
    else:
        schedule, block_b, num_splits = cache_seqlens, 1, plan.num_splits  # unread without SCHEDULED
        if plan.split:
            part_out = _empty((batch, rows, plan.num_splits, head_dim_v), torch.float32, q.device)
            part_lse = _empty((batch, rows, plan.num_splits), torch.float32, q.device)
        else:
            part_out = part_lse = out  # not touched without SPLIT
        grid = (batch * m_blocks, plan.num_splits)
    split = bool(chunks) or plan.split
    mla_decode_split_kernel[grid](
        q, cache, block_table, cache_seqlens, out, lse, part_out, part_lse,
        q.stride(0), q.stride(1), q.stride(2), stride_cp, stride_ct, block_table.stride(0),
        h_q, s_q, max_pages, plan.num_splits, plan.split_size, scale * LOG2E,
        scales, rope, stride_sp, stride_st, stride_rp, stride_rt, schedule, batch,
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, D_V=head_dim_v, D_ROPE=head_dim - head_dim_v,
        PAGE_SIZE=page_size, CAUSAL=bool(causal), SPLIT=split,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", FP8_CACHE=fp8_args is not None,
        SCHEDULED=bool(chunks), BLOCK_B=block_b, num_warps=plan.num_warps, num_stages=plan.num_stages)
    if split:
        mla_decode_combine_kernel[(batch * rows,)](
            part_out, part_lse, cache_seqlens, out, lse, h_q, s_q, max_tokens, plan.num_splits,
            plan.split_size, schedule, D_V=head_dim_v,
            BLOCK_S=min(MAX_COMBINE_BLOCK, triton.next_power_of_2(num_splits)), SCHEDULED=bool(chunks), num_warps=4)
    return out, lse


def mla_decode_reference(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                         cache_seqlens: torch.Tensor, head_dim_v: int = 512, *, softmax_scale: float | None = None,
                         causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition, request by request in float64: gather the request's cache rows in token
    order, plain attention of every (query token, head) over the tokens it sees. Returns (out in
    q's dtype, lse fp32), shaped as `mla_decode`'s; rows that see nothing get 0 and -inf."""
    batch, s_q, h_q, head_dim = q.shape
    page_size = kv_cache.shape[1]
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
    out = torch.zeros(batch, s_q, h_q, head_dim_v, dtype=torch.float64, device=q.device)
    lse = torch.full((batch, h_q, s_q), float("-inf"), dtype=torch.float64, device=q.device)
    for b in range(batch):
        n = int(cache_seqlens[b])
        if n == 0:
            continue
        pages = block_table[b, :math.ceil(n / page_size)].long()
        rows = kv_cache[pages, :, 0].reshape(-1, head_dim)[:n].double()  # (n, head_dim)
        scores = torch.einsum("shd,td->sht", q[b].double(), rows) * scale  # (s_q, h_q, n)
        limit = torch.arange(s_q, device=q.device) + (n - s_q + 1) if causal else torch.full((s_q,), n, device=q.device)
        visible = torch.arange(n, device=q.device)[None, :] < limit[:, None]  # (s_q, n)
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        row_lse = torch.logsumexp(scores, -1)  # (s_q, h_q); -inf where nothing is visible
        probs = torch.where(torch.isfinite(row_lse)[..., None], torch.exp(scores - row_lse[..., None]), 0.0)
        out[b] = probs @ rows[:, :head_dim_v]
        lse[b] = row_lse.transpose(0, 1)
    return out.to(q.dtype), lse.float()


def mla_decode_flops(cache_seqlens, s_q: int, h_q: int, head_dim: int = 576, head_dim_v: int = 512,
                     causal: bool = False) -> int:
    """2 (head_dim + head_dim_v) FLOPs per visible (query row, token) pair: Q K^T and P V."""
    total = 0
    for n in cache_seqlens:
        seen = sum(max(0, min(n, n - s_q + i + 1)) for i in range(s_q)) if causal else s_q * n
        total += h_q * seen
    return 2 * (head_dim + head_dim_v) * total


def mla_decode_min_bytes(cache_seqlens, s_q: int, h_q: int, dtype: torch.dtype, head_dim: int = 576,
                         head_dim_v: int = 512, page_size: int = 64) -> int:
    """HBM bytes a decode must move: every cached token's row once, q read and out written once,
    the fp32 lse, the lengths and the block-table entries of the pages in use (int32)."""
    element = torch.empty((), dtype=dtype).element_size()
    lengths = list(cache_seqlens)
    rows = len(lengths) * s_q * h_q
    return (sum(lengths) * head_dim * element + rows * (head_dim + head_dim_v) * element + 4 * rows
            + 4 * len(lengths) + 4 * sum(math.ceil(n / page_size) for n in lengths))

"""Decode attention over a paged KV cache (flash-decoding): one new query token per request
attends to all of that request's cached keys, however long, in two Triton kernels (or one:
"One launch" below).

For request b with n = context_lens[b] cached tokens and query head h on kv head
h // group (grouped-query attention, group = q_heads / kv_heads):

    out[b, h] = sum_t softmax_t(scale * q[b, h] . K[t]) V[t],   t < n.

Work: 4 n d FLOPs per query head, on 4 n d bytes of K and V per kv head (bf16): with a
group of 4, 4 FLOPs a byte, where the H100 balances at ~300 (~1000 TFLOP/s over ~3 TB/s).
So this is a stream of K and V and nothing else matters: the goal is that every byte of
every page in use is read exactly once, as fast as HBM gives it.

Kernel 1, one program per (request, kv head, partition of the context):
- All `group` query heads of a kv head are one program's rows, so each page is read once
  per group, not once per query head. They are the M side of tl.dot, padded to 16 (the
  mma tile; rows past the group load zeros and are never stored): S = Q K^T and
  acc += P V run on tensor cores, which are nearly idle anyway.
- It walks its partition BLOCK_N tokens at a time. A tile spans BLOCK_N / page_size
  pages (4 at BLOCK_N = 64, page 16): each token's page comes from the block table, and
  the tile is gathered as BLOCK_N rows of head_dim, contiguous within a page, at
  16-byte vectors. The running max, denominator and unnormalised output are the online
  softmax in log2 units (exp2, log2(e) folded into the scale). Tokens past the length
  are masked: scores to -inf and V rows loaded as 0, so a NaN in an unused slot cannot
  reach the sum (0 * NaN would).
- With one partition it divides and writes the output; with several it writes its row
  max, sum and unnormalised output (fp32) to a workspace.
Kernel 2 (several partitions only), one program per (request, query head): rescales
the partials by 2^(m_p - max m) and sums, O = sum_p w_p acc_p / sum_p w_p l_p, reading
only the partitions the request has (a short request in a long batch has fewer). The
maxima come first (up to 32 partitions' a step); then both sums run partition after
partition, an fma each, every element in the thread that holds it, with the loads of up
to 32 partitions unrolled and in flight at once. That order is fixed by the code alone,
not by the layout Triton picks for a tile (a tl.sum's order is), so the fused reduce
below, which takes a group's query heads at once, gets the same bits.

One launch (`fused_reduce`). At small batch the reduce is almost all launch and latency:
in a CUDA-graphed llama3-8b decode step on the H200 at batch 1, context 512 (4 partitions),
kernel 1 takes 6.1 us and the reduce 2.1 us a layer. Measured (H200, 32 calls in a graph,
scripts/paged_decode_sweep.py, a 4,096-token table): one launch 8.97 us a call against 9.31
at context 512, but 12.43 against 10.83 at 2,048, where the last program's reduce runs
serially behind the partitions; in the step (a 576-token table) 8.52 against 8.22. So it
stays off by default and the Llama engine does not use it. Fused, kernel 1 reduces itself: each
program, its partials stored, takes a ticket from its (request, kv head)'s int32 counter
with an atomic add, and the one that draws the last ticket combines the group's partials,
writes the group's output rows and sets the counter back to 0.
- The count: the partitions the request has, ceil(max(n, 1) / partition size). Programs
  past a shorter request's length exit before counting, as unfused; partition 0 always
  runs, so an empty request (validate=False) still reduces, to 0 / 0 as unsplit. Every
  program reads the same clamped n, so all of a group agree on the count.
- Visibility: a barrier after the stores (every thread's partials before the release),
  then one thread's atomic add, acq_rel at gpu scope. The adds to one counter are totally
  ordered, each reading what the one before wrote, so the add that draws the last ticket
  acquires what every earlier add released: the group's partials, whichever program
  finished last (the tail reads partials by partition index, never by arrival). Triton
  hands the ticket to the program's threads through shared memory and a barrier, which
  orders all their loads after the acquire (sm_90 SASS: MEMBAR.ALL.GPU, ATOMG.E.ADD.STRONG.GPU,
  CCTL.IVALL). The reset needs no ordering: every other program of the group has counted,
  and the next launch on the stream starts after this one ends.
- Same bits: the tail is kernel 2's function (`_combine_partials`) over the group's query
  heads at once (a head at a time, its dependent reads would be as slow as the launch
  saved), in steps of TAIL_PARTIALS (head, partition) pairs: 4 partitions at a group of
  4. Its per-row values are scalars, so no step moves data between warps (no barrier in
  the tail's SASS). Kernel 1 stays at 128 registers or fewer, no spills and 39 KB of
  shared memory for groups 1-16 at head dim 128 (sm_90, the test's build).
- The counters: per device, zeroed once when allocated (MIN_COUNTERS, or more for a
  larger call), reset by each launch's last arrivers, so a call allocates and zeroes
  nothing and a CUDA graph replays one launch that finds them zero. They are allocated
  outside a capture: the decode graphs (models/llama/graphs.py) and GraphedCall run each
  shape eagerly before capturing it. A capture that needs more than exist reduces with the
  second kernel (with a warning); `reduce_counters` reserves ahead. An outgrown buffer is
  kept, since a captured graph holds its address.
- The contract: the counters are shared by every call on a device, so two fused calls
  that can run at once (two streams, nothing ordering them) would mix their tickets.
  One stream, as the decode step runs, or calls ordered by events.
- Cost, expected: the atomic's round trip before each program exits, and in the last
  program of a group two dependent reads of the partials (the maxima, then the rest),
  which kernel 2 pays too; what goes is the second launch and its gap. At context 512
  (4 partitions) the tail is one step. At batch 1, context 4096 (32 partitions) it reads
  a group's 64 KB of partials in 8 dependent steps where kernel 2 spreads them over 32
  programs: the gain shrinks, and turns, as contexts grow (TAIL_PARTIALS is the knob):
  the figures at the top of this section. Its GPU tests pass (the same bits as two
  kernels, on the H200).

Choices, each for the H100 (132 SMs, 64K registers and 228 KB shared memory an SM, ~3 TB/s):
- Tile: BLOCK_N tokens x head_dim of K and of V, 16 KB each (BLOCK_N = 16384 bytes /
  (head_dim x element size), within 16..128: 64 tokens at head dim 128 in bf16), copied
  to shared memory with 16-byte cp.async. What Triton 3.6 makes of it for sm_90
  (compiled offline through ptxas, 4 warps, num_stages = 3): the page-id load takes one
  stage of the software pipeline, so page ids come a tile ahead, but K and V have one
  buffer each, issued after a tile's math and waited for at the top of the next
  iteration: a program does not load while it computes. 39 KB of shared memory, 114
  registers a thread, no spills (the unsplit build, one partition dividing in place, holds
  128 and spills 8 bytes: the sm_90 compile test leaves it out and says so). Registers
  admit 4 programs an SM, each with up to 32 KB
  of K and V in flight: up to 128 KB an SM, where Little's law asks ~23 KB (3 TB/s x
  ~1 us / 132 SMs). The memory parallelism comes from resident programs, not stages
  (num_stages = 5 double-buffers: 72 KB, 139 registers, 3 programs an SM; one for the
  sweep).
- Partitions: enough programs for two an SM. With G = batch x kv_heads programs per
  partition, P = ceil(264 / G) partitions, at most one per 128 tokens, sized from the
  block table's width (known on the host: no device read, so a batch of short requests
  in a wide table splits as if they were long; the programs past a request's length exit
  at once). Batch 64 x 8 kv heads is 512 programs already: one partition, no workspace,
  no second kernel. Batch 1 x 8 kv heads at 4096 tokens: 32 partitions of 128 tokens,
  256 programs, each one 128-token tile (two 64-token tiles walked in turn cost a second
  round of latency; `plan_decode`). With P > 1 the partials are written and read once, 2 x batch x q_heads x
  P x (head_dim + 2) x 4 bytes, ~2 group x P / context of the K and V bytes (1% at batch
  8, context 4096), and the reduce is one more launch of a few microseconds (or none, fused).
- Page ids are read per token (repeats hit L1) and widened to int64 before they scale
  the page stride: a 40 GB pool has more than 2^31 elements.
Expected at the issue's target (batch 64, context 4096, 32/8 heads, head dim 128, page
16, bf16): 1.07 GB of K and V read once plus 1 MB of q and out, by 512 programs of 2 MB
that are all resident at once (528 slots), so there is no tail wave. If the memory
system stays saturated, 85-95% of the 3 TB/s copy rate (0.38-0.42 ms). The risks are
the per-token address arithmetic (a gather of page ids, int64 offsets) and the gaps
while a program computes on its tile, which the other three programs on its SM must
cover; `kforge bench` on the H100 will tell, and `config` sweeps BLOCK_N, num_warps and
num_stages.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kforge.device import sm_count
from kforge.kernels.serving.paged_kv import check_caches, check_table_values, check_tables

LOG2E = 1.4426950408889634
H100_SMS = 132
PROGRAMS_PER_SM = 2  # 64 KB of K and V in flight an SM, ~3x what HBM needs (four fit)
TILE_BYTES = 16384  # one K (and one V) tile of BLOCK_N tokens
MIN_PARTITION_TOKENS = 128
MAX_REDUCE_BLOCK = 32  # partitions a reduce step takes (unrolled)
REDUCE_ELEMENTS = 4096  # partial outputs a reduce step loads: 16 KB, 32 registers a thread at 4 warps
TAIL_PARTIALS = 16  # (query head, partition) pairs a fused tail's step takes (module docstring: "One launch")
FUSED_REDUCE = False  # paged_decode's default for fused_reduce (module docstring: "One launch")
MIN_COUNTERS = 1024  # the counters' first size; a default plan splits only below 2 x SMs (request, kv head) pairs

_counters: dict[torch.device, torch.Tensor] = {}  # per device: one int32 a (request, kv head), zero at rest
_outgrown: list[torch.Tensor] = []  # replaced by larger ones, kept: a captured graph may hold their address


@triton.jit
def paged_decode_partition_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
        out_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr, counters_ptr,
        stride_qb, stride_qh, stride_kp, stride_kh, stride_kt, stride_vp, stride_vh, stride_vt, stride_table,
        kv_heads, max_pages, num_partitions, partition_size, qk_scale,
        GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, FUSED: tl.constexpr, BLOCK_H: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, DOT_PRECISION: tl.constexpr):
    request = tl.program_id(0) // kv_heads
    kv_head = tl.program_id(0) % kv_heads
    partition = tl.program_id(1)
    # Clamped to the block-table row, so an unchecked length never reads past it.
    length = tl.minimum(tl.load(context_lens_ptr + request), max_pages * PAGE_SIZE)
    start = partition * partition_size
    if SPLIT:
        # A shorter request than the longest has fewer partitions; partition 0 always runs (an empty
        # request's row is then 0 / 0, as unsplit, and the fused count below is never 0).
        if start >= tl.maximum(length, 1):
            return
    end = tl.minimum(start + partition_size, length)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + offs_g
    real_rows = offs_g < GROUP
    q = tl.load(q_ptr + request * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=real_rows[:, None], other=0.0)
    k_head = k_cache_ptr + kv_head * stride_kh
    v_head = v_cache_ptr + kv_head * stride_vh
    table = block_tables_ptr + request * stride_table

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    for tile in range(start, end, BLOCK_N):
        offs_n = tile + tl.arange(0, BLOCK_N)
        live = offs_n < end
        page = tl.load(table + offs_n // PAGE_SIZE, mask=live, other=0).to(tl.int64)
        slot = offs_n % PAGE_SIZE
        k = tl.load(k_head + (page * stride_kp + slot * stride_kt)[:, None] + offs_d[None, :],
                    mask=live[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(live[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)  # 0 on the first tile (m_i = -inf)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_head + (page * stride_vp + slot * stride_vt)[:, None] + offs_d[None, :],
                    mask=live[:, None], other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    rows = request * (kv_heads * GROUP) + heads  # (request, query head), flattened
    if SPLIT:
        partial = rows * num_partitions + partition
        tl.store(part_max_ptr + partial, m_i, mask=real_rows)
        tl.store(part_sum_ptr + partial, l_i, mask=real_rows)
        tl.store(part_acc_ptr + partial[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=real_rows[:, None])
        if FUSED:  # the last of the group's programs to finish reduces (module docstring: "One launch")
            tl.debug_barrier()  # every thread's partials are stored before the release below
            counter = counters_ptr + tl.program_id(0)
            ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if ticket == tl.cdiv(tl.maximum(length, 1), partition_size) - 1:
                first_row = tl.program_id(0) * GROUP  # request * q_heads + kv_head * GROUP
                _combine_partials(part_max_ptr, part_sum_ptr, part_acc_ptr, out_ptr, first_row,
                                  tl.cdiv(length, partition_size), num_partitions, GROUP, BLOCK_H, HEAD_DIM, BLOCK_M,
                                  BLOCK_P)
                tl.store(counter, 0)  # the group's other programs have counted: zero for the next launch
    else:
        out = acc / l_i[:, None]
        tl.store(out_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=real_rows[:, None])


@triton.jit
def _combine_partials(part_max_ptr, part_sum_ptr, part_acc_ptr, out_ptr, first_row, written, num_partitions,
                      ROWS: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_P: tl.constexpr):
    """out[r] = sum_p w_p acc_p / sum_p w_p l_p, w_p = 2^(m_p - max m), over the first `written`
    partitions of the ROWS rows (request * q_heads + query head) from first_row on, BLOCK_H >= ROWS.

    The order of the sums is the code's, not a layout's: the maxima first (a max is exact in
    any order, and no weight overflows), then partition after partition one fma each, in the
    thread that holds the element. So one row a program (kernel 2) and a group's rows at once
    (the fused tail) give the same bits. A row's max, weight and running sum are scalars, one
    per row (unrolled over ROWS): as a [BLOCK_H] vector they would take Triton's layout for
    small vectors and cross warps through shared memory to meet acc's rows, a barrier pair
    every partition (seen in the sm_90 SASS); scalars have no layout."""
    rows = first_row + tl.arange(0, BLOCK_H)[:, None]
    offs_m = tl.arange(0, BLOCK_M)[None, :]
    offs_d = tl.arange(0, HEAD_DIM)[None, :]
    real = rows < first_row + ROWS
    top = tl.full([BLOCK_H, 1], float("-inf"), tl.float32)
    for p0 in range(0, written, BLOCK_M):  # BLOCK_M partitions' maxima a step, BLOCK_P partitions' partials below
        top = tl.maximum(top, tl.max(tl.load(part_max_ptr + rows * num_partitions + p0 + offs_m,
                                             mask=real & (p0 + offs_m < written), other=float("-inf")), 1,
                                     keep_dims=True))
    tops = ()
    denominators = ()
    for h in tl.static_range(ROWS):
        tops = tops + (tl.max(tl.where(rows == first_row + h, top, float("-inf"))),)
        denominators = denominators + (tl.zeros([], tl.float32),)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    for p0 in range(0, written, BLOCK_P):
        for i in tl.static_range(BLOCK_P):  # unrolled: a step's loads are in flight together
            live = p0 + i < written
            weight = tl.zeros([BLOCK_H, 1], tl.float32)
            summed = ()
            for h in tl.static_range(ROWS):
                part = (first_row + h) * num_partitions + p0 + i
                w = tl.where(live, tl.math.exp2(tl.load(part_max_ptr + part, mask=live, other=0.0) - tops[h]), 0.0)
                summed = summed + (tl.fma(w, tl.load(part_sum_ptr + part, mask=live, other=0.0), denominators[h]),)
                weight = tl.where(rows == first_row + h, w, weight)
            denominators = summed
            acc = tl.fma(weight, tl.load(part_acc_ptr + (rows * num_partitions + p0 + i) * HEAD_DIM + offs_d,
                                         mask=real & live, other=0.0), acc)
    denominator = tl.zeros([BLOCK_H, 1], tl.float32)
    for h in tl.static_range(ROWS):
        denominator = tl.where(rows == first_row + h, denominators[h], denominator)
    out = acc / denominator  # written = 0 (an empty request): 0 / 0, NaN, as unsplit
    tl.store(out_ptr + rows * HEAD_DIM + offs_d, out.to(out_ptr.dtype.element_ty), mask=real)


@triton.jit
def paged_decode_reduce_kernel(part_max_ptr, part_sum_ptr, part_acc_ptr, context_lens_ptr, out_ptr,
                               q_heads, max_tokens, num_partitions, partition_size,
                               HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr):
    row = tl.program_id(0)  # request * q_heads + query head
    length = tl.minimum(tl.load(context_lens_ptr + row // q_heads), max_tokens)
    written = tl.cdiv(length, partition_size)  # kernel 1 skipped the partitions past the length
    _combine_partials(part_max_ptr, part_sum_ptr, part_acc_ptr, out_ptr, row, written, num_partitions, 1, 1,
                      HEAD_DIM, BLOCK_M, BLOCK_P)


@dataclass(frozen=True)
class DecodePlan:
    """How a decode call splits: tiles of `block_n` tokens, partitions of `partition_size`
    tokens (a multiple of block_n), `num_partitions` of them for the longest request."""

    block_n: int
    partition_size: int
    num_partitions: int
    num_warps: int = 4
    num_stages: int = 3

    @property
    def split(self) -> bool:
        return self.num_partitions > 1


def plan_decode(batch: int, kv_heads: int, max_context: int, head_dim: int, element_size: int,
                num_sms: int = H100_SMS, config: dict | None = None) -> DecodePlan:
    """The tile and the partitions for a batch whose longest context is at most `max_context`
    tokens (module docstring: "Partitions"). `config` (BLOCK_N, partition_size, num_warps,
    num_stages, each optional) overrides the choice, for sweeps and the interpreter tests."""
    config = dict(config or {})
    chosen_tile = "BLOCK_N" not in config
    block_n = config.pop("BLOCK_N", min(128, max(16, TILE_BYTES // (head_dim * element_size))))
    if "partition_size" in config:
        partition_size = config.pop("partition_size")
    else:
        wanted = math.ceil(PROGRAMS_PER_SM * num_sms / max(1, batch * kv_heads))
        most = math.ceil(max_context / max(MIN_PARTITION_TOKENS, block_n))
        partition_size = math.ceil(max_context / max(1, min(wanted, most)))
        partition_size = math.ceil(partition_size / block_n) * block_n
        # A program walks its tiles one after another, each a round trip of latency, where the
        # grid wants more partitions than the context has 128-token ones (small batches): one
        # tile the partition's size where that is at most two tiles' bytes. H200, batch 1,
        # llama3-8b's 32 calls a step: 9.23 -> 8.40 us a call at 512 tokens, 10.79 -> 10.19 at
        # 2048 (paged-decode-sweep.txt); larger batches, whose programs fill the GPU, keep theirs.
        if chosen_tile and wanted > most and partition_size <= MIN_PARTITION_TOKENS \
                and partition_size * head_dim * element_size <= 2 * TILE_BYTES:
            block_n = partition_size
    num_warps, num_stages = config.pop("num_warps", 4), config.pop("num_stages", 3)
    if config:
        raise ValueError(f"unknown config keys {sorted(config)}: use BLOCK_N, partition_size, num_warps, num_stages")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"BLOCK_N must be a power of two >= 16 (tl.dot), got {block_n}")
    if partition_size < block_n or partition_size % block_n:
        raise ValueError(f"partition_size must be a positive multiple of BLOCK_N ({block_n}), got {partition_size}")
    num_partitions = math.ceil(max_context / partition_size)
    if num_partitions > 65535:
        raise ValueError(f"{num_partitions} partitions exceed the grid's 65535: use larger partitions")
    return DecodePlan(block_n, partition_size, num_partitions, num_warps, num_stages)


def check_paged_decode_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float | None) -> float:
    """Raise ValueError on anything the kernels cannot take (shapes, dtypes, devices, strides;
    no device read); return the softmax scale."""
    _, kv_heads, _, head_dim = check_caches(k_cache, v_cache)
    if q.dim() != 3:
        raise ValueError(f"q must be 3-D (batch, q_heads, head_dim), got {tuple(q.shape)}")
    if q.dtype != k_cache.dtype:
        raise ValueError(f"q ({q.dtype}) and the cache ({k_cache.dtype}) must share one dtype")
    if q.device != k_cache.device:
        raise ValueError(f"q ({q.device}) and the cache ({k_cache.device}) are on different devices")
    batch, q_heads, q_dim = q.shape
    if q_dim != head_dim:
        raise ValueError(f"q's head_dim {q_dim} differs from the cache's {head_dim}")
    if q_heads == 0 or q_heads % kv_heads:
        raise ValueError(f"query heads ({q_heads}) must be a positive multiple of kv heads ({kv_heads})")
    if q.stride(2) != 1:
        raise ValueError(f"q needs a contiguous head_dim, got strides {q.stride()}")
    check_tables(block_tables, context_lens, batch, q.device)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return scale


def _empty(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer the kernels write (the output, the partials), uninitialised: each element
    is written before it is read. (The tests fill these with NaN to prove it.)"""
    return torch.empty(shape, dtype=dtype, device=device)


def _capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on the stream the kernels would launch on."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def reduce_counters(device: torch.device | str, count: int) -> torch.Tensor | None:
    """At least `count` int32 counters on `device` for the fused reduce, all zero (each launch
    leaves them so), shared by every call on the device; None while a CUDA graph is being
    captured and there are fewer (allocating would be captured: the caller reduces with the
    second kernel instead). Call it before a capture that has no eager call ahead of it."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())  # as a tensor's device reads
    counters = _counters.get(device)
    if counters is not None and counters.numel() >= count:
        return counters
    if _capturing(device):
        return None
    if counters is not None:
        _outgrown.append(counters)
    _counters[device] = counters = torch.zeros(max(count, MIN_COUNTERS), dtype=torch.int32, device=device)
    return counters


def _reduce_block(num_partitions: int, rows: int, head_dim: int) -> int:
    """Partitions a reduce step takes for `rows` query heads at once: REDUCE_ELEMENTS partial outputs,
    and for a group (the fused tail) at most TAIL_PARTIALS (row, partition) pairs, each two scalars
    a thread: what keeps kernel 1 at its registers."""
    fits = REDUCE_ELEMENTS // (rows * head_dim)
    if rows > 1:
        fits = min(fits, TAIL_PARTIALS // rows)
    return min(MAX_REDUCE_BLOCK, triton.next_power_of_2(num_partitions), 1 << (max(1, fits).bit_length() - 1))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, *, scale: float | None = None, validate: bool = True,
                 config: dict | None = None, fused_reduce: bool | None = None) -> torch.Tensor:
    """Attention of q (batch, q_heads, head_dim), one token per request, over each request's
    context_lens[b] cached tokens in k_cache/v_cache (num_pages, kv_heads, page_size,
    head_dim) through block_tables (batch, max_pages) int32. Returns (batch, q_heads,
    head_dim) in q's dtype.

    `validate` reads the lengths and page ids back once to refuse bad ones (see
    `check_table_values`); pass False where the tables are trusted and no device read may
    happen (a serving loop, a CUDA graph, a benchmark): lengths are then clamped to the
    block-table row, and a length of 0 gives a NaN row. `config` fixes the tiling (see
    `plan_decode`); the CPU tests run small configs under the Triton interpreter.
    `fused_reduce` (default: the module's FUSED_REDUCE) reduces split partitions inside
    kernel 1, one launch instead of two, to the same bits; calls on one device must then be
    ordered, one stream (module docstring: "One launch").
    """
    scale = check_paged_decode_inputs(q, k_cache, v_cache, block_tables, context_lens, scale)
    num_pages, kv_heads, page_size, head_dim = k_cache.shape
    batch, q_heads, _ = q.shape
    if validate:
        check_table_values(block_tables, context_lens, num_pages, page_size)
    out = _empty((batch, q_heads, head_dim), q.dtype, q.device)
    if batch == 0:
        return out
    max_pages = block_tables.shape[1]
    num_sms = sm_count(q.device) if q.is_cuda else H100_SMS
    plan = plan_decode(batch, kv_heads, max_pages * page_size, head_dim, q.element_size(), num_sms, config)
    group = q_heads // kv_heads
    counters = None
    if plan.split:
        part_max = _empty((batch, q_heads, plan.num_partitions), torch.float32, q.device)
        part_sum = _empty((batch, q_heads, plan.num_partitions), torch.float32, q.device)
        part_acc = _empty((batch, q_heads, plan.num_partitions, head_dim), torch.float32, q.device)
        if FUSED_REDUCE if fused_reduce is None else fused_reduce:  # then kernel 1 reduces, given counters
            counters = reduce_counters(q.device, batch * kv_heads)
            if counters is None:
                warnings.warn(f"paged_decode: no reduce counters for {batch * kv_heads} (request, kv head) pairs "
                              "while a CUDA graph is captured: the graph reduces with a second kernel (run the "
                              "call once before capturing, or call reduce_counters)", RuntimeWarning, stacklevel=2)
    else:
        part_max = part_sum = part_acc = out  # not touched without SPLIT
    fused = counters is not None
    block_h = triton.next_power_of_2(group)
    block_m = min(MAX_REDUCE_BLOCK, triton.next_power_of_2(plan.num_partitions))  # a step of maxima: scalars
    paged_decode_partition_kernel[(batch * kv_heads, plan.num_partitions)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_max, part_sum, part_acc,
        counters if fused else context_lens,  # not touched unless FUSED
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0),
        kv_heads, max_pages, plan.num_partitions, plan.partition_size, scale * LOG2E,
        GROUP=group, BLOCK_G=max(16, block_h), HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        BLOCK_N=plan.block_n, SPLIT=plan.split, FUSED=fused, BLOCK_H=block_h if fused else 1,
        BLOCK_M=block_m if fused else 1, BLOCK_P=_reduce_block(plan.num_partitions, block_h, head_dim) if fused else 1,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=plan.num_warps, num_stages=plan.num_stages)
    if plan.split and not fused:
        paged_decode_reduce_kernel[(batch * q_heads,)](
            part_max, part_sum, part_acc, context_lens, out, q_heads, max_pages * page_size, plan.num_partitions,
            plan.partition_size, HEAD_DIM=head_dim, BLOCK_M=block_m,
            BLOCK_P=_reduce_block(plan.num_partitions, 1, head_dim), num_warps=4)
    return out


def paged_decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float | None = None) -> torch.Tensor:
    """Paged decode attention as eager PyTorch writes it (the benchmark's eager baseline, and
    in float64 a reference): gather every request's pages over the block table's whole
    width into a dense (batch, kv_heads, tokens, head_dim), mask past each length, softmax.

    Runs in the inputs' dtype with the softmax in fp32 (float64 for float64 inputs). No
    checks and no device read: compilable by torch.compile as it stands."""
    batch, q_heads, head_dim = q.shape
    _, kv_heads, page_size, _ = k_cache.shape
    max_pages = block_tables.shape[1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    lengths = context_lens.long()[:, None]
    live = torch.arange(max_pages * page_size, device=q.device) < lengths  # (batch, tokens)
    pages_in_use = torch.arange(max_pages, device=q.device) * page_size < lengths
    pages = torch.where(pages_in_use, block_tables, 0).long()  # entries past the length may be anything

    def dense(cache):  # (batch, kv_heads, tokens, head_dim)
        gathered = cache[pages].transpose(1, 2)
        return gathered.reshape(batch, kv_heads, max_pages * page_size, head_dim)

    k = dense(k_cache)
    v = dense(v_cache).masked_fill(~live[:, None, :, None], 0)  # garbage past a length: 0 * NaN is NaN
    q = q.reshape(batch, kv_heads, q_heads // kv_heads, head_dim)
    scores = (q @ k.transpose(-2, -1)) * scale  # (batch, kv_heads, group, tokens)
    scores = scores.masked_fill(~live[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)
    return (probs @ v).reshape(batch, q_heads, head_dim)


def paged_decode_min_bytes(batch: int, context_lens: int | Sequence[int], q_heads: int, kv_heads: int,
                           head_dim: int, dtype: torch.dtype, page_size: int = 16) -> int:
    """HBM bytes a paged decode must move: K and V of every token in context once, q read and
    out written once, and the lengths and block-table entries of the pages in use (int32).
    `context_lens`: one length for every request, or one per request."""
    lengths = [context_lens] * batch if isinstance(context_lens, int) else list(context_lens)
    if len(lengths) != batch:
        raise ValueError(f"{len(lengths)} context lengths for a batch of {batch}")
    element = torch.empty((), dtype=dtype).element_size()
    kv = 2 * sum(lengths) * kv_heads * head_dim * element
    q_and_out = 2 * batch * q_heads * head_dim * element
    tables = 4 * batch + 4 * sum(math.ceil(n / page_size) for n in lengths)
    return kv + q_and_out + tables

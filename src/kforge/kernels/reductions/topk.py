"""Top-k along the last dimension in Triton: the k largest values of each row, largest first,
with their column indices (`torch.topk(x, k)`, sorted) for k up to 1024: a sampler's top-k
over a vocabulary.

Keys. A float's bits, read as a signed integer, order like the float for positives and
backwards for negatives; flipping the 31 value bits of negatives gives a signed int32 key
in the float's order (-0.0 just below +0.0; NaN above +inf, as torch.topk ranks it). A
value and its column pack into one int64, key << 32 | (2^32 - 1 - column): distinct for
every element, ordered by value, and among equal values the smaller column first.

Stage 1, one program per (row, chunk of CHUNK = 2048 columns): the chunk's top k by radix
select in registers. Its k-th largest key is found a byte at a time, high byte first: a
256-bin histogram (`tl.histogram`) of the next byte over the elements that match the
bytes found so far; counting from the top bin down, the bin where the count reaches the
number still needed holds the k-th key, its byte is fixed and the need shrinks by what
lies above it. It stops as soon as the chosen bin holds exactly what is needed (all of
it goes in): for random logits usually after the second byte, as the sign, exponent and
top mantissa bits already isolate a handful of values. Then every element above the
threshold, and the first `need` equal to it, is compacted (prefix sum of the selection)
into k slots of a workspace (rows, chunks, K_PAD), K_PAD = k rounded up to a power of
two, padded with the lowest int64. Any of a row's top k is in its chunk's top k, so the
row's answer is among these.
Stage 2, one program a row: the chunks x K_PAD packed keys (63 x 64 at a 128k vocabulary
with k = 50); k times, the largest is taken out (a max over the candidates, then that one
key, unique, replaced by the filler) and unpacked into a value and an int64 index: the
output comes out largest first. k block-wide maxima of ~4000 keys take a few
microseconds a row, and the rows run in parallel.

Choices, for the H100: 2048 columns a program over 4 warps, 16 keys a thread. Compiled
for sm_90 it takes 153 registers a thread without spills, so three programs share an SM
and some programs' loads are in flight while others histogram. Wider programs, compiled
the same way while choosing (4096 columns over 8 or 16 warps, 8192 over 16 or 32), fit
one program an SM, which then loads and computes by turns. This is chosen from occupancy
on paper, not measured: `chunk` is there to sweep it on the GPU.

Cost: stage 1 reads the row once (4 bytes an element in fp32) and does some 20-40 integer
instructions an element (the key, two histogram passes for random data, the prefix
sums); stage 2 moves rows x chunks x K_PAD x 8 bytes (a tenth of the logits' bytes at
k = 50). At 512 rows of 128256 fp32 logits: 263 MB read, 88 us at ~3 TB/s, and ~2 G
instructions, about what the H100's ~30 T/s issue rate does in the same time. Expected
(not measured here): between the bandwidth floor and 2-3x it, depending on how well
the histogram passes overlap the loads. torch.topk also radix-selects 8-bit digits, but
reads the whole row again for each digit, then sorts the k it found.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 2048
MAX_K = 1024
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def float_keys(x):
    """Signed int32 keys in x's order (module docstring)."""
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def topk_chunks_kernel(x_ptr, work_ptr, n_cols, x_stride, k, CHUNK: tl.constexpr, K_PAD: tl.constexpr):
    row, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    n_chunks = tl.num_programs(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = cols < n_cols
    key = float_keys(tl.load(x_ptr + row * x_stride + cols, mask=valid, other=0.0).to(tl.float32))
    unsigned = key ^ -2147483648  # the same order, as unsigned bits: its bytes are the radix digits
    bins = tl.arange(0, 256)

    need = tl.minimum(k, tl.sum(valid.to(tl.int32), 0))  # a tail chunk shorter than k gives all it has
    prefix = tl.zeros([], dtype=tl.int32)  # the bytes found so far, in unsigned bits
    resolved_shift = tl.full([], 32, dtype=tl.int32)  # the lowest byte found so far
    unresolved = need > 0
    for byte in tl.static_range(4):
        shift = 24 - 8 * byte
        if unresolved:
            if shift == 24:
                match = valid
            else:
                match = valid & ((unsigned >> (shift + 8)) == (prefix >> (shift + 8)))
            hist = tl.histogram((unsigned >> shift) & 0xFF, 256, mask=match)
            above = tl.sum(hist, 0) - tl.cumsum(hist, 0)  # matching elements in higher bins
            chosen = (above < need) & (above + hist >= need)
            need -= tl.sum(tl.where(chosen, above, 0), 0)
            prefix |= tl.sum(tl.where(chosen, bins, 0), 0) << shift
            resolved_shift = shift
            unresolved = tl.sum(tl.where(chosen, hist, 0), 0) != need

    # everything above the threshold's resolved bytes, and the first `need` level with them
    threshold = (prefix ^ -2147483648) >> resolved_shift
    top = key >> resolved_shift
    level = valid & (top == threshold)
    selected = valid & ((top > threshold) | (level & (tl.cumsum(level.to(tl.int32), 0) <= need)))
    slot = tl.cumsum(selected.to(tl.int32), 0) - 1
    packed = (key.to(tl.int64) << 32) | (4294967295 - cols.to(tl.int64))
    chunk_work = work_ptr + (row * n_chunks + chunk) * K_PAD
    tl.store(chunk_work + slot, packed, mask=selected & (slot < K_PAD))  # at most k are selected: a guard
    taken = tl.sum(selected.to(tl.int32), 0)
    pad = tl.arange(0, K_PAD)
    tl.store(chunk_work + pad, tl.full([K_PAD], -9223372036854775808, tl.int64), mask=pad >= taken)


@triton.jit
def topk_merge_kernel(work_ptr, values_ptr, indices_ptr, n_candidates, k, CANDIDATES: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, CANDIDATES)
    packed = tl.load(work_ptr + row * n_candidates + offs, mask=offs < n_candidates,
                     other=-9223372036854775808)
    for rank in range(0, k):  # the largest left, k times: packed keys are distinct, so one goes each time
        best = tl.max(packed, 0)
        packed = tl.where(packed == best, -9223372036854775808, packed)
        key = (best >> 32).to(tl.int32)
        value = (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
        tl.store(values_ptr + row * k + rank, value.to(values_ptr.dtype.element_ty))
        tl.store(indices_ptr + row * k + rank, 4294967295 - (best & 4294967295))


def check_topk_inputs(x: torch.Tensor, k: int) -> None:
    """ValueError on anything the kernels cannot take."""
    if not isinstance(x, torch.Tensor) or x.dtype not in DTYPES:
        raise ValueError(f"topk takes a float16, bfloat16 or float32 tensor, got "
                         f"{getattr(x, 'dtype', type(x).__name__)}")
    if x.dim() == 0:
        raise ValueError("topk needs at least one dimension")
    if not isinstance(k, int) or not 1 <= k <= min(MAX_K, x.shape[-1]):
        raise ValueError(f"k must be an int in 1..min({MAX_K}, {x.shape[-1]}) (the last dimension), got {k!r}")
    if x.shape[-1] >= 2**31:
        raise ValueError(f"rows of {x.shape[-1]} columns exceed the kernel's 32-bit column indices")


def topk_forward(x: torch.Tensor, k: int, *, chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest entries along x's last dimension, largest first:
    values in x's dtype, indices int64, both (..., k). `chunk` (a power of two >= the padded
    k) sets stage 1's chunk, to run several chunks a row in tests."""
    check_topk_inputs(x, k)
    k_pad = max(16, triton.next_power_of_2(k))
    n_cols = x.shape[-1]
    block = min(CHUNK if chunk is None else chunk, max(k_pad, triton.next_power_of_2(n_cols)))
    if block < k_pad or block & (block - 1):
        raise ValueError(f"chunk must be a power of two >= {k_pad} (k rounded up), got {chunk}")
    rows = x.reshape(-1, n_cols)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    n_rows = rows.shape[0]
    values = torch.empty((n_rows, k), dtype=x.dtype, device=x.device)
    indices = torch.empty((n_rows, k), dtype=torch.int64, device=x.device)
    if n_rows:
        n_chunks = triton.cdiv(n_cols, block)
        if n_chunks > 65535:
            raise ValueError(f"rows of {n_cols} columns make {n_chunks} chunks of {block}: at most 65535 (the grid's "
                             f"second axis); pass a larger chunk")
        work = torch.empty((n_rows, n_chunks, k_pad), dtype=torch.int64, device=x.device)
        topk_chunks_kernel[(n_rows, n_chunks)](rows, work, n_cols, rows.stride(0), k, CHUNK=block, K_PAD=k_pad,
                                               num_warps=min(16, max(4, block // 512)))
        candidates = n_chunks * k_pad
        padded = triton.next_power_of_2(candidates)
        topk_merge_kernel[(n_rows,)](work, values, indices, candidates, k, CANDIDATES=padded,
                                     num_warps=min(16, max(4, padded // 512)))
    shape = (*x.shape[:-1], k)
    return values.view(shape), indices.view(shape)


def topk_min_bytes(rows: int, cols: int, k: int, dtype: torch.dtype) -> int:
    """HBM bytes top-k must move: the input once, k values and int64 indices a row out."""
    size = torch.empty((), dtype=dtype).element_size()
    return rows * cols * size + rows * k * (size + 8)

"""RoPE and the paged KV-cache append in one Triton launch: q rotated in place, k rotated in
place and into its cache slot, v copied into its slot.

At a decode step each layer's QKV projection is followed by two small kernels:
`apply_rope_(q, k, positions, cos_sin)` (`rope.py`) rotates q and k in place, then
`paged_kv_append(k, v, k_cache, v_cache, block_tables, context_lens)` (`paged_kv.py`) copies
the rotated k and v of each new token into its page slot. Each moves under 30 KB a token
at Llama-3-8B's sizes and is bound by launch and memory latency, and the second cannot
start before the first has finished. This kernel does both: token t of request b, at RoPE position positions[b, t],
goes to cache position context_lens[b] + t, page `block_tables[b, (context_lens[b] + t) //
page_size]`, slot `(context_lens[b] + t) % page_size`, with

    q[..., :rotary_dim] <- rotate(q)             (in place, as apply_rope_)
    k[..., :rotary_dim] <- rotate(k)             (in place, as apply_rope_)
    k_cache[page, :, slot] <- k                  (the rotated dims and the rest of head_dim)
    v_cache[page, :, slot] <- v

where rotate is `rope.py`'s: x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin in fp32 from the
same [cos | sin] table row, half-split or interleaved pairs, rounded once to the tensors'
dtype. So every output is bit for bit what the two kernels write (q through `rope.py`'s
own `_rotate_heads`, k through the same expression). k is rotated in place as well as
stored, so the call leaves q, k and the caches as the pair would. positions (RoPE's) and
context_lens (the cache's lengths before the append) are separate arguments, as they are
to the two kernels; at a plain decode step they hold the same numbers.

Shapes: q (batch, q_heads, head_dim), k and v (batch, kv_heads, head_dim) with positions
(batch,): one decode token per request; or (batch, new_tokens, heads, head_dim) with
positions (batch, new_tokens), new_tokens tokens per request (a prefill chunk or a
speculative step). q, k and v may be strided views (of one fused QKV output, as the
Llama decode step makes them) with a contiguous head_dim. Caches: `paged_kv.py`'s layout,
(num_pages, kv_heads, page_size, head_dim), any strides with a contiguous head_dim. The
checks are those of both kernels (`_check_table`, `check_rope_inputs`,
`check_append_inputs`, and with validate `check_table_values`): one dtype of fp16, bf16,
fp32 for q, k, v and the caches, int32 block tables and lengths, rotary_dim (the table's
width) even and <= head_dim.

Out of range, each kernel's behaviour is kept: a position outside [0, max_position) reads
NaN for cos and sin (never memory outside the table), so its token's rotated dims are NaN
in q, in k and in the cache; a cache position past the block-table row (or negative) is
not written, while q and k are still rotated. Page ids are trusted, unless validate.

Cost per token, E bytes an element, Hq and Hkv heads of D dims, R rotated: q's rotated
dims read and written (2 Hq R E), k read (Hkv D E) and written twice (Hkv R E in place,
Hkv D E to the cache), v read and written (2 Hkv D E), plus the position, the length, one
block-table entry and the table row (4 R bytes, an L2 hit at decode). Llama-3-8B in bf16
(32 + 8 heads, D = R = 128): 26 KB a token, against 28 KB for the pair (the append reads
k again). 3 FLOPs per rotated element: nothing. What fusing saves is one launch and the
append's wait for RoPE's stores, not bytes.

Choices, each for the H100/H200 (132 SMs, ~3.4/4.8 TB/s):
- Grid (tokens, q head blocks + kv head blocks) with `rope.py`'s tiles (`rope_tile`:
  HEADS_BLOCK heads x the rotary row, ~2048 elements over 4 warps). A q program is
  exactly a `rope_kernel` program; a kv program rotates HEADS_BLOCK heads of k, stores
  them in place and into the slot, and copies the same heads of v. At Llama-3-8B decode
  that is 3 programs a token (two blocks of 16 q heads, one of 8 kv heads), 3 to 24 at
  batch 1 to 8: each SM has one small program, whose loads all issue at once, and only
  the kv programs wait on the length -> block table -> page chain (their k and v loads do
  not depend on it). One program per token would put a whole token's 12 KB of loads, and
  that chain, behind one SM's issue slots: no fewer launches, more latency per program.
- The rotation happens in registers and its result goes to both k and the cache: no
  re-read of what the program just stored (that would need a barrier between the threads
  that store and those that load).
- Page offsets in int64 (a pool may exceed 2^31 elements), like the append's.
- The sm_90 build at Llama-3-8B's tiles (compiled offline by the tests): 42-48 registers a
  thread (rope_kernel's: 32-40), no spills, 16-byte loads and stores.

Expected on the H100/H200 (not measured on a GPU yet): one launch of about apply_rope_'s
latency in place of the pair's (1.74 + 1.47 us a layer on an H200), 32 launches fewer a
Llama-3-8B decode step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kforge.kernels.serving.paged_kv import check_append_inputs, check_table_values
from kforge.kernels.serving.rope import (NUM_WARPS, _check_table, _rotate_heads, check_rope_inputs, cos_sin_row,
                                        rope_tile)


@triton.jit
def _rotate_heads_into_cache(k_rows, cache_rows, heads_ok, inside, cos, sin, half,
                             HEADS_BLOCK: tl.constexpr, HALF_BLOCK: tl.constexpr, INTERLEAVED: tl.constexpr):
    """`_rotate_heads` on rows of k (heads_ok of them), storing the result in place and, where
    inside, at the matching rows of the cache: same loads, same arithmetic, same rounding."""
    if INTERLEAVED:
        cols = tl.arange(0, 2 * HALF_BLOCK)
        mask = heads_ok[:, None] & (cols < 2 * half)[None, :]
        x = tl.load(k_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x1, x2 = tl.split(x.reshape(HEADS_BLOCK, HALF_BLOCK, 2))
        y = tl.join(x1 * cos - x2 * sin, x2 * cos + x1 * sin).reshape(HEADS_BLOCK, 2 * HALF_BLOCK)
        y = y.to(k_rows.dtype.element_ty)
        tl.store(k_rows + cols[None, :], y, mask=mask)
        tl.store(cache_rows + cols[None, :], y, mask=mask & inside)
    else:
        cols = tl.arange(0, HALF_BLOCK)
        mask = heads_ok[:, None] & (cols < half)[None, :]
        x1 = tl.load(k_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(k_rows + half + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        y1 = (x1 * cos - x2 * sin).to(k_rows.dtype.element_ty)
        y2 = (x2 * cos + x1 * sin).to(k_rows.dtype.element_ty)
        tl.store(k_rows + cols[None, :], y1, mask=mask)
        tl.store(k_rows + half + cols[None, :], y2, mask=mask)
        tl.store(cache_rows + cols[None, :], y1, mask=mask & inside)
        tl.store(cache_rows + half + cols[None, :], y2, mask=mask & inside)


@triton.jit
def rope_append_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, table_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr,
                       context_lens_ptr, n_q_heads, n_kv_heads, new_tokens, max_position, half, max_pages,
                       q_batch_stride, q_seq_stride, q_head_stride, k_batch_stride, k_seq_stride, k_head_stride,
                       v_batch_stride, v_seq_stride, v_head_stride,
                       stride_kp, stride_kh, stride_kt, stride_vp, stride_vh, stride_vt, stride_table,
                       HEADS_BLOCK: tl.constexpr, HALF_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
                       PAGE_SIZE: tl.constexpr, PARTIAL: tl.constexpr, INTERLEAVED: tl.constexpr):
    token = tl.program_id(0)
    head_block = tl.program_id(1)
    request = (token // new_tokens).to(tl.int64)
    seq = (token % new_tokens).to(tl.int64)
    # cos and sin exactly as rope_kernel reads them: NaN for a position outside the table
    cos, sin = cos_sin_row(table_ptr, tl.load(pos_ptr + token).to(tl.int64), max_position, half, HALF_BLOCK)
    q_blocks = tl.cdiv(n_q_heads, HEADS_BLOCK)
    if head_block < q_blocks:
        _rotate_heads(q_ptr + request * q_batch_stride + seq * q_seq_stride, q_head_stride, n_q_heads,
                      head_block * HEADS_BLOCK, cos, sin, half, HEADS_BLOCK, HALF_BLOCK, INTERLEAVED)
    else:
        # the cache slot as paged_kv_append_kernel finds it: a position past the row drops the writes
        cache_position = tl.load(context_lens_ptr + request) + seq
        inside = (cache_position >= 0) & (cache_position < max_pages * PAGE_SIZE)
        page = tl.load(block_tables_ptr + request * stride_table + cache_position // PAGE_SIZE, mask=inside, other=0)
        page = page.to(tl.int64)
        slot = cache_position % PAGE_SIZE
        heads = (head_block - q_blocks) * HEADS_BLOCK + tl.arange(0, HEADS_BLOCK)
        heads_ok = heads < n_kv_heads
        k_rows = k_ptr + request * k_batch_stride + seq * k_seq_stride + heads[:, None] * k_head_stride
        v_rows = v_ptr + request * v_batch_stride + seq * v_seq_stride + heads[:, None] * v_head_stride
        k_slots = k_cache_ptr + page * stride_kp + slot * stride_kt + heads[:, None] * stride_kh
        v_slots = v_cache_ptr + page * stride_vp + slot * stride_vt + heads[:, None] * stride_vh
        _rotate_heads_into_cache(k_rows, k_slots, heads_ok, inside, cos, sin, half, HEADS_BLOCK, HALF_BLOCK,
                                 INTERLEAVED)
        dims = tl.arange(0, HEAD_DIM)[None, :]
        keep = heads_ok[:, None] & inside
        if PARTIAL:  # k's dims past rotary_dim go to the cache as they are
            tail = keep & (dims >= 2 * half)
            tl.store(k_slots + dims, tl.load(k_rows + dims, mask=tail), mask=tail)
        tl.store(v_slots + dims, tl.load(v_rows + dims, mask=keep), mask=keep)


def check_rope_append_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                             cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             block_tables: torch.Tensor, context_lens: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Raise ValueError on anything apply_rope_ or paged_kv_append would refuse; return k, v as
    (batch, new_tokens, kv_heads, head_dim)."""
    _check_table(cos_sin, q.device)
    check_rope_inputs(q, k, positions, cos_sin.shape[1])
    return check_append_inputs(k, v, k_cache, v_cache, block_tables, context_lens)


def rope_append_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, *, interleaved: bool = False, validate: bool = True) -> None:
    """`apply_rope_(q, k, positions, cos_sin)` then `paged_kv_append(k, v, k_cache, v_cache,
    block_tables, context_lens)` in one launch, with the same effect bit for bit: q and k
    rotated in place, request b's token j written at position context_lens[b] + j.

    q (batch, [new_tokens,] q_heads, head_dim), k and v (batch, [new_tokens,] kv_heads,
    head_dim), positions (batch, [new_tokens]). With `validate`, one device-to-host read
    first refuses lengths that would run past a block-table row or into a page id outside
    the pool; without it, writes past a row are dropped and page ids are trusted."""
    k4, v4 = check_rope_append_inputs(q, k, v, positions, cos_sin, k_cache, v_cache, block_tables, context_lens)
    batch, new_tokens, kv_heads, head_dim = k4.shape
    num_pages, _, page_size, _ = k_cache.shape
    if validate:
        check_table_values(block_tables, context_lens, num_pages, page_size, new_tokens=new_tokens)
    if batch * new_tokens == 0:
        return
    q4 = q.unsqueeze(1) if q.dim() == 3 else q
    q_heads, rotary_dim = q4.shape[2], cos_sin.shape[1]
    heads_block, half_block = rope_tile(q_heads, kv_heads, rotary_dim)
    grid = (batch * new_tokens, triton.cdiv(q_heads, heads_block) + triton.cdiv(kv_heads, heads_block))
    rope_append_kernel[grid](
        q4, k4, v4, positions.reshape(-1), cos_sin.contiguous(), k_cache, v_cache, block_tables, context_lens,
        q_heads, kv_heads, new_tokens, cos_sin.shape[0], rotary_dim // 2, block_tables.shape[1],
        *q4.stride()[:3], *k4.stride()[:3], *v4.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_tables.stride(0), HEADS_BLOCK=heads_block, HALF_BLOCK=half_block, HEAD_DIM=head_dim,
        PAGE_SIZE=page_size, PARTIAL=rotary_dim < head_dim, INTERLEAVED=bool(interleaved), num_warps=NUM_WARPS)


"""A paged KV cache: keys and values in fixed-size pages from one shared pool, a block table
per request naming its pages, and a Triton kernel that appends new tokens to it.

A request's tokens do not sit in one contiguous buffer sized for the longest possible
sequence; they sit in pages of `page_size` tokens taken from a pool as the request grows
(vLLM's PagedAttention). Request b's token t lives in page `block_tables[b, t // page_size]`
at slot `t % page_size`. Only entries `[0, ceil(context_lens[b] / page_size))` of a row
are read; the rest may hold anything (-1 is a good "no page" marker), and slots past a
request's length in its last page are never read either.

Layout: k_cache and v_cache are each (num_pages, kv_heads, page_size, head_dim), head
before token. The decode kernel (`paged_decode.py`) has one program per (request, kv
head), so what it reads from one page is that head's page_size x head_dim block: with
the head outside the token, that block is one contiguous run (16 x 128 bf16 = 4 KB) at
one base address per page. The token-major layout (num_pages, page_size, kv_heads,
head_dim) splits it into 16 runs of 256 bytes, 2 KB apart: whole 128-byte lines still,
so both coalesce, but one run per page keeps DRAM row-buffer locality and is a single
2-D box should a TMA version want one. The price is paid by the append, which writes
kv_heads runs of head_dim per token instead of one run of kv_heads * head_dim: kilobytes
per decode step, against the gigabytes attention reads. Any strides with a contiguous
head_dim are taken (k and v may be two halves of one (num_pages, 2, kv_heads, page_size,
head_dim) buffer); page offsets are computed in int64: a pool may exceed 2^31 elements.

The append: new keys and values (batch, new_tokens, kv_heads, head_dim), or (batch,
kv_heads, head_dim) for one decode step, go to positions context_lens[b] + j (the
lengths BEFORE the append; the caller adds new_tokens afterwards). One program per
(request, new token) moves its kv_heads x head_dim rows of K and V: it is a copy, so its
cost is bytes (4 * batch * new_tokens * kv_heads * head_dim * element size, read and
written) plus a launch; at a decode step of batch 64, 8 kv heads, head dim 128 in bf16
that is 512 KB, a few microseconds dominated by the launch.

Checks. Shapes, dtypes and devices are checked on the host for free. Whether every
length fits its block-table row and every page in use is a page of the pool can only be
read from the device tensors: `check_table_values` does it with one device-to-host read,
by default. A serving loop (or a CUDA graph, or a benchmark) that trusts its tables passes
validate=False; the kernels still never read past a block-table row (lengths are clamped
to it, appends past it are dropped), but they trust the page ids.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

PAGE_SIZES = (8, 16, 32, 64, 128, 256)
HEAD_DIMS = (16, 32, 64, 128, 256)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Raise ValueError unless k_cache and v_cache are one pool's pages; return (num_pages,
    kv_heads, page_size, head_dim)."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must be 4-D (num_pages, kv_heads, page_size, head_dim) of one "
                         f"shape, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in DTYPES:
        raise ValueError(f"k_cache and v_cache must share one dtype of float16, bfloat16, float32; got "
                         f"{k_cache.dtype} and {v_cache.dtype}")
    if k_cache.device != v_cache.device:
        raise ValueError(f"k_cache and v_cache are on different devices: {k_cache.device}, {v_cache.device}")
    num_pages, kv_heads, page_size, head_dim = k_cache.shape
    if page_size not in PAGE_SIZES:
        raise ValueError(f"page_size {page_size} is not supported (supported: {', '.join(map(str, PAGE_SIZES))})")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim} is not supported (supported: {', '.join(map(str, HEAD_DIMS))})")
    if num_pages == 0 or kv_heads == 0:
        raise ValueError(f"the cache has no pages or no kv heads: shape {tuple(k_cache.shape)}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.stride(3) != 1:
            raise ValueError(f"{name} needs a contiguous head_dim (stride 1), got strides {cache.stride()}")
    return num_pages, kv_heads, page_size, head_dim


def check_tables(block_tables: torch.Tensor, context_lens: torch.Tensor, batch: int, device: torch.device) -> None:
    """Raise ValueError unless block_tables is int32 (batch, max_pages) and context_lens int32 (batch,)."""
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or block_tables.shape[1] == 0:
        raise ValueError(f"block_tables must be (batch={batch}, max_pages_per_request >= 1), got "
                         f"{tuple(block_tables.shape)}")
    if context_lens.shape != (batch,):
        raise ValueError(f"context_lens must be (batch={batch},), got {tuple(context_lens.shape)}")
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32:
        raise ValueError(f"block_tables and context_lens must be int32, got {block_tables.dtype} and "
                         f"{context_lens.dtype}")
    if block_tables.device != device or context_lens.device != device:
        raise ValueError(f"block_tables ({block_tables.device}) and context_lens ({context_lens.device}) must be "
                         f"on the cache's device ({device})")
    if block_tables.stride(1) != 1 or context_lens.stride(0) != 1:
        raise ValueError(f"block_tables rows and context_lens must be contiguous, got strides "
                         f"{block_tables.stride()} and {context_lens.stride()}")


def check_table_values(block_tables: torch.Tensor, context_lens: torch.Tensor, num_pages: int, page_size: int, *,
                       new_tokens: int = 0) -> None:
    """Raise ValueError unless every request's tokens, after `new_tokens` more, fit its block-table
    row and every page they occupy is a page of the pool. One device-to-host read.

    new_tokens = 0 checks a decode (each request needs a token: a softmax over no keys is
    undefined); new_tokens > 0 checks an append to lengths that may be 0."""
    lengths = context_lens.long()
    ends = lengths + new_tokens
    max_pages = block_tables.shape[1]
    covered = max_pages * page_size
    occupied = torch.arange(max_pages, device=ends.device) * page_size < ends[:, None]
    bad_page = occupied & ((block_tables < 0) | (block_tables >= num_pages))
    too_short = lengths < (1 if new_tokens == 0 else 0)
    too_long = ends > covered
    if not any(torch.stack([too_short.any(), too_long.any(), bad_page.any()]).tolist()):
        return
    after = f" + {new_tokens} new tokens" if new_tokens else ""
    if too_short.any():
        b = int(too_short.nonzero()[0])
        need = "at least 1 (a softmax over no keys is undefined)" if new_tokens == 0 else "non-negative"
        raise ValueError(f"context_lens[{b}] = {int(lengths[b])}: every length must be {need}")
    if too_long.any():
        b = int(too_long.nonzero()[0])
        raise ValueError(f"context_lens[{b}]{after} = {int(ends[b])} is longer than block_tables covers: "
                         f"{max_pages} pages x {page_size} = {covered} tokens")
    b, j = (int(i) for i in bad_page.nonzero()[0])
    raise ValueError(f"block_tables[{b}, {j}] = {int(block_tables[b, j])} is not a page of the pool "
                     f"(0..{num_pages - 1}) but request {b} keeps tokens there")


def gather_pages(cache: torch.Tensor, block_table_row: torch.Tensor, length: int) -> torch.Tensor:
    """One request's first `length` tokens from its pages, dense: (length, kv_heads, head_dim)."""
    _, kv_heads, page_size, head_dim = cache.shape
    pages = block_table_row[:math.ceil(length / page_size)].long()
    return cache[pages].transpose(1, 2).reshape(-1, kv_heads, head_dim)[:length]


@triton.jit
def paged_kv_append_kernel(new_k_ptr, new_v_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
                           new_tokens, kv_heads, max_pages,
                           stride_nkb, stride_nkt, stride_nkh, stride_nvb, stride_nvt, stride_nvh,
                           stride_kp, stride_kh, stride_kt, stride_vp, stride_vh, stride_vt, stride_table,
                           BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr):
    request = tl.program_id(0) // new_tokens
    token = tl.program_id(0) % new_tokens
    position = tl.load(context_lens_ptr + request) + token
    # An unchecked position outside the block-table row drops the write instead of reading past the row.
    inside = (position >= 0) & (position < max_pages * PAGE_SIZE)
    page = tl.load(block_tables_ptr + request * stride_table + position // PAGE_SIZE, mask=inside, other=0)
    page = page.to(tl.int64)
    slot = position % PAGE_SIZE

    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_d = tl.arange(0, HEAD_DIM)[None, :]
    keep = inside & (offs_h < kv_heads)
    request, token = request.to(tl.int64), token.to(tl.int64)  # a long prefill is > 2^31 elements
    new_k = tl.load(new_k_ptr + request * stride_nkb + token * stride_nkt + offs_h * stride_nkh + offs_d, mask=keep)
    new_v = tl.load(new_v_ptr + request * stride_nvb + token * stride_nvt + offs_h * stride_nvh + offs_d, mask=keep)
    tl.store(k_cache_ptr + page * stride_kp + offs_h * stride_kh + slot * stride_kt + offs_d, new_k, mask=keep)
    tl.store(v_cache_ptr + page * stride_vp + offs_h * stride_vh + slot * stride_vt + offs_d, new_v, mask=keep)


def _token_rows(new_kv: torch.Tensor) -> torch.Tensor:
    """(batch, kv_heads, head_dim), one decode step, as (batch, 1, kv_heads, head_dim)."""
    return new_kv.unsqueeze(1) if new_kv.dim() == 3 else new_kv


def check_append_inputs(new_k: torch.Tensor, new_v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, context_lens: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Raise ValueError on anything the append cannot take; return new_k, new_v as
    (batch, new_tokens, kv_heads, head_dim)."""
    _, kv_heads, _, head_dim = check_caches(k_cache, v_cache)
    if new_k.dim() not in (3, 4) or new_k.shape != new_v.shape:
        raise ValueError(f"new_k and new_v must be (batch, [new_tokens,] kv_heads, head_dim) of one shape, got "
                         f"{tuple(new_k.shape)} and {tuple(new_v.shape)}")
    new_k, new_v = _token_rows(new_k), _token_rows(new_v)
    if new_k.shape[2:] != (kv_heads, head_dim):
        raise ValueError(f"new_k has {tuple(new_k.shape[2:])} (kv_heads, head_dim), the cache "
                         f"{(kv_heads, head_dim)}")
    if new_k.dtype != k_cache.dtype or new_v.dtype != k_cache.dtype:
        raise ValueError(f"new_k and new_v must have the cache's dtype {k_cache.dtype}, got {new_k.dtype} and "
                         f"{new_v.dtype}")
    if new_k.device != k_cache.device or new_v.device != k_cache.device:
        raise ValueError(f"new_k and new_v must be on the cache's device {k_cache.device}")
    if new_k.stride(3) != 1 or new_v.stride(3) != 1:
        raise ValueError(f"new_k and new_v need a contiguous head_dim, got strides {new_k.stride()} and "
                         f"{new_v.stride()}")
    check_tables(block_tables, context_lens, new_k.shape[0], k_cache.device)
    return new_k, new_v


def paged_kv_append(new_k: torch.Tensor, new_v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor, *, validate: bool = True) -> None:
    """Write new_k and new_v (batch, [new_tokens,] kv_heads, head_dim) into the caches, in place,
    request b's token j at position context_lens[b] + j (context_lens: the lengths before).

    The caller then adds new_tokens to its lengths. With `validate`, one device-to-host read
    first refuses lengths that would run past a block-table row or into a page id outside
    the pool; without it, writes past a row are dropped and page ids are trusted."""
    new_k, new_v = check_append_inputs(new_k, new_v, k_cache, v_cache, block_tables, context_lens)
    batch, new_tokens, kv_heads, head_dim = new_k.shape
    num_pages, _, page_size, _ = k_cache.shape
    if validate:
        check_table_values(block_tables, context_lens, num_pages, page_size, new_tokens=new_tokens)
    if batch * new_tokens == 0:
        return
    paged_kv_append_kernel[(batch * new_tokens,)](
        new_k, new_v, k_cache, v_cache, block_tables, context_lens, new_tokens, kv_heads, block_tables.shape[1],
        *new_k.stride()[:3], *new_v.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_tables.stride(0), BLOCK_H=triton.next_power_of_2(kv_heads), HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        num_warps=4)


def paged_kv_append_reference(new_k: torch.Tensor, new_v: torch.Tensor, k_cache: torch.Tensor,
                              v_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor) -> None:
    """The append in eager PyTorch (one scatter per cache): same arguments and effect as
    `paged_kv_append`, without its checks."""
    new_k, new_v = _token_rows(new_k), _token_rows(new_v)
    page_size = k_cache.shape[2]
    positions = context_lens.long()[:, None] + torch.arange(new_k.shape[1], device=new_k.device)
    pages = block_tables.long().gather(1, positions // page_size)
    slots = positions % page_size
    k_cache[pages, :, slots] = new_k  # the two index tensors (batch, new_tokens) come first: new_k's layout
    v_cache[pages, :, slots] = new_v


def paged_kv_append_min_bytes(batch: int, new_tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                              page_size: int = 16) -> int:
    """HBM bytes an append must move: new K and V read and written once, each request's length
    and the block-table entries of the pages its new tokens land in (at least ceil(new_tokens / page_size))."""
    element = torch.empty((), dtype=dtype).element_size()
    kv = 2 * 2 * batch * new_tokens * kv_heads * head_dim * element
    return kv + 4 * batch + 4 * batch * math.ceil(new_tokens / page_size)

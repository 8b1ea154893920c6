"""`kforge.ops.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale=None)`
and `kforge.ops.paged_kv_append(new_k, new_v, k_cache, v_cache, block_tables, context_lens)`:
decode attention over a paged KV cache and the append that fills it, as PyTorch operators;
and `PagedKVCache`, which hands out the pages.

The cache is two tensors (num_pages, kv_heads, page_size, head_dim), a block table per
request (int32 (batch, max_pages), page ids into the pool) and the requests' lengths
(int32 (batch,)); `kforge.kernels.serving.paged_kv` explains the layout. q is one token per
request, (batch, q_heads, head_dim), q_heads a multiple of kv_heads; the output has q's
shape and dtype. FLOPs: 4 * q_heads * head_dim per cached token; minimum HBM bytes:
`paged_decode_min_bytes` (K and V of every token in context once).

Both are `torch.library` custom ops: torch.compile sees one opaque node each (the append
declares that it mutates the caches). The Triton kernels run for fp16/bf16/fp32 CUDA
tensors on sm_80 or newer; elsewhere (a CPU) the ops run the eager PyTorch versions.
Either way, malformed inputs raise ValueError first, and with validate=True (the default)
one device-to-host read refuses lengths past the block table and page ids outside the
pool; pass validate=False inside a serving loop or a CUDA graph, where no read may happen.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kforge.kernels.serving.paged_decode import check_paged_decode_inputs, paged_decode_reference
from kforge.kernels.serving.paged_kv import (check_append_inputs, check_caches, check_table_values,
                                             paged_kv_append_reference)


def kernels_can_run(t: torch.Tensor) -> bool:
    """Whether our Triton kernels take tensors on t's device (else the ops run eager PyTorch)."""
    return t.is_cuda and torch.cuda.get_device_capability(t.device) >= (8, 0)


@torch.library.custom_op("kforge::paged_decode_attention", mutates_args=())
def _paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float | None,
                            validate: bool, fused_reduce: bool | None = None) -> torch.Tensor:
    scale = check_paged_decode_inputs(q, k_cache, v_cache, block_tables, context_lens, scale)
    if validate:
        check_table_values(block_tables, context_lens, k_cache.shape[0], k_cache.shape[2])
    if kernels_can_run(q):
        from kforge.kernels.serving.paged_decode import paged_decode

        return paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale=scale, validate=False,
                            fused_reduce=fused_reduce)
    return paged_decode_reference(q, k_cache, v_cache, block_tables, context_lens, scale)


@_paged_decode_attention.register_fake
def _(q, k_cache, v_cache, block_tables, context_lens, scale, validate, fused_reduce=None):
    torch._check(q.dim() == 3 and k_cache.dim() == 4 and k_cache.shape == v_cache.shape,
                 lambda: "kforge::paged_decode_attention takes q (batch, q_heads, head_dim) and caches "
                         "(num_pages, kv_heads, page_size, head_dim)")
    torch._check(q.shape[2] == k_cache.shape[3], lambda: f"q {tuple(q.shape)} and the cache differ in head_dim")
    torch._check(q.shape[1] % k_cache.shape[1] == 0,
                 lambda: f"query heads ({q.shape[1]}) must be a multiple of kv heads ({k_cache.shape[1]})")
    torch._check(block_tables.dim() == 2 and block_tables.shape[0] == q.shape[0]
                 and context_lens.shape == (q.shape[0],),
                 lambda: "block_tables must be (batch, max_pages) and context_lens (batch,)")
    return q.new_empty(q.shape)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float | None = None, *,
                           validate: bool = True, fused_reduce: bool | None = None) -> torch.Tensor:
    """softmax(scale * q K^T) V for each request's one query token over its context_lens[b]
    cached tokens (scale defaults to 1/sqrt(head_dim)); (batch, q_heads, head_dim) in q's dtype.
    `fused_reduce` picks the Triton path's reduce (`paged_decode`; None: the kernel module's
    FUSED_REDUCE), the same bits either way; the eager version ignores it."""
    return _paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens,
                                   None if scale is None else float(scale), bool(validate),
                                   None if fused_reduce is None else bool(fused_reduce))


@torch.library.custom_op("kforge::paged_kv_append", mutates_args=("k_cache", "v_cache"))
def _paged_kv_append(new_k: torch.Tensor, new_v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, validate: bool) -> None:
    new_k, new_v = check_append_inputs(new_k, new_v, k_cache, v_cache, block_tables, context_lens)
    if validate:
        check_table_values(block_tables, context_lens, k_cache.shape[0], k_cache.shape[2],
                           new_tokens=new_k.shape[1])
    if kernels_can_run(k_cache):
        from kforge.kernels.serving.paged_kv import paged_kv_append as append

        append(new_k, new_v, k_cache, v_cache, block_tables, context_lens, validate=False)
    else:
        paged_kv_append_reference(new_k, new_v, k_cache, v_cache, block_tables, context_lens)


@_paged_kv_append.register_fake
def _(new_k, new_v, k_cache, v_cache, block_tables, context_lens, validate):
    return None


def paged_kv_append(new_k: torch.Tensor, new_v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor, *, validate: bool = True) -> None:
    """Write new_k and new_v (batch, [new_tokens,] kv_heads, head_dim) into the caches in place,
    request b's token j at position context_lens[b] + j (the lengths before the append)."""
    _paged_kv_append(new_k, new_v, k_cache, v_cache, block_tables, context_lens, bool(validate))


class PagedKVCache:
    """One pool of K and V pages shared by up to `max_requests` requests (the rows of the block
    table), handed out from a free list as requests grow and taken back when one is freed.

    Lengths and page lists live on the host, so allocating never waits on the device; the
    block table the kernels read lives on the cache's device, updated row by row as pages
    are handed out (one small host-to-device copy per request that needs a new page).

        cache = PagedKVCache(1024, 16, kv_heads=8, head_dim=128, max_requests=64, max_pages_per_request=256,
                             dtype=torch.bfloat16, device="cuda")
        cache.append([0, 1], k, v)            # k, v: (2, [new_tokens,] 8, 128)
        out = cache.attend([0, 1], q)         # q: (2, q_heads, 128)
        cache.free(0)
    """

    def __init__(self, num_pages: int, page_size: int, kv_heads: int, head_dim: int, *, max_requests: int,
                 max_pages_per_request: int, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu"):
        shape = (num_pages, kv_heads, page_size, head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        check_caches(self.k_cache, self.v_cache)  # a page size or head dim the kernels cannot take fails here
        self.block_tables = torch.full((max_requests, max_pages_per_request), -1, dtype=torch.int32, device=device)
        self.page_size = page_size
        self.lengths = [0] * max_requests
        self._pages: list[list[int]] = [[] for _ in range(max_requests)]
        self._free = list(range(num_pages - 1, -1, -1))  # pop() takes the end: a fresh pool gives 0, 1, ...

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def pages(self, request: int) -> list[int]:
        """The pages `request` holds, in token order."""
        return list(self._pages[request])

    def reserve(self, request: int, length: int) -> None:
        """Give `request` pages for `length` tokens: it keeps the pages it holds, new ones come off
        the free list. Raises ValueError (and takes nothing) if its row or the pool is too small."""
        held = self._pages[request]
        needed = -(-length // self.page_size) - len(held)
        if needed <= 0:
            return
        if len(held) + needed > self.block_tables.shape[1]:
            raise ValueError(f"request {request} needs {len(held) + needed} pages for {length} tokens; its "
                             f"block-table row holds {self.block_tables.shape[1]}")
        if needed > len(self._free):
            raise ValueError(f"out of pages: request {request} needs {needed} more, {len(self._free)} are free")
        new = [self._free.pop() for _ in range(needed)]
        self.block_tables[request, len(held):len(held) + needed] = torch.tensor(new, dtype=torch.int32)
        held.extend(new)

    def append(self, requests: Sequence[int], new_k: torch.Tensor, new_v: torch.Tensor) -> None:
        """Write new_k, new_v (len(requests), [new_tokens,] kv_heads, head_dim) after each listed
        request's tokens (requests distinct), taking pages as needed."""
        if len(set(requests)) != len(requests):
            raise ValueError(f"requests must be distinct, got {list(requests)}")
        new_tokens = 1 if new_k.dim() == 3 else new_k.shape[1]
        for request in requests:
            self.reserve(request, self.lengths[request] + new_tokens)
        paged_kv_append(new_k, new_v, self.k_cache, self.v_cache, self.tables(requests),
                        self.context_lens(requests), validate=False)  # the host built these tables
        for request in requests:
            self.lengths[request] += new_tokens

    def attend(self, requests: Sequence[int], q: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """Decode attention of q (len(requests), q_heads, head_dim) over the listed requests."""
        if any(self.lengths[r] == 0 for r in requests):
            raise ValueError(f"a request with no tokens cannot attend: lengths {[self.lengths[r] for r in requests]}")
        return paged_decode_attention(q, self.k_cache, self.v_cache, self.tables(requests),
                                      self.context_lens(requests), scale, validate=False)

    def free(self, request: int) -> None:
        """Return `request`'s pages to the pool; its row is empty again."""
        self._free.extend(reversed(self._pages[request]))
        self._pages[request] = []
        self.lengths[request] = 0
        self.block_tables[request] = -1

    def tables(self, requests: Sequence[int]) -> torch.Tensor:
        """The block-table rows of `requests`, (len(requests), max_pages_per_request) int32."""
        rows = torch.tensor(list(requests), dtype=torch.long, device=self.block_tables.device)
        return self.block_tables.index_select(0, rows)

    def context_lens(self, requests: Sequence[int]) -> torch.Tensor:
        return torch.tensor([self.lengths[r] for r in requests], dtype=torch.int32, device=self.k_cache.device)

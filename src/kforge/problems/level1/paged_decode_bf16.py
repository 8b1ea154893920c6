"""Decode attention over a paged KV cache in bf16: one query token per request, each request
attending to its CONTEXT_LENS[b] cached tokens, which live in pages of PAGE tokens named
by its row of the block table (vLLM's PagedAttention). Grouped-query: Q_HEADS query heads
share each of KV_HEADS key/value heads. RAGGED=1 draws each request's length uniformly in
[1, CONTEXT] instead of all CONTEXT.

Cache layout, as kforge.kernels.serving.paged_kv: k_cache and v_cache are
(num_pages, KV_HEADS, PAGE, HEAD_DIM); block_tables (BATCH, pages per request) int32 holds
page ids in a shuffled order; context_lens (BATCH,) int32.

The reference is how eager PyTorch does it: gather every request's pages into a dense
(BATCH, KV_HEADS, tokens, HEAD_DIM), mask past each length, SDPA with enable_gqa.
Memory-bound: the floor reads each used K and V token once (plus q, the output, the
tables). At BATCH = 64, CONTEXT = 4096, 8 KV heads of 128: 1.07 GB, ~0.36 ms at ~3 TB/s.
"""

import math

import torch
from torch import nn

BATCH, CONTEXT = 64, 4096
Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
PAGE = 16
RAGGED = 0

tags = ["serving", "level1", "bf16", "attention", "decode"]
tiny_sizes = {"BATCH": 3, "CONTEXT": 70, "Q_HEADS": 4, "KV_HEADS": 2, "HEAD_DIM": 32, "PAGE": 16}
tolerance = {"atol": 2e-2, "rtol": 2e-2}  # as attention_bf16.py: softmax-weighted averages of N(0, 1) values


def bytes_moved(inputs):
    q, k_cache, _, block_tables, context_lens = inputs
    kv = 2 * int(context_lens.sum()) * KV_HEADS * HEAD_DIM * k_cache.element_size()
    return kv + 2 * q.numel() * q.element_size() + (block_tables.numel() + context_lens.numel()) * 4


class Model(nn.Module):
    def forward(self, q, k_cache, v_cache, block_tables, context_lens):
        batch, pages = block_tables.shape

        def dense(cache):  # (BATCH, pages, KV_HEADS, PAGE, D) -> (BATCH, KV_HEADS, pages * PAGE, D)
            return cache[block_tables.long()].transpose(1, 2).reshape(batch, KV_HEADS, pages * PAGE, HEAD_DIM)

        visible = torch.arange(pages * PAGE, device=q.device)[None, :] < context_lens[:, None]
        out = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, None, :], dense(k_cache), dense(v_cache), attn_mask=visible[:, None, None, :],
            enable_gqa=Q_HEADS != KV_HEADS)
        return out[:, :, 0, :]


def get_inputs():
    pages_per_request = math.ceil(CONTEXT / PAGE)
    num_pages = BATCH * pages_per_request
    k_cache = torch.randn(num_pages, KV_HEADS, PAGE, HEAD_DIM).to(torch.bfloat16)
    v_cache = torch.randn(num_pages, KV_HEADS, PAGE, HEAD_DIM).to(torch.bfloat16)
    block_tables = torch.randperm(num_pages, dtype=torch.int32).view(BATCH, pages_per_request)
    if RAGGED:
        context_lens = torch.randint(1, CONTEXT + 1, (BATCH,), dtype=torch.int32)
    else:
        context_lens = torch.full((BATCH,), CONTEXT, dtype=torch.int32)
    return [torch.randn(BATCH, Q_HEADS, HEAD_DIM).to(torch.bfloat16), k_cache, v_cache, block_tables, context_lens]


def get_init_inputs():
    return []

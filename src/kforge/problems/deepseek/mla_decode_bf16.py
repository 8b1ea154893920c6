"""MLA decode in bf16 (FlashMLA's contract): every one of H_Q query heads, for each of S_Q new
tokens, attends over its request's latent cache of 576-dim rows (512 latent + 64 RoPE key
dims), shared by all heads, in pages of 64 tokens named by the request's row of the block
table; V is the first 512 dims of the same rows. Causal over S_Q: query i sees the first
n - S_Q + i + 1 tokens (n = the request's length, which counts the S_Q new tokens). The scale
is DeepSeek-V3's, (128 + 64)^-1/2. RAGGED=1 draws each length uniformly in [S_Q, S_K].

The reference is a PyTorch composition: gather every request's pages into a dense (B, T, 576),
then SDPA with the heads and query tokens folded into one query axis of S_Q x H_Q rows over
one shared key/value head (K = the 576-dim rows, V = their first 512 dims) and a boolean
mask for the lengths and the causal rule. (kforge's paged decode takes head dims up to 256,
so it cannot run these shapes.)

FLOPs: 2 x (576 + 512) per visible (query row, token). Minimum bytes: every cached row once
(576 x 2 bytes a token), q and out, the tables. At B = 128, S_K = 8192: 1.2 GB, ~0.4 ms at
3 TB/s; memory-bound while H_Q x S_Q is small (~1.9 FLOP a byte per row), compute-bound from
about 128 rows.
"""

import math

import torch
from torch import nn

B, S_K, H_Q, S_Q = 128, 8192, 16, 1
RAGGED = 0
D, DV, PAGE = 576, 512, 64
SCALE = 1 / math.sqrt(192)

tags = ["deepseek", "attention", "decode", "bf16", "bench"]
tiny_sizes = {"B": 2, "S_K": 70, "H_Q": 4, "S_Q": 2}
tolerance = {"atol": 2e-2, "rtol": 2e-2}  # as attention_bf16.py: softmax-weighted averages of N(0, 1) values


def _seen(inputs):
    lengths = inputs[3].tolist()
    return sum(max(0, n - S_Q + i + 1) for n in lengths for i in range(S_Q))


def flops(inputs):
    return 2 * (D + DV) * H_Q * _seen(inputs)


def bytes_moved(inputs):
    q, kv_cache, _, lengths = inputs
    tokens = int(lengths.sum())
    rows = q.shape[0] * S_Q * H_Q
    pages = sum(math.ceil(n / PAGE) for n in lengths.tolist())
    return tokens * D * kv_cache.element_size() + rows * (D + DV) * q.element_size() + 4 * (rows + len(lengths) + pages)


class Model(nn.Module):
    def forward(self, q, kv_cache, block_table, cache_seqlens):
        batch, pages = block_table.shape
        dense = kv_cache[block_table.long()].reshape(batch, 1, pages * PAGE, D)  # (B, 1, T, 576)
        tokens = torch.arange(pages * PAGE, device=q.device)
        limit = cache_seqlens[:, None] - S_Q + 1 + torch.arange(S_Q, device=q.device)  # (B, S_Q)
        visible = tokens[None, None, :] < limit[:, :, None]  # (B, S_Q, T)
        mask = visible[:, None, :, None, :].expand(batch, 1, S_Q, H_Q, pages * PAGE).reshape(batch, 1, S_Q * H_Q, -1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.reshape(batch, 1, S_Q * H_Q, D), dense, dense[..., :DV], attn_mask=mask, scale=SCALE)
        return out.reshape(batch, S_Q, H_Q, DV)


def get_inputs():
    pages_per_request = math.ceil(S_K / PAGE)
    num_pages = B * pages_per_request
    kv_cache = torch.randn(num_pages, PAGE, 1, D).to(torch.bfloat16)
    block_table = torch.randperm(num_pages, dtype=torch.int32).view(B, pages_per_request)
    if RAGGED:
        cache_seqlens = torch.randint(S_Q, S_K + 1, (B,), dtype=torch.int32)
    else:
        cache_seqlens = torch.full((B,), S_K, dtype=torch.int32)
    return [torch.randn(B, S_Q, H_Q, D).to(torch.bfloat16), kv_cache, block_table, cache_seqlens]


def get_init_inputs():
    return []

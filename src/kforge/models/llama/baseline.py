"""The compiled baseline the engine must beat: the same Llama in plain PyTorch, gpt-fast style.

A static KV cache (batch, kv_heads, max_context, head_dim) per layer, written in place at
the step's positions; attention is SDPA over the whole cache under a mask that hides the
positions not yet written; every op is a plain PyTorch op, so `torch.compile` sees the
whole step and, with mode="max-autotune", captures decode as a CUDA graph. It shares the
Llama's weights (bf16 tensors, no copy). `compiled_decode()` is what benchmarks time.

Batches are rectangular: every sequence of a batch is at the same position (gpt-fast's
contract), which is what a fixed-shape benchmark needs and what continuous batching
removes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kforge.models.llama.model import Llama


class StaticCacheLlama(nn.Module):
    def __init__(self, model: Llama, *, max_batch: int, max_context: int):
        super().__init__()
        c = self.config = model.config
        self.model = model
        shape = (c.n_layers, max_batch, c.n_kv_heads, max_context, c.head_dim)
        dtype, device = model.embed.dtype, model.embed.device
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        table = model.rope(max_context)
        half = c.head_dim // 2
        self.register_buffer("cos", table[:, :half].to(dtype), persistent=False)
        self.register_buffer("sin", table[:, half:].to(dtype), persistent=False)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Half-split rotation of x (batch, seq, heads, head_dim), computed in fp32."""
        cos = self.cos[positions][None, :, None, :].float()
        sin = self.sin[positions][None, :, None, :].float()
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits (batch, seq, vocab) in fp32 for tokens (batch, seq) at `positions` (seq,),
        the same for every sequence of the batch; their K and V go into the cache."""
        c = self.config
        batch, seq = tokens.shape
        context = self.k_cache.shape[3]
        mask = torch.arange(context, device=tokens.device)[None, :] <= positions[:, None]  # (seq, context)
        h = F.embedding(tokens, self.model.embed)
        for layer, block in enumerate(self.model.layers):
            x = F.rms_norm(h, (c.dim,), block.attn_norm, c.norm_eps)
            q, k, v = F.linear(x, block.wqkv).split([c.q_dim, c.kv_dim, c.kv_dim], dim=-1)
            q = self._rope(q.view(batch, seq, c.n_heads, c.head_dim), positions)
            k = self._rope(k.view(batch, seq, c.n_kv_heads, c.head_dim), positions)
            k_cache, v_cache = self.k_cache[layer, :batch], self.v_cache[layer, :batch]
            k_cache.index_copy_(2, positions, k.transpose(1, 2))
            v_cache.index_copy_(2, positions, v.view(batch, seq, c.n_kv_heads, c.head_dim).transpose(1, 2))
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k_cache, v_cache, attn_mask=mask, enable_gqa=True)
            h = h + F.linear(out.transpose(1, 2).reshape(batch, seq, c.q_dim), block.wo)
            gate, up = F.linear(F.rms_norm(h, (c.dim,), block.ffn_norm, c.norm_eps), block.w_gate_up).chunk(2, -1)
            h = h + F.linear(F.silu(gate) * up, block.w_down)
        return F.linear(F.rms_norm(h, (c.dim,), self.model.norm, c.norm_eps), self.model.head_weight()).float()

    def compiled_decode(self):
        """One decode step, (batch, 1) tokens at one position, compiled as gpt-fast compiles it."""
        return torch.compile(self.forward, mode="max-autotune", fullgraph=True)

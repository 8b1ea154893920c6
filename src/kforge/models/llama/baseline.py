"""The compiled baseline the engine must beat: the same Llama in plain PyTorch, gpt-fast style.

A static KV cache (batch, kv_heads, max_context, head_dim) per layer, one buffer each (as
gpt-fast keeps it), written in place at the step's positions: a slice of one buffer for all
layers would be a mutated view, which inductor materialized by copying the whole cache each
step (a 16 GiB copy at batch 64 x 4096 on the 8B, out of memory); attention is SDPA over the whole cache under a mask that hides the
positions not yet written; every op is a plain PyTorch op, so `torch.compile` sees the
whole step and, with mode="max-autotune" or "reduce-overhead", captures decode as a CUDA
graph. It shares the Llama's weights (bf16 tensors, no copy). `compiled_decode()` and
`compiled_prefill()` are what benchmarks time (`kforge bench model`).

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
        shape = (max_batch, c.n_kv_heads, max_context, c.head_dim)
        dtype, device = model.embed.dtype, model.embed.device
        self.max_batch = max_batch
        self.caches = nn.ModuleList(_LayerCache(shape, dtype, device) for _ in range(c.n_layers))
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
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """Logits (batch, seq, vocab) in fp32 for tokens (batch, seq) at `positions` (seq,),
        the same for every sequence of the batch; their K and V go into the cache. With
        `last_only`, the last position's logits alone (batch, 1, vocab): a prefill that only
        samples its next token need not pay for the head at every position."""
        c = self.config
        batch, seq = tokens.shape
        if batch != self.max_batch:
            raise ValueError(f"a batch of {batch} sequences; this cache holds exactly {self.max_batch}")
        context = self.caches[0].k.shape[2]
        mask = torch.arange(context, device=tokens.device)[None, :] <= positions[:, None]  # (seq, context)
        h = F.embedding(tokens, self.model.embed)
        for layer, block in enumerate(self.model.layers):
            x = F.rms_norm(h, (c.dim,), block.attn_norm, c.norm_eps)
            q, k, v = F.linear(x, block.wqkv).split([c.q_dim, c.kv_dim, c.kv_dim], dim=-1)
            q = self._rope(q.view(batch, seq, c.n_heads, c.head_dim), positions)
            k = self._rope(k.view(batch, seq, c.n_kv_heads, c.head_dim), positions)
            k_cache, v_cache = self.caches[layer].k, self.caches[layer].v
            k_cache[:, :, positions] = k.transpose(1, 2)
            v_cache[:, :, positions] = v.view(batch, seq, c.n_kv_heads, c.head_dim).transpose(1, 2)
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k_cache, v_cache, attn_mask=mask, enable_gqa=True)
            h = h + F.linear(out.transpose(1, 2).reshape(batch, seq, c.q_dim), block.wo)
            gate, up = F.linear(F.rms_norm(h, (c.dim,), block.ffn_norm, c.norm_eps), block.w_gate_up).chunk(2, -1)
            h = h + F.linear(F.silu(gate) * up, block.w_down)
        if last_only:
            h = h[:, -1:]
        return F.linear(F.rms_norm(h, (c.dim,), self.model.norm, c.norm_eps), self.model.head_weight()).float()

    def compiled_decode(self, mode: str = "max-autotune"):
        """One decode step, (batch, 1) tokens at one position, compiled as gpt-fast compiles it
        (gpt-fast's own default is mode="reduce-overhead": CUDA graphs without autotuning).
        The caches are marked static, so the CUDA graph writes them in place rather than
        being skipped for mutating its inputs; shapes are static (one compilation per shape)."""
        for layer in self.caches:
            torch._dynamo.mark_static_address(layer.k)
            torch._dynamo.mark_static_address(layer.v)
        return torch.compile(self.forward, mode=None if mode == "default" else mode, fullgraph=True, dynamic=False)

    def compiled_prefill(self):
        """A whole-prompt forward, compiled without CUDA graphs or autotuning (how gpt-fast
        compiles its prefill, when asked to); call it with last_only=True to sample from it."""
        return torch.compile(self.forward, fullgraph=True, dynamic=False)


class _LayerCache(nn.Module):
    """One layer's K and V: (batch, kv_heads, max_context, head_dim) each."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

"""A DeepSeek-V3-shaped model: MLA attention over a paged latent cache, dense and MoE FFNs, and
the MTP block, on kforge's operators (config.py describes the architecture).

Per block, the residual stream h (B, S, dim):

    h = h + MLA(rms_norm(h))
    h = h + FFN(rms_norm(h))          SwiGLU MLP in the first n_dense_layers, MoE after

MLA, for each token x (section 2.1.1 of the report):

    q          = W_UQ rms_norm(W_DQ x)   (or W_Q x)    per head [q_nope (128), q_rope (64)]
    [c, k_r]   = W_DKV x;  c = rms_norm(c)            the latent (512) and the shared RoPE key (64)
    q_rope, k_r rotated by RoPE at the token's position
    cache     <- [c, k_r]                              one 576-number row a token, all heads share it
    k_h        = [W_UK,h c, k_r],  v_h = W_UV,h c      the per-head key (192) and value (128)
    o_h        = softmax(q_h . k_h / sqrt(192)) v_h;   out = W_O [o_1 .. o_H]

Two ways to compute o_h, equal in exact arithmetic:
- prefill, unabsorbed: build k_h and v_h for every token and run causal SDPA (head dims 192
  and 128). Prefill is compute-bound, and this form does 2 x (192 + 128) FLOPs per (head, query,
  key) where the absorbed form does 2 x (576 + 512), 3.4x more (DeepSeek's and vLLM's choice too);
- decode, absorbed: q_nope . (W_UK,h c) = (W_UK,h^T q_nope) . c, so a head's query becomes
  [W_UK,h^T q_nope, q_rope] (576) against the cache rows [c, k_r] as they are, and o_h =
  W_UV,h (sum_t p_t c_t): `kforge.ops.mla_decode` over the paged cache, which reads each
  cached row once for all heads (decode is bound by those bytes). A step of S tokens a row
  (speculative verification) is causal over the S: query i sees the cache up to its own token.

The MoE FFN runs kforge's MoE ops: sigmoid group-limited routing (`moe_gate`), the shared
experts appended as always-on experts, `moe_dispatch`, two contiguous grouped GEMMs (SwiGLU
fused into the first) and `moe_combine`, as `kernels/moe/deepseek.py` does with the kernels
directly. On a CPU every kforge op runs its PyTorch reference (mla_decode in float64), so the
tests run this very code; float64 models take the MLA op's float64 reference directly (the op
takes 16- and 32-bit floats) and must be all-dense (the grouped GEMMs take fp32 at most).
Norms, RoPE and the dense projections are plain PyTorch.

MTP (section 2.2): for main-model position j, with h_j the last block's output there and
t_{j+1} the next token,

    g_j = Block_mtp(W_M [rms_norm(h_j); rms_norm(embed(t_{j+1}))])   at position j
    logits_mtp(j) = lm_head(rms_norm(g_j))                           predicts t_{j+2}

The embedding and the head are the main model's. The MTP block has its own latent cache (a
one-layer `LatentCache`), since it attends over its own rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kforge import ops
from kforge.errors import ModelError
from kforge.kernels.mla.decode import PAGE_SIZES, mla_decode_reference
from kforge.kernels.moe.deepseek import INTERPRETER_ALIGN
from kforge.kernels.moe.gating import append_shared_experts
from kforge.kernels.moe.grouped_gemm import ROW_ALIGN, contiguous_m_indices
from kforge.models.deepseek.config import DeepSeekConfig


@dataclass
class Pass:
    """Which tokens one forward pass feeds: S tokens to each of the B cache `rows`, at `positions`
    (B, S); `seqlens` (B,) int32, each row's cached tokens once they are appended (`lengths`, the
    same on the host by row); `prefill`: the rows start from empty (unabsorbed attention over the
    pass's own tokens)."""

    rows: torch.Tensor
    positions: torch.Tensor
    seqlens: torch.Tensor
    lengths: dict[int, int]
    prefill: bool


class LatentCache:
    """Every layer's latent rows [c, k_r] in pages: pool (layers, pages, page_size, 1, latent_dim),
    the layout `kforge.ops.mla_decode` reads. Row b's i-th page is page i * batch + b, so the rows
    interleave in the pool and every read goes through the block table. Lengths live on the host:
    a pass appends at each row's length; `truncate` drops a row's last tokens (rejected drafts),
    which later passes overwrite."""

    def __init__(self, config: DeepSeekConfig, *, batch: int, max_context: int, layers: int, page_size: int,
                 dtype: torch.dtype, device: torch.device | str):
        if page_size not in PAGE_SIZES:
            raise ModelError(f"page_size {page_size} is not one kforge's MLA decode takes ({PAGE_SIZES})")
        if batch < 1 or max_context < 1:
            raise ModelError(f"a cache needs batch >= 1 and max_context >= 1, got {batch} and {max_context}")
        pages_per_row = -(-max_context // page_size)
        self.pool = torch.zeros(layers, pages_per_row * batch, page_size, 1, config.latent_dim, dtype=dtype,
                                device=device)
        self.block_table = (torch.arange(pages_per_row, device=device)[None, :] * batch
                            + torch.arange(batch, device=device)[:, None]).to(torch.int32)
        self.page_size, self.max_context = page_size, max_context
        self.lengths = [0] * batch

    def prefill_pass(self, row: int, length: int) -> Pass:
        """Row `row` starts over with `length` tokens."""
        if not 0 <= row < len(self.lengths):
            raise ModelError(f"row {row} is not one of the cache's {len(self.lengths)} rows")
        self._check_fits(row, length)
        device = self.block_table.device
        return Pass(torch.tensor([row], device=device), torch.arange(length, device=device)[None, :],
                    torch.tensor([length], dtype=torch.int32, device=device), {row: length}, prefill=True)

    def decode_pass(self, new: int, rows: Sequence[int] | None = None) -> Pass:
        """`new` more tokens for each of `rows` (default: every row), in that order."""
        rows = list(range(len(self.lengths))) if rows is None else [int(r) for r in rows]
        for row in rows:
            if not 0 <= row < len(self.lengths):
                raise ModelError(f"row {row} is not one of the cache's {len(self.lengths)} rows")
            self._check_fits(row, self.lengths[row] + new)
        if len(set(rows)) != len(rows):
            raise ModelError(f"a pass feeds each row once, got rows {rows}")
        device = self.block_table.device
        lengths = torch.tensor([self.lengths[r] for r in rows], device=device)
        return Pass(torch.tensor(rows, device=device), lengths[:, None] + torch.arange(new, device=device),
                    (lengths + new).to(torch.int32), {r: self.lengths[r] + new for r in rows}, prefill=False)

    def commit(self, p: Pass) -> None:
        """The pass's tokens are in: advance its rows' lengths."""
        for row, length in p.lengths.items():
            self.lengths[row] = length

    def truncate(self, row: int, length: int) -> None:
        """Keep row `row`'s first `length` tokens."""
        if not 0 <= length <= self.lengths[row]:
            raise ModelError(f"cannot truncate row {row} of {self.lengths[row]} tokens to {length}")
        self.lengths[row] = length

    def write(self, layer: int, p: Pass, rows: torch.Tensor) -> None:
        """rows (B, S, latent_dim) at the pass's positions: page block_table[row, pos // page_size],
        slot pos % page_size."""
        pages = self.block_table.index_select(0, p.rows).gather(1, p.positions // self.page_size).long()
        self.pool[layer][pages, p.positions % self.page_size, 0] = rows

    def _check_fits(self, row: int, length: int) -> None:
        if length > self.max_context:
            raise ModelError(f"row {row}: {length} tokens exceed the cache's max_context of {self.max_context}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight, the mean taken in fp32 at least."""
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    return (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on adjacent pairs (x_2i, x_2i+1), as DeepSeek's code rotates them; cos and sin
    broadcast against x's pairs (..., rope_dim / 2)."""
    pairs = x.unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


def latent_attention(q: torch.Tensor, pool: torch.Tensor, block_table: torch.Tensor, seqlens: torch.Tensor,
                     kv_lora_rank: int, scale: float) -> torch.Tensor:
    """Absorbed MLA over the paged cache, causal over q's S tokens: (B, S, H, kv_lora_rank)."""
    if q.dtype == torch.float64:  # a checking dtype the op refuses: its own float64 definition
        return mla_decode_reference(q, pool, block_table, seqlens, kv_lora_rank, softmax_scale=scale, causal=True)[0]
    return ops.mla_decode(q, pool, block_table, seqlens, kv_lora_rank, softmax_scale=scale, causal=True,
                          validate=False)[0]


class MLA(nn.Module):
    def __init__(self, c: DeepSeekConfig):
        super().__init__()
        self.config = c
        heads = c.n_heads
        if c.q_lora_rank:
            self.wq_a = nn.Parameter(torch.empty(c.q_lora_rank, c.dim))
            self.q_norm = nn.Parameter(torch.ones(c.q_lora_rank))
            self.wq_b = nn.Parameter(torch.empty(heads * c.qk_head_dim, c.q_lora_rank))
        else:
            self.wq = nn.Parameter(torch.empty(heads * c.qk_head_dim, c.dim))
        self.wkv_a = nn.Parameter(torch.empty(c.latent_dim, c.dim))  # [W_DKV (the latent); W_KR (the RoPE key)]
        self.kv_norm = nn.Parameter(torch.ones(c.kv_lora_rank))
        self.wkv_b = nn.Parameter(torch.empty(heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank))  # [W_UK,h; W_UV,h]
        self.wo = nn.Parameter(torch.empty(c.dim, heads * c.v_head_dim))

    def forward(self, x: torch.Tensor, p: Pass, cache: LatentCache, layer: int, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        """x (B, S, dim) normed -> (B, S, dim); appends the tokens' latent rows to `layer` of the cache."""
        c = self.config
        batch, new, _ = x.shape
        if c.q_lora_rank:
            q = rms_norm(x @ self.wq_a.T, self.q_norm, c.norm_eps) @ self.wq_b.T
        else:
            q = x @ self.wq.T
        q_nope, q_rope = q.view(batch, new, c.n_heads, c.qk_head_dim).split([c.qk_nope_head_dim, c.qk_rope_head_dim],
                                                                           dim=-1)
        q_rope = rotate(q_rope, cos[:, :, None], sin[:, :, None])
        latent, k_rope = (x @ self.wkv_a.T).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        latent = rms_norm(latent, self.kv_norm, c.norm_eps)
        k_rope = rotate(k_rope, cos, sin)
        cache.write(layer, p, torch.cat((latent, k_rope), dim=-1))
        if p.prefill:
            out = self._unabsorbed(q_nope, q_rope, latent, k_rope)
        else:
            out = self._absorbed(q_nope, q_rope, cache, layer, p)
        return out.flatten(-2) @ self.wo.T

    def _unabsorbed(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor,
                    k_rope: torch.Tensor) -> torch.Tensor:
        """Causal attention over the pass's own tokens with per-head keys and values: (B, S, H, v)."""
        c = self.config
        batch, new, heads, _ = q_nope.shape
        k_nope, v = (latent @ self.wkv_b.T).view(batch, new, heads, -1).split([c.qk_nope_head_dim, c.v_head_dim], -1)
        q = torch.cat((q_nope, q_rope), dim=-1)
        k = torch.cat((k_nope, k_rope[:, :, None].expand(-1, -1, heads, -1)), dim=-1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                             scale=c.softmax_scale)
        return out.transpose(1, 2)

    def _absorbed(self, q_nope: torch.Tensor, q_rope: torch.Tensor, cache: LatentCache, layer: int,
                  p: Pass) -> torch.Tensor:
        """W_UK folded into the query, latent attention over the cache, W_UV applied after: (B, S, H, v)."""
        c = self.config
        w = self.wkv_b.view(c.n_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        w_uk, w_uv = w[:, :c.qk_nope_head_dim], w[:, c.qk_nope_head_dim:]
        q = torch.cat((torch.einsum("bshn,hnc->bshc", q_nope, w_uk), q_rope), dim=-1).contiguous()
        out_latent = latent_attention(q, cache.pool[layer], cache.block_table.index_select(0, p.rows), p.seqlens,
                                      c.kv_lora_rank, c.softmax_scale)
        return torch.einsum("bshc,hvc->bshv", out_latent, w_uv)


class DenseFFN(nn.Module):
    def __init__(self, c: DeepSeekConfig):
        super().__init__()
        self.w_gate_up = nn.Parameter(torch.empty(2 * c.ffn_dim, c.dim))  # [gate; up] rows
        self.w_down = nn.Parameter(torch.empty(c.dim, c.ffn_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = (x @ self.w_gate_up.T).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ self.w_down.T


class MoE(nn.Module):
    """y = sum_j w_j FFN_{e_j}(x) over the router's top_k + sum_s FFN_shared_s(x) (config.py)."""

    def __init__(self, c: DeepSeekConfig):
        super().__init__()
        self.config = c
        experts = c.n_routed_experts + c.n_shared_experts
        self.router = nn.Parameter(torch.empty(c.n_routed_experts, c.dim))
        self.router_bias = nn.Parameter(torch.empty(c.n_routed_experts))  # e_score_correction_bias: selection only
        self.w13 = nn.Parameter(torch.empty(experts, 2 * c.moe_inter, c.dim))  # per expert [gate; up], shared last
        self.w2 = nn.Parameter(torch.empty(experts, c.dim, c.moe_inter))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        tokens = x.reshape(-1, c.dim).contiguous()
        align = ROW_ALIGN if x.is_cuda else INTERPRETER_ALIGN
        ids, weights = ops.moe_gate(F.linear(tokens.float(), self.router.float()), c.top_k, scoring="sigmoid",
                                    bias=self.router_bias.float(), n_group=c.n_group, topk_group=c.topk_group,
                                    routed_scaling_factor=c.routed_scaling_factor)
        ids, weights = append_shared_experts(ids, weights, c.n_routed_experts, c.n_shared_experts)
        layout = ops.moe_dispatch(ids, weights, c.n_routed_experts + c.n_shared_experts, align)
        m_indices = contiguous_m_indices(layout)
        hidden = ops.grouped_gemm_contiguous(tokens.index_select(0, layout.source_rows), self.w13, m_indices,
                                             gated=True, align=align)
        out = ops.grouped_gemm_contiguous(hidden, self.w2, m_indices, align=align)
        return ops.moe_combine(out, layout.slots, weights, x.dtype).view(x.shape)


class Block(nn.Module):
    def __init__(self, c: DeepSeekConfig, layer: int):
        super().__init__()
        self.eps = c.norm_eps
        self.attn_norm = nn.Parameter(torch.ones(c.dim))
        self.attn = MLA(c)
        self.ffn_norm = nn.Parameter(torch.ones(c.dim))
        self.ffn = MoE(c) if c.is_moe(layer) else DenseFFN(c)

    def forward(self, h: torch.Tensor, p: Pass, cache: LatentCache, layer: int, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(rms_norm(h, self.attn_norm, self.eps), p, cache, layer, cos, sin)
        return h + self.ffn(rms_norm(h, self.ffn_norm, self.eps))


class MTP(nn.Module):
    """DeepSeek-V3's multi-token prediction module of depth 1 (its embedding and head are the main model's)."""

    def __init__(self, c: DeepSeekConfig):
        super().__init__()
        self.hidden_norm = nn.Parameter(torch.ones(c.dim))
        self.embed_norm = nn.Parameter(torch.ones(c.dim))
        self.proj = nn.Parameter(torch.empty(c.dim, 2 * c.dim))  # W_M
        self.block = Block(c, c.n_layers)
        self.norm = nn.Parameter(torch.ones(c.dim))


class DeepSeekV3(nn.Module):
    def __init__(self, config: DeepSeekConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Parameter(torch.empty(config.vocab_size, config.dim))
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = nn.Parameter(torch.ones(config.dim))
        self.lm_head = nn.Parameter(torch.empty(config.vocab_size, config.dim))
        self.mtp = MTP(config)
        self._rope: torch.Tensor | None = None
        self._rope_factor = 1.0

    def init_random(self, seed: int = 0, std: float = 0.02) -> DeepSeekV3:
        """Random weights (normal, std 0.02; norms 1), the same for a seed on any device."""
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(torch.ones(p.shape) if name.endswith("norm") else torch.randn(p.shape, generator=generator) * std)
        return self

    def new_cache(self, batch: int, max_context: int, *, mtp: bool = False, page_size: int = 16) -> LatentCache:
        """A latent cache for the main model's layers, or with `mtp` for the MTP block."""
        if max_context > self.config.max_position:
            raise ModelError(f"max_context {max_context} is longer than the model's {self.config.max_position} "
                             f"positions")
        return LatentCache(self.config, batch=batch, max_context=max_context, layers=1 if mtp else self.config.n_layers,
                           page_size=page_size, dtype=self.embed.dtype, device=self.embed.device)

    # --- the main model ---------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, cache: LatentCache, row: int = 0) -> torch.Tensor:
        """Row `row` of the cache starts over with `tokens` (T,): the last block's output (1, T, dim)."""
        return self._main(tokens[None, :], cache.prefill_pass(row, tokens.shape[0]), cache)

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, cache: LatentCache, rows: Sequence[int] | None = None) -> torch.Tensor:
        """tokens (B, S): S more tokens for each of B cache rows (`rows`, default all of them), each
        attending to its row's cache and causally to the S: the last block's output (B, S, dim)."""
        return self._main(tokens, cache.decode_pass(tokens.shape[1], rows), cache)

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 next-token logits of the main model's hidden states (..., dim)."""
        return (rms_norm(hidden, self.norm, self.config.norm_eps) @ self.lm_head.T).float()

    def _main(self, tokens: torch.Tensor, p: Pass, cache: LatentCache) -> torch.Tensor:
        cos, sin = self._rope_at(p.positions)
        h = F.embedding(tokens, self.embed)
        for layer, block in enumerate(self.layers):
            h = block(h, p, cache, layer, cos, sin)
        cache.commit(p)
        return h

    # --- the MTP block ---------------------------------------------------------------------------

    @torch.no_grad()
    def mtp_prefill(self, hidden: torch.Tensor, next_tokens: torch.Tensor, cache: LatentCache,
                    row: int = 0) -> torch.Tensor:
        """The MTP block over positions 0 .. T-1 of row `row` (its cache starts over): hidden (1, T,
        dim), the main model's there, and next_tokens (T,), the token after each: g (1, T, dim)."""
        return self._mtp(hidden, next_tokens[None, :], cache.prefill_pass(row, next_tokens.shape[0]), cache)

    @torch.no_grad()
    def mtp_decode(self, hidden: torch.Tensor, next_tokens: torch.Tensor, cache: LatentCache,
                   rows: Sequence[int] | None = None) -> torch.Tensor:
        """S more MTP positions for each of B rows (`rows`, default all): hidden (B, S, dim) (the main
        model's, or the MTP's own output when drafting ahead) and next_tokens (B, S): g (B, S, dim)."""
        return self._mtp(hidden, next_tokens, cache.decode_pass(next_tokens.shape[1], rows), cache)

    @torch.no_grad()
    def mtp_logits(self, g: torch.Tensor) -> torch.Tensor:
        """fp32 logits of the token after next, from the MTP block's output (..., dim)."""
        return (rms_norm(g, self.mtp.norm, self.config.norm_eps) @ self.lm_head.T).float()

    def _mtp(self, hidden: torch.Tensor, next_tokens: torch.Tensor, p: Pass, cache: LatentCache) -> torch.Tensor:
        eps, m = self.config.norm_eps, self.mtp
        x = torch.cat((rms_norm(hidden, m.hidden_norm, eps), rms_norm(F.embedding(next_tokens, self.embed),
                                                                       m.embed_norm, eps)), dim=-1) @ m.proj.T
        g = m.block(x, p, cache, 0, *self._rope_at(p.positions))
        cache.commit(p)
        return g

    def _rope_at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (B, S, rope_dim / 2) at `positions`, in the model's dtype (angles in float64),
        times YaRN's attention factor (config.rope_frequencies)."""
        c = self.config
        if self._rope is None or self._rope.device != self.embed.device:
            freqs, self._rope_factor = c.rope_frequencies()
            self._rope = torch.outer(torch.arange(c.max_position, dtype=torch.float64), freqs).to(self.embed.device)
        angles = self._rope[positions]
        return ((angles.cos() * self._rope_factor).to(self.embed.dtype),
                (angles.sin() * self._rope_factor).to(self.embed.dtype))


def random_model(config: DeepSeekConfig, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> DeepSeekV3:
    """The model with `init_random(seed)` weights (drawn on the CPU), in `dtype` on `device`."""
    if config.parameter_count() + config.parameter_count(mtp=True) > 2e9:
        raise ModelError(f"{config.parameter_count() / 1e9:.0f}B parameters: random_model draws on the CPU; "
                         f"instantiate small configs only")
    return DeepSeekV3(config).init_random(seed).to(dtype=dtype, device=device).eval()


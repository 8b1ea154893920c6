"""The Llama-3-8B decoder layer decoding one token per sequence against a dense static KV
cache, on kforge's serving kernels (problem: the file of the same name in problems/level3).

    qkv     = rms_norm(x) [Wq; Wk; Wv]^T          gemv.py with the norm folded in (norm_qkv's decode path)
    q, k    = rope_ in place at position P         rope.py
    cache   <- k, v at position P                  paged_kv_append, through a page view of the cache
    attn    = decode attention over P + 1 tokens   paged_decode (flash-decoding, GQA groups read K/V once)
    o       = attn Wo^T                            gemv.py
    n2, h   = rms_norm(x + o), x + o               norms.py, the residual add fused
    out     = h + swiglu(n2 [Wgate; Wup]^T) Wdown^T   gemv.py, swiglu.py, gemv.py, one add

The dense cache (batch, kv_heads, max_context, d) is read where it lies. Token t of request
b, head h sits at element ((b kv_heads + h) max_context + t) d. Cut each request's tokens
into pages of PAGE: with a page stride of PAGE d, a head stride of max_context d and a token
stride of d, page id b kv_heads (max_context / PAGE) + p, head h, slot s is exactly token
p PAGE + s of (b, h). So one strided view (`paged_view`) is a pool of pages whose block
tables never change: no copy, nothing rebuilt per call.

Memory-bound, ~0.7 GB a call (the weights, then K and V): the kernels stream it at
85-98% of HBM bandwidth (README's serving table); the rest is host time, so everything
derivable is built once (fused weights, block tables, lengths, positions) and the GEMVs
launch their tuned tiles directly after the first call. Up to 16 rows take the GEMV; a
larger batch takes kforge.ops.matmul. On the CPU the Triton kernels run under the
interpreter (kforge.ops.matmul, only for batches over 16, falls back to torch.matmul).
"""

import torch
from torch import nn

from kforge.kernels.serving.gemv import MAX_BATCH, gemv_autotuned, launch_gemv
from kforge.kernels.serving.norms import rms_norm_forward
from kforge.kernels.serving.paged_decode import paged_decode
from kforge.kernels.serving.paged_kv import paged_kv_append
from kforge.kernels.serving.rope import apply_rope_, cos_sin_table
from kforge.kernels.serving.swiglu import swiglu_forward
from kforge.ops import matmul

PAGE_SIZES = (16, 8)  # the first that divides max_context is the view's page


def _linear(in_features: int, out_features: int) -> nn.Linear:
    layer = nn.Linear(in_features, out_features, bias=False, dtype=torch.bfloat16)
    nn.init.normal_(layer.weight, std=in_features**-0.5)
    return layer


def _norm_weight(hidden: int) -> nn.Parameter:
    return nn.Parameter((1 + 0.1 * torch.randn(hidden)).to(torch.bfloat16))


def paged_view(cache: torch.Tensor, page: int) -> torch.Tensor:
    """A contiguous (batch, kv_heads, max_context, d) cache as a strided pool of pages
    (num_pages, kv_heads, page, d): page id b * kv_heads * (max_context // page) + p is
    request b's tokens [p * page, (p + 1) * page). num_pages stops at the last page a
    request uses, so the view stays inside the cache's storage."""
    batch, kv_heads, max_context, head_dim = cache.shape
    per_request = max_context // page
    num_pages = (batch - 1) * kv_heads * per_request + per_request
    return cache.as_strided((num_pages, kv_heads, page, head_dim), (page * head_dim, max_context * head_dim,
                                                                    head_dim, 1))


class ModelNew(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, mlp: int, rope_theta: float, eps: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.rope_theta, self.eps = rope_theta, eps
        # the reference's weights, drawn in its order under the same seed, then fused
        self.input_norm = _norm_weight(hidden)
        q_width, kv_width = heads * self.head_dim, kv_heads * self.head_dim
        q, k, v = _linear(hidden, q_width), _linear(hidden, kv_width), _linear(hidden, kv_width)
        o = _linear(q_width, hidden)
        self.post_norm = _norm_weight(hidden)
        gate, up, down = _linear(hidden, mlp), _linear(hidden, mlp), _linear(mlp, hidden)
        self.register_buffer("w_qkv", torch.cat((q.weight, k.weight, v.weight)).detach())
        self.register_buffer("w_o", o.weight.detach())
        self.register_buffer("w_gate_up", torch.cat((gate.weight, up.weight)).detach())
        self.register_buffer("w_down", down.weight.detach())
        self._steps: dict[tuple, tuple] = {}
        self._gemv_tiles: dict[tuple, dict] = {}

    def step_tensors(self, batch: int, max_context: int, cache_len: int, device: torch.device) -> tuple:
        """(page, block tables, lengths before and after the new token), built once per shape; the
        lengths before are also the new tokens' positions."""
        key = (batch, max_context, cache_len, device)
        if key not in self._steps:
            page = next((p for p in PAGE_SIZES if max_context % p == 0), None)
            if page is None:
                raise ValueError(f"the cache holds {max_context} tokens a sequence: a multiple of 8 is needed to view "
                                 f"it as pages")
            if not 0 <= cache_len < max_context:
                raise ValueError(f"cache_len {cache_len} leaves no room in a cache of {max_context} tokens")
            per_request = max_context // page
            first = torch.arange(batch, device=device)[:, None] * (self.kv_heads * per_request)
            tables = (first + torch.arange(per_request, device=device)).int()
            before = torch.full((batch,), cache_len, dtype=torch.int32, device=device)
            self._steps[key] = (page, tables, before, before + 1)
        return self._steps[key]

    def linear(self, x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None = None) -> torch.Tensor:
        """x @ weight.T, or rms_norm(x; norm_weight) @ weight.T: the GEMV (its tuned tile after
        the first call) up to 16 rows, else the norm kernel and kforge.ops.matmul."""
        if x.shape[0] > MAX_BATCH:
            return matmul(x if norm_weight is None else rms_norm_forward(x, norm_weight, self.eps), weight.t())
        key = (x.shape[0], *weight.shape, norm_weight is not None, x.device)
        tiles = self._gemv_tiles.get(key)
        y = launch_gemv(x, weight, tiles, norm_eps=None if norm_weight is None else self.eps, norm_weight=norm_weight)
        if tiles is None and x.is_cuda:
            best = gemv_autotuned.best_config
            self._gemv_tiles[key] = dict(best.kwargs, num_warps=best.num_warps, num_stages=best.num_stages)
        return y

    def forward(self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_len: int) -> torch.Tensor:
        batch, _, hidden = x.shape
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("the caches must be contiguous (batch, kv_heads, max_context, head_dim) tensors")
        page, tables, before, after = self.step_tensors(batch, k_cache.shape[2], cache_len, x.device)
        rows = x.reshape(batch, hidden)
        qkv = self.linear(rows, self.w_qkv, self.input_norm)
        q_width, kv_width = self.heads * self.head_dim, self.kv_heads * self.head_dim
        q = qkv[:, :q_width].view(batch, self.heads, self.head_dim)
        k = qkv[:, q_width:q_width + kv_width].view(batch, self.kv_heads, self.head_dim)
        v = qkv[:, q_width + kv_width:].view(batch, self.kv_heads, self.head_dim)
        apply_rope_(q, k, before, cos_sin_table(k_cache.shape[2], self.head_dim, self.rope_theta, x.device))
        k_pages, v_pages = paged_view(k_cache, page), paged_view(v_cache, page)
        paged_kv_append(k, v, k_pages, v_pages, tables, before, validate=False)
        attn = paged_decode(q, k_pages, v_pages, tables, after, validate=False)
        n2, h = rms_norm_forward(self.linear(attn.view(batch, q_width), self.w_o), self.post_norm, self.eps,
                                 residual=rows)
        a = swiglu_forward(self.linear(n2, self.w_gate_up))
        return (h + self.linear(a, self.w_down)).view(batch, 1, hidden)

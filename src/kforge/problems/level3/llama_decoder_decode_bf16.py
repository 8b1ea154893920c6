"""The Llama-3-8B decoder layer of llama_decoder_prefill_bf16.py decoding ONE token per
sequence against a static KV cache, bf16, as a user of a preallocated cache writes it:

    n1  = rms_norm(x);  q, k, v = projections of n1;  q, k = rope(q), rope(k) at position P
    k_cache[:, :, P] = k;  v_cache[:, :, P] = v        (index_copy_, in place: the cache is an input)
    h   = x + SDPA(q, k_cache[:, :, :P+1], v_cache[:, :, :P+1], enable_gqa) Wo^T
    out = h + W_down (silu(n2 W_gate^T) * (n2 W_up^T)),  n2 = rms_norm(h)

Inputs: x (BATCH, 1, HIDDEN); k_cache and v_cache (BATCH, KV_HEADS, MAX_CONTEXT, head_dim)
holding CONTEXT tokens already (random, as keys after RoPE are); cache_len = P = CONTEXT,
the new token's position (an int: every sequence is at the same step). The output is out;
the caches, changed in place at position P, are compared too (the harness holds inputs a
reference changes to the same tolerance as outputs).

Work at BATCH 16, CONTEXT 4096: memory-bound. The projections read 436 MB of weights for
2 * 16 * 218M = 7 GFLOP; attention reads K and V of 4097 tokens x 8 heads x 128 for 16
sequences, 268 MB: ~0.7 GB in all, ~0.24 ms at ~3 TB/s. Eager adds ~40 kernel launches
of a few microseconds each (norms, RoPE, the cache writes, SDPA, the MLP's elementwise
ops). MAX_CONTEXT is a multiple of 64 (a cache allocated in pages' worth of tokens).
Memory: ~0.7 GB.
"""

import torch
import torch.nn.functional as F
from torch import nn

BATCH, CONTEXT, MAX_CONTEXT = 16, 4096, 4160
HIDDEN, HEADS, KV_HEADS, MLP = 4096, 32, 8, 14336
ROPE_THETA, EPS = 500000.0, 1e-5

tags = ["level3", "bf16", "llama", "decode", "attention", "gemv", "kv-cache"]
compute_dtype = "bf16"
tiny_sizes = {"BATCH": 3, "CONTEXT": 10, "MAX_CONTEXT": 16, "HIDDEN": 64, "HEADS": 4, "KV_HEADS": 2, "MLP": 128}
# As llama_decoder_prefill_bf16.py: sigma ~ 0.003 of (1 + |out|) between a fused solution
# and eager (measured on the CPU at batch 16, 300 tokens, hidden 512), max 0.016 over 2.5e4
# elements; the full size checks 3e5. The new cache entries, k and v after RoPE, differ by
# a bf16 step or two (eager rounds RoPE's products separately, on bf16 cos/sin). atol 4e-2:
# one bf16 step of the residual stream where it reaches |h| in [4, 8) is 2^-5 = 0.031, and an
# output that cancels down near 0 keeps that step whole (tiny size, CPU, 2026-11-22: max
# error 0.03125 in 13 of 16 seeded runs, and once on an output of -0.039, past 3e-2 + 3e-2 x
# 0.039).
tolerance = {"atol": 4e-2, "rtol": 3e-2}


def _projection_weights() -> int:
    head_dim = HIDDEN // HEADS
    return HIDDEN * (HEADS * head_dim + 2 * KV_HEADS * head_dim) + HEADS * head_dim * HIDDEN + 3 * HIDDEN * MLP


def flops(inputs):
    x, k_cache, _, cache_len = inputs
    attention = 4 * x.shape[0] * HEADS * (cache_len + 1) * k_cache.shape[3]
    return 2 * x.shape[0] * _projection_weights() + attention


def bytes_moved(inputs):
    x, k_cache, _, cache_len = inputs
    batch, kv_heads, _, head_dim = k_cache.shape
    kv_read = 2 * batch * kv_heads * (cache_len + 1) * head_dim
    kv_written = 2 * batch * kv_heads * head_dim
    return 2 * (_projection_weights() + 2 * HIDDEN + kv_read + kv_written + 2 * x.numel())


def _linear(in_features: int, out_features: int) -> nn.Linear:
    layer = nn.Linear(in_features, out_features, bias=False, dtype=torch.bfloat16)
    nn.init.normal_(layer.weight, std=in_features**-0.5)
    return layer


def _norm_weight(hidden: int) -> nn.Parameter:
    return nn.Parameter((1 + 0.1 * torch.randn(hidden)).to(torch.bfloat16))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Model(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, mlp: int, rope_theta: float, eps: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.eps = heads, kv_heads, hidden // heads, eps
        self.input_norm = _norm_weight(hidden)
        self.q_proj = _linear(hidden, heads * self.head_dim)
        self.k_proj = _linear(hidden, kv_heads * self.head_dim)
        self.v_proj = _linear(hidden, kv_heads * self.head_dim)
        self.o_proj = _linear(heads * self.head_dim, hidden)
        self.post_norm = _norm_weight(hidden)
        self.gate_proj = _linear(hidden, mlp)
        self.up_proj = _linear(hidden, mlp)
        self.down_proj = _linear(mlp, hidden)
        inv_freq = rope_theta ** (-torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_len: int) -> torch.Tensor:
        batch = x.shape[0]
        position = torch.arange(cache_len, cache_len + 1, device=x.device)
        angles = position[:, None].float() * self.inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)

        h = rms_norm(x, self.input_norm, self.eps)
        q = self.q_proj(h).view(batch, 1, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(batch, 1, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(batch, 1, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k_cache.index_copy_(2, position, k)
        v_cache.index_copy_(2, position, v)
        live = cache_len + 1
        attn = F.scaled_dot_product_attention(q, k_cache[:, :, :live], v_cache[:, :, :live], enable_gqa=True)
        x = x + self.o_proj(attn.transpose(1, 2).reshape(batch, 1, self.heads * self.head_dim))

        h = rms_norm(x, self.post_norm, self.eps)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


def get_inputs():
    head_dim = HIDDEN // HEADS
    x = torch.randn(BATCH, 1, HIDDEN).to(torch.bfloat16)
    k_cache = torch.randn(BATCH, KV_HEADS, MAX_CONTEXT, head_dim).to(torch.bfloat16)
    v_cache = torch.randn(BATCH, KV_HEADS, MAX_CONTEXT, head_dim).to(torch.bfloat16)
    return [x, k_cache, v_cache, CONTEXT]


def get_init_inputs():
    return [HIDDEN, HEADS, KV_HEADS, MLP, ROPE_THETA, EPS]

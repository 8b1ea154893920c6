"""A Llama-3-8B decoder layer at prefill, bf16, as Hugging Face's LlamaDecoderLayer runs it
in eager PyTorch with SDPA:

    n1  = rms_norm(x)                                  fp32 statistics, rounded, times gamma
    q, k, v = n1 Wq^T, n1 Wk^T, n1 Wv^T                32 query heads, 8 KV heads, of 128
    q, k = rope(q), rope(k)                            rotate_half on bf16 cos/sin, theta 500000
    h   = x + SDPA(q, k, v, is_causal, enable_gqa) Wo^T
    out = h + W_down (silu(n2 W_gate^T) * (n2 W_up^T)),  n2 = rms_norm(h)

x is (BATCH, SEQ, HIDDEN), positions 0 .. SEQ-1 in every sequence; the weights are made in
__init__ (normal, std 1/sqrt(fan_in): unit-scale activations; norm weights 1 + 0.1 N(0, 1)).

Work at BATCH 2 x SEQ 2048 (4096 tokens): the seven projections are 2 * tokens * 218M
weights = 1.79 TFLOP, causal attention 4 B H S^2 d / 2 = 0.07 TFLOP: compute-bound, ~2.4 ms
at ~790 TFLOP/s. Eager adds what a fused layer need not move: RMSNorm's fp32 round trips
(36 bytes an element, ~0.6 GB a norm), RoPE's rotate_half, cat and products (~0.4 GB),
silu and the product (~0.6 GB), the residual adds (0.2 GB): ~2.4 GB, ~0.8 ms at ~3 TB/s,
where fused kernels move ~0.7 GB. Minimum bytes: the weights (436 MB), x read and out
written once. Memory: ~1.5 GB.
"""

import torch
import torch.nn.functional as F
from torch import nn

BATCH, SEQ = 2, 2048
HIDDEN, HEADS, KV_HEADS, MLP = 4096, 32, 8, 14336
ROPE_THETA, EPS = 500000.0, 1e-5

tags = ["level3", "bf16", "llama", "prefill", "attention", "gemm", "norm"]
compute_dtype = "bf16"
tiny_sizes = {"BATCH": 2, "SEQ": 11, "HIDDEN": 64, "HEADS": 4, "KV_HEADS": 2, "MLP": 128}
# out ~ N(0, 1.4). Eager rounds to bf16 after every op (RoPE on bf16 cos/sin, the norm
# twice), a fused solution once per kernel: both sit ~0.4% (RMS) from float64 and differ
# from each other by sigma ~ 0.0036 of (1 + |out|), with tails heavier than Gaussian (max
# 0.021 over 3e5 elements; measured on the CPU at 200 tokens, hidden 512, head 128). The
# full size checks 8e7 elements over five trials: tails near 0.03. A wrong mask, rotation,
# position or norm moves outputs by ~1.
tolerance = {"atol": 4e-2, "rtol": 4e-2}


def _projection_weights() -> int:
    head_dim = HIDDEN // HEADS
    return HIDDEN * (HEADS * head_dim + 2 * KV_HEADS * head_dim) + HEADS * head_dim * HIDDEN + 3 * HIDDEN * MLP


def flops(inputs):
    batch, seq, _ = inputs[0].shape
    causal_attention = 2 * batch * HEADS * seq * seq * (HIDDEN // HEADS)  # half of 4 B H S^2 d
    return 2 * batch * seq * _projection_weights() + causal_attention


def bytes_moved(inputs):
    x = inputs[0]
    return 2 * (_projection_weights() + 2 * HIDDEN) + 2 * x.numel() * x.element_size()


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
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # fp32: angles reach 2^11 rad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        positions = torch.arange(seq, device=x.device, dtype=torch.float32)
        angles = positions[:, None] * self.inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)

        h = rms_norm(x, self.input_norm, self.eps)
        q = self.q_proj(h).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o_proj(attn.transpose(1, 2).reshape(batch, seq, self.heads * self.head_dim))

        h = rms_norm(x, self.post_norm, self.eps)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


def get_inputs():
    return [torch.randn(BATCH, SEQ, HIDDEN).to(torch.bfloat16)]


def get_init_inputs():
    return [HIDDEN, HEADS, KV_HEADS, MLP, ROPE_THETA, EPS]

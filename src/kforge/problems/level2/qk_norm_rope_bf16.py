"""QK-norm then RoPE, bf16, as Hugging Face's Qwen3 attention prepares its queries and keys:
a per-head RMSNorm of q and of k (head_dim wide, learned weights), then rotary embedding
with cos/sin from the position ids. q and k come in as the projections leave them,
(batch, seq, heads, head_dim), and go out the same way.

The reference: Qwen3RMSNorm on each (upcast, square, mean, rsqrt, scale, downcast, times
the weight: 7 kernels), LlamaRotaryEmbedding (matmul of inv_freq by the positions, cat,
cos, sin, casts), and q cos + rotate_half(q) sin (two slices, a negate, a cat, two
products, a sum) for each: ~29 bytes moved per element of q and k. A fused kernel reads
q and k once and writes them once (4 bytes), norm and rotation in fp32 registers.

Sizes: Qwen3-8B (32 query heads, 8 KV heads, head_dim 128, rope theta 10^6), 4 sequences
of 4096 tokens: q is 134 MB, k 34 MB. Eager ~2.4 GB (~0.8 ms at ~3 TB/s, ~30 launches);
the floor is 336 MB (~0.11 ms). Tiny size: 2 x 3 tokens, 4 and 2 heads of 32.
"""

import torch
from torch import nn

BATCH, SEQ, Q_HEADS, KV_HEADS, HEAD_DIM = 4, 4096, 32, 8, 128
ROPE_THETA, MAX_POSITION, EPS = 1000000.0, 40960, 1e-6

tags = ["level2", "bf16", "norm", "rope", "fusion"]
tiny_sizes = {"BATCH": 2, "SEQ": 3, "Q_HEADS": 4, "KV_HEADS": 2, "HEAD_DIM": 32, "MAX_POSITION": 64}
# Eager rounds to bf16 after the norm, the weight, each product and the sum; fused once.
# Where x1 cos - x2 sin cancels, eager's rounded products leave up to 2.5e-2 absolute
# (float64 study, 8M elements at this size: 3 outside atol = 2e-2).
tolerance = {"atol": 4e-2, "rtol": 2e-2}


def bytes_moved(inputs):
    q, k, positions = inputs
    return 2 * (q.numel() + k.numel()) * q.element_size() + positions.numel() * positions.element_size()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class Qwen3RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter((1 + 0.1 * torch.randn(dim)).to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Model(nn.Module):
    def __init__(self, head_dim: int, rope_theta: float, max_position: int, eps: float):
        super().__init__()
        self.q_norm = Qwen3RMSNorm(head_dim, eps)
        self.k_norm = Qwen3RMSNorm(head_dim, eps)
        inv_freq = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, position_ids: torch.Tensor):
        q, k = self.q_norm(q), self.k_norm(k)
        freqs = (self.inv_freq[None, :, None] @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(q.dtype).unsqueeze(2), emb.sin().to(q.dtype).unsqueeze(2)  # (batch, seq, 1, dim)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def get_inputs():
    q = torch.randn(BATCH, SEQ, Q_HEADS, HEAD_DIM).to(torch.bfloat16)
    k = torch.randn(BATCH, SEQ, KV_HEADS, HEAD_DIM).to(torch.bfloat16)
    return [q, k, torch.arange(SEQ).repeat(BATCH, 1)]


def get_init_inputs():
    return [HEAD_DIM, ROPE_THETA, MAX_POSITION, EPS]

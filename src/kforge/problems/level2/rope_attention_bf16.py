"""RoPE then causal attention, bf16, as Hugging Face's Llama runs them at prefill: cos/sin
from the position ids, q and k rotated (rotate_half: GPT-NeoX's half-split pairs), then
scaled_dot_product_attention with is_causal. q, k, v come in as the QKV projection leaves
them, (batch, seq, heads, head_dim); the output goes out the same way, ready for o_proj.

The reference: LlamaRotaryEmbedding (a small matmul of inv_freq by the positions, cat,
cos, sin, casts), apply_rotary_pos_emb (q cos + rotate_half(q) sin: two slices, a negate,
a cat, two products and a sum, for q and for k: ~12 passes over q and k), then SDPA
(FlashAttention-2, the first backend PyTorch tries). A fused solution rotates q and k in
one pass and runs its own attention kernel on the rotated tensors where they lie.

Sizes: Llama-2-7B (32 heads of 128, no GQA), 2 sequences of 4096 tokens. Attention is
2 * 2 * 32 * 4096^2 * 128 = 275 GFLOP causal (~0.85 ms for FlashAttention-2 at ~330
TFLOP/s); the RoPE chain moves ~1.4 GB (~0.5 ms). Minimum traffic: q, k, v, the
positions read and the output written once. Tiny size: 1 x 20 tokens x 2 heads of 32.
"""

import torch
import torch.nn.functional as F
from torch import nn

BATCH, SEQ, HEADS, HEAD_DIM = 2, 4096, 32, 128
ROPE_THETA, MAX_POSITION = 10000.0, 4096

tags = ["level2", "bf16", "attention", "rope", "fusion"]
compute_dtype = "bf16"
tiny_sizes = {"BATCH": 1, "SEQ": 20, "HEADS": 2, "HEAD_DIM": 32, "MAX_POSITION": 64}
forbidden_ops = [
    "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_flash_attention_forward", "aten::_efficient_attention_forward",
]
# Eager rounds cos, sin and each step of the rotation to bf16, and attention outputs are
# weighted averages: as problems/level1/attention_bf16.py, ~1e-2 absolute (outputs ~0.1).
# With q and k of twice the spread (peaked attention), eager's rounded rotations alone
# move outputs by up to ~7e-2 (float64 study, N = 1024): the reference's own error.
tolerance = {"atol": 2e-2, "rtol": 2e-2}


def flops(inputs):
    q = inputs[0]
    batch, seq, heads, dim = q.shape
    return 2 * batch * heads * seq * seq * dim  # causal: half of 4 B H N^2 D


def bytes_moved(inputs):
    q, k, v, positions = inputs
    tensors = (q.numel() + k.numel() + v.numel() + q.numel()) * q.element_size()
    return tensors + positions.numel() * positions.element_size()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class Model(nn.Module):
    def __init__(self, head_dim: int, rope_theta: float, max_position: int):
        super().__init__()
        inv_freq = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, q, k, v, position_ids):
        freqs = (self.inv_freq[None, :, None] @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(q.dtype).unsqueeze(1), emb.sin().to(q.dtype).unsqueeze(1)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (batch, heads, seq, head_dim)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2)


def get_inputs():
    q = torch.randn(BATCH, SEQ, HEADS, HEAD_DIM).to(torch.bfloat16)
    k = torch.randn(BATCH, SEQ, HEADS, HEAD_DIM).to(torch.bfloat16)
    v = torch.randn(BATCH, SEQ, HEADS, HEAD_DIM).to(torch.bfloat16)
    return [q, k, v, torch.arange(SEQ).repeat(BATCH, 1)]


def get_init_inputs():
    return [HEAD_DIM, ROPE_THETA, MAX_POSITION]

"""Causal grouped-query attention forward in bf16 at Llama-3-8B's shape: 32 query heads sharing
8 key/value heads (4 queries a group), head dim 128, prompts of N = 4096 tokens, batch B.
O = softmax(Q K^T / sqrt(D) + causal mask) V per head, the mask top-left aligned (a query
sees itself and the keys before it). The reference is what model code writes:
F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), with PyTorch
choosing its backend.

FLOPs: 4 x B x H x N^2 x D / 2 (the causal half of two products, the FlashAttention
papers' convention): 550 GFLOP at B = 4, compute-bound (about 1.75 ms at FlashAttention-2's
~315 TFLOP/s causal on the H100). Minimum HBM bytes: q, k, v read and O written once
(1/4 of the key/value bytes of full multi-head attention).

Tiny size: 1 sequence of 67 tokens, 4 query heads over 2 key/value heads of 32.
"""

import torch
from torch import nn
from torch.nn.functional import scaled_dot_product_attention

B, H, KV_HEADS, N, D = 4, 32, 8, 4096, 128

tags = ["attention", "level1", "bf16", "causal", "gqa"]
compute_dtype = "bf16"
tiny_sizes = {"B": 1, "H": 4, "KV_HEADS": 2, "N": 67, "D": 32}
forbidden_ops = [
    "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_flash_attention_forward", "aten::_efficient_attention_forward", "aten::scaled_dot_product_attention",
]
tolerance = {"atol": 2e-2, "rtol": 2e-2}  # as attention_bf16.py: softmax-weighted averages of N(0, 1) values


def flops(inputs):
    q, k, _ = inputs
    return 4 * q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * q.shape[3] // 2


class Model(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def get_inputs():
    return [torch.randn(B, H, N, D).to(torch.bfloat16), torch.randn(B, KV_HEADS, N, D).to(torch.bfloat16),
            torch.randn(B, KV_HEADS, N, D).to(torch.bfloat16)]


def get_init_inputs():
    return []

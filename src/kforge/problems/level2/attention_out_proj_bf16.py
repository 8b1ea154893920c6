"""Causal attention, its output projection and the residual add, bf16: the second half of a
Llama attention block, y = residual + o_proj(attention(q, k, v)). q, k, v come in as the
QKV projection (after RoPE) leaves them, (batch, seq, heads, head_dim).

The reference is Hugging Face's sdpa path: transpose to (batch, heads, seq, head_dim)
(views), scaled_dot_product_attention with is_causal (FlashAttention-2, the first backend
PyTorch tries), transpose back and reshape to (batch, seq, hidden), o_proj (cuBLAS), then
the add (read two, write one). A fused solution writes attention's output straight in
the layout the projection reads and adds the residual in the GEMM's epilogue.

Sizes: Llama-2-7B (32 heads of 128, hidden 4096), 2 sequences of 4096 tokens. Attention
is 2 * 2 * 32 * 4096^2 * 128 = 275 GFLOP causal (~0.85 ms at ~330 TFLOP/s); o_proj
2 * 8192 * 4096^2 = 275 GFLOP (~0.36 ms); the add moves 200 MB (~0.07 ms).
Tiny size: 1 x 37 tokens x 2 heads of 32 (hidden 64).
"""

import torch
import torch.nn.functional as F
from torch import nn

BATCH, SEQ, HEADS, HEAD_DIM = 2, 4096, 32, 128

tags = ["level2", "bf16", "attention", "gemm", "fusion"]
compute_dtype = "bf16"
tiny_sizes = {"BATCH": 1, "SEQ": 37, "HEADS": 2, "HEAD_DIM": 32}
forbidden_ops = [
    "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_flash_attention_forward", "aten::_efficient_attention_forward",
    "aten::mm", "aten::matmul", "aten::addmm", "aten::bmm", "aten::linear",
]
# Attention outputs ~1e-2 apart (problems/level1/attention_bf16.py), summed over 4096
# inputs by o_proj with weights ~U(+-1/64): ~1e-2 on outputs of ~N(0, 1.1).
tolerance = {"atol": 2e-2, "rtol": 2e-2}


def flops(inputs):
    q = inputs[0]
    batch, seq, heads, dim = q.shape
    hidden = heads * dim
    return 2 * batch * heads * seq * seq * dim + 2 * batch * seq * hidden * hidden


class Model(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.o_proj = nn.Linear(hidden, hidden, bias=False, dtype=torch.bfloat16)

    def forward(self, q, k, v, residual):
        batch, seq, heads, dim = q.shape
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        out = out.transpose(1, 2).reshape(batch, seq, heads * dim)
        return residual + self.o_proj(out)


def get_inputs():
    # q and k twice N(0, 1): attention that picks a few keys per query, so the projection's
    # share of the output is ~N(0, 0.3) beside the residual's N(0, 1)
    q = (2 * torch.randn(BATCH, SEQ, HEADS, HEAD_DIM)).to(torch.bfloat16)
    k = (2 * torch.randn(BATCH, SEQ, HEADS, HEAD_DIM)).to(torch.bfloat16)
    v = torch.randn(BATCH, SEQ, HEADS, HEAD_DIM).to(torch.bfloat16)
    residual = torch.randn(BATCH, SEQ, HEADS * HEAD_DIM).to(torch.bfloat16)
    return [q, k, v, residual]


def get_init_inputs():
    return [HEADS * HEAD_DIM]

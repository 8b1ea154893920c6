"""Attention, o_proj and the residual add on two of kforge's Triton kernels: the FlashAttention
forward (`attention/flash_forward.py`) reads q, k, v through transposed views and writes
its output with q's strides, i.e. as (batch, seq, heads, head_dim): already the
(tokens, hidden) matrix o_proj reads, with no transpose copy. The persistent TMA GEMM of
`kernels/fused/gemm_epilogue.py` then adds the residual in its epilogue. The nn.Linear is
built as the reference's. On a CPU both kernels run under Triton's interpreter.
"""

import torch
from torch import nn

from kforge.kernels.attention.flash_forward import flash_attention_forward
from kforge.kernels.fused.gemm_epilogue import gemm_epilogue


class ModelNew(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.o_proj = nn.Linear(hidden, hidden, bias=False, dtype=torch.bfloat16)

    def forward(self, q, k, v, residual):
        batch, seq, heads, dim = q.shape
        out, _ = flash_attention_forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
        attn = out.transpose(1, 2).reshape(batch, seq, heads * dim)  # a view: out lies as (batch, seq, heads, dim)
        return gemm_epilogue(attn, self.o_proj.weight, residual=residual)

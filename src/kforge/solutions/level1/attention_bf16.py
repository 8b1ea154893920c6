"""Attention with kforge's FlashAttention forward (Triton: online softmax over key tiles, TMA
loads, wgmma; `kforge.kernels.attention.flash_forward`). GQA reads each key/value head once
per query group; CAUSAL comes from the problem's constant. The log-sum-exp it also returns
(4 bytes a query row) is dropped. On a CPU the same kernel runs under the Triton interpreter.
"""

from torch import nn

from kforge.kernels.attention.flash_forward import flash_attention_forward
from kforge.problems.level1 import attention_bf16 as problem


class ModelNew(nn.Module):
    def forward(self, q, k, v):
        return flash_attention_forward(q, k, v, causal=bool(problem.CAUSAL))[0]

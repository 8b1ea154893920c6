"""The small GPT on kforge's kernels (problem: the file of the same name in problems/level3).

Per block, six launches, every elementwise step inside a norm or a GEMM's epilogue:

    n    = layer_norm(x)                            norms.py
    qkv  = n W_attn^T + b                           fused/gemm_epilogue.py: bias in the epilogue
    y    = causal flash attention                   flash_forward.py on strided (B, H, T, d) views of
                                                    qkv; its output comes out (B, T, H, d): no copy
    x    = x + y W_proj^T + b                       gemm_epilogue: bias and residual
    f    = gelu_tanh(layer_norm(x) W_fc^T + b)      norms.py, gemm_epilogue: bias and tanh-GELU
    x    = x + f W_mlp^T + b                        gemm_epilogue: bias and residual

then the embedding lookup and position add (PyTorch, as eager), layer_norm, and the tied
LM head on kforge.ops.matmul (the CUDA rungs; 0.63 of the 1.15 TFLOP, at cuBLAS's rate).
Eager's tanh-GELU alone is one pass over (8192, 3072) per block; its residual adds, the
contiguous() copy of SDPA's output and the separate LayerNorm passes add ~0.3 GB a block.
On the CPU the Triton kernels run under the interpreter; kforge.ops.matmul falls back to
torch.matmul there (its kernels are CUDA C++), and so does it on the GPU for a vocabulary
that is not a multiple of 8 (TMA's 16-byte rows).
"""

import torch
import torch.nn.functional as F
from torch import nn

from kforge.kernels.attention.flash_forward import flash_attention_forward
from kforge.kernels.fused.gemm_epilogue import gemm_epilogue
from kforge.kernels.serving.norms import layer_norm_forward
from kforge.ops import matmul


def _linear(in_features: int, out_features: int, std: float) -> nn.Linear:
    layer = nn.Linear(in_features, out_features, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.normal_(std=std)
        layer.bias.copy_(0.02 * torch.randn(out_features))
    return layer


def _layer_norm(hidden: int) -> nn.LayerNorm:
    norm = nn.LayerNorm(hidden, dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(hidden))
        norm.bias.copy_(0.1 * torch.randn(hidden))
    return norm


def _norm(x: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
    return layer_norm_forward(x, norm.weight, norm.bias, norm.eps)


class Block(nn.Module):
    """The reference's block parameters (same order, same draws); forward on our kernels."""

    def __init__(self, hidden: int, heads: int, layers: int):
        super().__init__()
        self.heads = heads
        self.ln_1 = _layer_norm(hidden)
        self.c_attn = _linear(hidden, 3 * hidden, 0.02)
        self.c_proj = _linear(hidden, hidden, 0.02 / (2 * layers) ** 0.5)
        self.ln_2 = _layer_norm(hidden)
        self.c_fc = _linear(hidden, 4 * hidden, 0.02)
        self.mlp_proj = _linear(4 * hidden, hidden, 0.02 / (2 * layers) ** 0.5)

    def forward(self, x: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
        """x: the residual stream as (batch * seq, hidden) rows."""
        hidden = x.shape[1]
        qkv = gemm_epilogue(_norm(x, self.ln_1), self.c_attn.weight, bias=self.c_attn.bias)
        q, k, v = qkv.view(batch, seq, 3, self.heads, hidden // self.heads).unbind(2)
        y, _ = flash_attention_forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
        x = gemm_epilogue(y.transpose(1, 2).reshape(batch * seq, hidden), self.c_proj.weight, bias=self.c_proj.bias,
                          residual=x)
        f = gemm_epilogue(_norm(x, self.ln_2), self.c_fc.weight, bias=self.c_fc.bias, activation="gelu_tanh")
        return gemm_epilogue(f, self.mlp_proj.weight, bias=self.mlp_proj.bias, residual=x)


class ModelNew(nn.Module):
    def __init__(self, vocab: int, max_seq: int, layers: int, hidden: int, heads: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden, dtype=torch.bfloat16)
        self.wpe = nn.Embedding(max_seq, hidden, dtype=torch.bfloat16)
        with torch.no_grad():
            self.wte.weight.normal_(std=0.02)
            self.wpe.weight.normal_(std=0.02)
        self.blocks = nn.ModuleList(Block(hidden, heads, layers) for _ in range(layers))
        self.ln_f = _layer_norm(hidden)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        batch, seq = idx.shape
        x = (F.embedding(idx, self.wte.weight) + self.wpe.weight[:seq]).view(batch * seq, -1)
        for block in self.blocks:
            x = block(x, batch, seq)
        return matmul(_norm(x, self.ln_f), self.wte.weight.t()).view(batch, seq, -1)

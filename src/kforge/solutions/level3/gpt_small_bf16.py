"""The small GPT on kforge's kernels (problem: the file of the same name in problems/level3).

Per block, six launches; every elementwise step rides inside a norm or a GEMM's epilogue,
and each residual add inside the LayerNorm that follows it:

    n, x = layer_norm(x + pending), x + pending       norms.py, its residual add fused (the first
                                                       block: layer_norm(x) alone)
    qkv  = n W_attn^T + b                             fused/linear.py: the bias in the epilogue
    y    = causal flash attention                     flash_forward.py on strided (B, H, T, d) views of
                                                      qkv; its output comes out (B, T, H, d): no copy
    p    = y W_proj^T + b                             fused/linear.py
    n, x = layer_norm(x + p), x + p                   norms.py, the residual add fused
    f    = gelu_tanh(n W_fc^T + b)                    fused/linear.py: bias and tanh-GELU in the epilogue
    pending = f W_mlp^T + b                           fused/linear.py; added by the next norm

then the final layer_norm (adding the last block's pending output) and the tied LM head
(0.63 of the 1.15 TFLOP) on the bf16 GEMM ladder. fused_linear picks the CUDA rung per
shape (kforge.ops.matmul.best_kernel, from H100 device time against cuBLAS):
rung 4, its epilogue stored under the next tile's k-loop, for the short-K projections (K = 768:
1.03x cuBLAS at c_attn's shape), rung 5 for the LM head (1.06x), rung 4 with the tanh-GELU in
its epilogue for c_fc (1.22x eager's linear + GELU, scripts/fused_linear_bench.py). A residual add in a GEMM's epilogue measured
slower than the add the next norm makes anyway (0.73-0.83x eager at these K), hence
`pending`. Eager's tanh-GELU alone is one pass over (8192, 3072) per block; its residual
adds, the contiguous() copy of SDPA's output and the separate LayerNorm passes add ~0.3 GB
a block. On the CPU the Triton kernels run under the interpreter (fused_linear takes the
Triton epilogue GEMM there) and the LM head is torch.matmul, as it is on the GPU wherever
kforge.ops.matmul would fall back (a vocabulary that is not a multiple of 8: TMA's 16-byte
rows).

Everything up to and including the final layer_norm replays as one CUDA graph
(runtime/graphs.py): issued from Python, its ~30 launches took 4.33 ms of host time for
~2.3 ms of device time (H100, scripts/host_profile.py; the reference's host 1.35 ms), and the harness
counts the longer. The graph hands back its own output buffer (8192 x 768, no clone), which
the LM head reads at once, on the same stream, to write the 824 MB of logits into a fresh
tensor: cloning them out of a graph would cost another 1.6 GB of traffic a call. The head
calls the ladder's gemm directly, with kforge.ops.matmul's own checks and rung choice: the
custom op's dispatch would add ~100 us of host time a call. The graph is keyed on the
parameters' addresses: the harness moves the model with .to(device) after building it.
"""

import torch
import torch.nn.functional as F
from torch import nn

from kforge.device import sm_count
from kforge.kernels.attention.flash_forward import flash_attention_forward
from kforge.kernels.fused.linear import fused_linear
from kforge.kernels.gemm_bf16 import gemm
from kforge.kernels.serving.norms import layer_norm_forward
from kforge.ops.matmul import best_kernel, ours_can_run
from kforge.runtime.graphs import GraphedCall, parameter_addresses


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


def _norm(x: torch.Tensor, norm: nn.LayerNorm, pending: torch.Tensor | None = None):
    """(layer_norm(x + pending), x + pending), the add fused into the norm; without `pending`,
    (layer_norm(x), x)."""
    if pending is None:
        return layer_norm_forward(x, norm.weight, norm.bias, norm.eps), x
    return layer_norm_forward(pending, norm.weight, norm.bias, norm.eps, residual=x)


def _tied_lm_head(x: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
    """x embedding^T, as kforge.ops.matmul(x, embedding.t()) computes it, less the custom op's dispatch."""
    if not (embedding.is_contiguous() and ours_can_run(x, embedding.t())):
        return torch.matmul(x, embedding.t())
    step, defines = best_kernel(x.shape[0], embedding.shape[0], x.shape[1], sm_count(x.device))
    return gemm(x, embedding, step, b_layout="nk", defines=defines)


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

    def forward(self, x: torch.Tensor, pending: torch.Tensor | None, batch: int, seq: int):
        """x: the residual stream as (batch * seq, hidden) rows; pending: the previous block's MLP
        output, not yet added to x (None before the first block). Returns the same pair."""
        hidden = x.shape[1]
        n, x = _norm(x, self.ln_1, pending)
        qkv = fused_linear(n, self.c_attn.weight, bias=self.c_attn.bias)
        q, k, v = qkv.view(batch, seq, 3, self.heads, hidden // self.heads).unbind(2)
        y, _ = flash_attention_forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
        projected = fused_linear(y.transpose(1, 2).reshape(batch * seq, hidden), self.c_proj.weight,
                                 bias=self.c_proj.bias)
        n, x = _norm(x, self.ln_2, projected)
        f = fused_linear(n, self.c_fc.weight, bias=self.c_fc.bias, activation="gelu_tanh")
        return x, fused_linear(f, self.mlp_proj.weight, bias=self.mlp_proj.bias)


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
        # fresh_output=False: the LM head consumes the graph's output before the next call can overwrite it
        self._graphed_trunk = GraphedCall(self._trunk, extra_key=parameter_addresses(self), fresh_output=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        batch, seq = idx.shape
        return _tied_lm_head(self._graphed_trunk(idx), self.wte.weight).view(batch, seq, -1)

    def _trunk(self, idx: torch.Tensor) -> torch.Tensor:
        """Embeddings, the blocks and the final layer_norm: (batch * seq, hidden) rows."""
        batch, seq = idx.shape
        x = (F.embedding(idx, self.wte.weight) + self.wpe.weight[:seq]).view(batch * seq, -1)
        pending = None
        for block in self.blocks:
            x, pending = block(x, pending, batch, seq)
        return _norm(x, self.ln_f, pending)[0]

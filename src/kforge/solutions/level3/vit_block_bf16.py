"""The ViT-L/16 encoder block on kforge's kernels (problem: the file of the same name in
problems/level3). Seven launches, every elementwise step inside a GEMM's epilogue or a norm:

    n1    = layer_norm(x)                         norms.py
    qkv   = n1 W_in^T + b_in                      fused/linear.py: the bias in the epilogue
    attn  = flash attention, non-causal           flash_forward.py on strided (B, H, N, d) views of
                                                  qkv: no transposes, and the output comes out (B, N, H, d)
    o     = attn W_out^T + b_out                  fused/linear.py
    n2, h = layer_norm(x + o), x + o              norms.py, the residual add fused into the norm
    f     = gelu(n2 W1^T + b1)                    fused/linear.py: bias and GELU in the epilogue
    out   = h + f W2^T + b2                       fused/linear.py: bias and residual in the epilogue

fused_linear takes the CUDA GEMM rungs on an H100, the rung per shape from the measured
tables: rung 4 for the K = 1024 projections (1.07-1.08x cuBLAS without the bias,
scripts/gemm_bf16_variants.py), rung 4 with GELU in its epilogue for fc1 (1.13x eager's
linear + GELU, scripts/fused_linear_bench.py) and with the residual for fc2 (K = 4096 hides its reads: 1.00x eager). The
out-projection's residual goes to the norm instead: at K = 1024 an epilogue add measured
0.95x eager, and the norm reads and writes the rows anyway. Against eager
(nn.MultiheadAttention's seq-first transposes and copies, a GELU pass over (12608, 4096),
two residual adds) the saving is ~0.2 GB of activation traffic around 0.33 TFLOP of
short-K GEMMs. On the CPU the Triton kernels run under the interpreter (fused_linear takes
the Triton epilogue GEMM there).

The whole forward replays as one CUDA graph (runtime/graphs.py). Issued from Python, the
seven launches took longer than the GPU took to run them (H100, 2026-11-22: host 1.25 ms,
device 0.73 ms; the reference's host 0.81, device 0.97), and the harness counts the longer.
A replay issues them at once; per call it adds a copy of x into the graph's input and a
clone of its output (26 MB read and written each: ~35 us of device time in all). The graph
is keyed on the parameters' addresses: the harness moves the model with .to(device) after
building it.
"""

import torch
from torch import nn

from kforge.kernels.attention.flash_forward import flash_attention_forward
from kforge.kernels.fused.linear import fused_linear
from kforge.kernels.serving.norms import layer_norm_forward
from kforge.runtime.graphs import GraphedCall, parameter_addresses


def init_like_trained(module: nn.Module) -> None:
    """The reference's initialization, parameter by parameter in registration order."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 2:
                p.normal_(std=p.shape[1] ** -0.5)
            elif name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape))
            else:
                p.copy_(0.1 * torch.randn(p.shape))


class ModelNew(nn.Module):
    def __init__(self, hidden: int, heads: int, mlp: int, eps: float):
        super().__init__()
        self.heads, self.eps = heads, eps
        # the reference's modules, so its parameters come out the same under the same seed
        self.norm1 = nn.LayerNorm(hidden, eps=eps, dtype=torch.bfloat16)
        self.attn = nn.MultiheadAttention(hidden, heads, batch_first=True, dtype=torch.bfloat16)
        self.norm2 = nn.LayerNorm(hidden, eps=eps, dtype=torch.bfloat16)
        self.fc1 = nn.Linear(hidden, mlp, dtype=torch.bfloat16)
        self.fc2 = nn.Linear(mlp, hidden, dtype=torch.bfloat16)
        init_like_trained(self)
        self._graphed_block = GraphedCall(self._block, extra_key=parameter_addresses(self))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._graphed_block(x)

    def _block(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, hidden = x.shape
        rows = x.reshape(batch * tokens, hidden)
        qkv = fused_linear(layer_norm_forward(rows, self.norm1.weight, self.norm1.bias, self.eps),
                           self.attn.in_proj_weight, bias=self.attn.in_proj_bias)
        q, k, v = qkv.view(batch, tokens, 3, self.heads, hidden // self.heads).unbind(2)
        attn, _ = flash_attention_forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        o = fused_linear(attn.transpose(1, 2).reshape(batch * tokens, hidden), self.attn.out_proj.weight,
                         bias=self.attn.out_proj.bias)
        n2, h = layer_norm_forward(o, self.norm2.weight, self.norm2.bias, self.eps, residual=rows)
        f = fused_linear(n2, self.fc1.weight, bias=self.fc1.bias, activation="gelu")
        return fused_linear(f, self.fc2.weight, bias=self.fc2.bias, residual=h).view(batch, tokens, hidden)

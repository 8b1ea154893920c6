"""The ViT-L/16 encoder block on kforge's kernels (problem: the file of the same name in
problems/level3). Seven launches, every elementwise step inside a GEMM's epilogue or a norm:

    n1   = layer_norm(x)                          norms.py
    qkv  = n1 W_in^T + b_in                       fused/gemm_epilogue.py: bias in the epilogue
    attn = flash attention, non-causal            flash_forward.py on strided (B, H, N, d) views of
                                                  qkv: no transposes, and the output comes out (B, N, H, d)
    h    = x + attn W_out^T + b_out               gemm_epilogue: bias and residual in the epilogue
    f    = gelu(layer_norm(h) W1^T + b1)          norms.py, gemm_epilogue: bias and GELU in the epilogue
    out  = h + f W2^T + b2                        gemm_epilogue: bias and residual

Against eager (nn.MultiheadAttention's seq-first transposes and copies, a GELU pass over
(12608, 4096), two residual adds) the saving is ~0.2 GB of activation traffic around
0.33 TFLOP of short-K GEMMs. On the CPU the Triton kernels run under the interpreter.
"""

import torch
from torch import nn

from kforge.kernels.attention.flash_forward import flash_attention_forward
from kforge.kernels.fused.gemm_epilogue import gemm_epilogue
from kforge.kernels.serving.norms import layer_norm_forward


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, hidden = x.shape
        rows = x.reshape(batch * tokens, hidden)
        qkv = gemm_epilogue(layer_norm_forward(rows, self.norm1.weight, self.norm1.bias, self.eps),
                            self.attn.in_proj_weight, bias=self.attn.in_proj_bias)
        q, k, v = qkv.view(batch, tokens, 3, self.heads, hidden // self.heads).unbind(2)
        attn, _ = flash_attention_forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        h = gemm_epilogue(attn.transpose(1, 2).reshape(batch * tokens, hidden), self.attn.out_proj.weight,
                          bias=self.attn.out_proj.bias, residual=rows)
        f = gemm_epilogue(layer_norm_forward(h, self.norm2.weight, self.norm2.bias, self.eps), self.fc1.weight,
                          bias=self.fc1.bias, activation="gelu")
        return gemm_epilogue(f, self.fc2.weight, bias=self.fc2.bias, residual=h).view(batch, tokens, hidden)

"""The Llama-3-8B decoder layer at prefill on kforge's kernels (problem: the file of the same
name in problems/level3). Ten launches where eager runs ~40:

    n1      = rms_norm(x)                       norms.py: one pass (eager: ~7 kernels through fp32)
    qkv     = n1 [Wq; Wk; Wv]^T                 kforge.ops.matmul: one GEMM, N = 6144 (eager: three)
    q, k    = rope_ in place on qkv's columns   rope.py: one launch for both, fp32 table
    attn    = flash attention, causal, GQA      flash_forward.py on strided views of qkv: no copies,
                                                and the output comes out laid out (B, S, H, d)
    o       = attn Wo^T                         kforge.ops.matmul
    n2, h   = rms_norm(x + o), x + o            norms.py: the residual add fused into the norm
    a       = swiglu(n2 [Wgate; Wup]^T)         kforge.ops.matmul (N = 28672), swiglu.py
    out     = h + a Wdown^T                     kforge.ops.matmul, then one add

The GEMMs are the CUDA rungs (0.99x cuBLAS at 4096^3, parity at large shapes: README), so
the win is what eager moves around them (~2.4 GB against these kernels' ~0.7 GB: ~0.55 ms
of eager's ~3.2 ms, the problem's docstring) and flash attention (~1.35x SDPA's flash at
head dim 128, causal). On the CPU the Triton kernels run under the interpreter;
kforge.ops.matmul falls back to torch.matmul there (its kernels are CUDA C++).
"""

import torch
from torch import nn

from kforge.kernels.attention.flash_forward import flash_attention_forward
from kforge.kernels.serving.norms import rms_norm_forward
from kforge.kernels.serving.rope import apply_rope_, cos_sin_table
from kforge.kernels.serving.swiglu import swiglu_forward
from kforge.ops import matmul


def _linear(in_features: int, out_features: int) -> nn.Linear:
    layer = nn.Linear(in_features, out_features, bias=False, dtype=torch.bfloat16)
    nn.init.normal_(layer.weight, std=in_features**-0.5)
    return layer


def _norm_weight(hidden: int) -> nn.Parameter:
    return nn.Parameter((1 + 0.1 * torch.randn(hidden)).to(torch.bfloat16))


class ModelNew(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, mlp: int, rope_theta: float, eps: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.rope_theta, self.eps = rope_theta, eps
        # the reference's weights, drawn in its order under the same seed, then fused
        self.input_norm = _norm_weight(hidden)
        q_width, kv_width = heads * self.head_dim, kv_heads * self.head_dim
        q, k, v = _linear(hidden, q_width), _linear(hidden, kv_width), _linear(hidden, kv_width)
        o = _linear(q_width, hidden)
        self.post_norm = _norm_weight(hidden)
        gate, up, down = _linear(hidden, mlp), _linear(hidden, mlp), _linear(mlp, hidden)
        self.register_buffer("w_qkv", torch.cat((q.weight, k.weight, v.weight)).detach())
        self.register_buffer("w_o", o.weight.detach())
        self.register_buffer("w_gate_up", torch.cat((gate.weight, up.weight)).detach())
        self.register_buffer("w_down", down.weight.detach())
        self._positions: dict[tuple, torch.Tensor] = {}

    def positions(self, batch: int, seq: int, device: torch.device) -> torch.Tensor:
        key = (batch, seq, device)
        if key not in self._positions:
            self._positions[key] = torch.arange(seq, dtype=torch.int32, device=device).expand(batch, seq).contiguous()
        return self._positions[key]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        rows = x.reshape(batch * seq, hidden)
        qkv = matmul(rms_norm_forward(rows, self.input_norm, self.eps), self.w_qkv.t()).view(batch, seq, -1)
        q_width, kv_width = self.heads * self.head_dim, self.kv_heads * self.head_dim
        q = qkv[..., :q_width].view(batch, seq, self.heads, self.head_dim)
        k = qkv[..., q_width:q_width + kv_width].view(batch, seq, self.kv_heads, self.head_dim)
        v = qkv[..., q_width + kv_width:].view(batch, seq, self.kv_heads, self.head_dim)
        apply_rope_(q, k, self.positions(batch, seq, x.device),
                    cos_sin_table(seq, self.head_dim, self.rope_theta, x.device))
        attn, _ = flash_attention_forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
        o = matmul(attn.transpose(1, 2).reshape(batch * seq, q_width), self.w_o.t())
        n2, h = rms_norm_forward(o, self.post_norm, self.eps, residual=rows)
        a = swiglu_forward(matmul(n2, self.w_gate_up.t()))
        return (h + matmul(a, self.w_down.t())).view(batch, seq, hidden)

"""The first half of a Llama MLP, bf16: silu(x W_gate^T) * (x W_up^T), as Hugging Face's
LlamaMLP computes it before the down projection.

The reference is eager: two GEMMs (gate_proj, up_proj: cuBLAS), each writing a
(TOKENS, INTERMEDIATE) activation, then F.silu (read, write) and the product (read two,
write one): 7 activation-sized passes of HBM traffic after the GEMMs. A fused kernel runs
both GEMMs over the same x tile (two accumulators) and applies silu(gate) * up to them
before its only store.

Sizes: Llama-3.2-1B (hidden 2048, intermediate 8192), 8192 tokens. The GEMMs are
2 x 2 * 8192 * 2048 * 8192 = 550 GFLOP (~0.71 ms at ~770 TFLOP/s); eager's elementwise
traffic 7 x 134 MB = 0.94 GB (~0.31 ms). Tiny size: 37 tokens, 72 -> 40.
"""

import torch
import torch.nn.functional as F
from torch import nn

TOKENS, HIDDEN, INTERMEDIATE = 8192, 2048, 8192

tags = ["level2", "bf16", "gemm", "swiglu", "fusion"]
compute_dtype = "bf16"
tiny_sizes = {"TOKENS": 37, "HIDDEN": 72, "INTERMEDIATE": 40}
forbidden_ops = ["aten::mm", "aten::matmul", "aten::addmm", "aten::bmm", "aten::linear"]
# Eager rounds gate, up, silu(gate) and the product to bf16; fused rounds once.
tolerance = {"atol": 2e-2, "rtol": 2e-2}


def flops(inputs):
    (x,) = inputs
    return 2 * 2 * x.shape[0] * x.shape[1] * INTERMEDIATE


class Model(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False, dtype=torch.bfloat16)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self.gate_proj(x)) * self.up_proj(x)


def get_inputs():
    return [torch.randn(TOKENS, HIDDEN).to(torch.bfloat16)]


def get_init_inputs():
    return [HIDDEN, INTERMEDIATE]

"""The first half of a Gemma MLP, bf16: gelu_tanh(x W_gate^T) * (x W_up^T) (GeGLU with the
tanh GELU, Gemma's `gelu_pytorch_tanh`), as Hugging Face's GemmaMLP computes it.

The reference is eager: two GEMMs (gate_proj, up_proj) each writing a (TOKENS,
INTERMEDIATE) activation, F.gelu(approximate="tanh") (read, write) and the product (read
two, write one). A fused kernel runs both GEMMs over the same x tile and applies the
gate to the two accumulators before its only store.

Sizes: Gemma-2-2B (hidden 2304, intermediate 9216), 8192 tokens. The GEMMs are
2 x 2 * 8192 * 2304 * 9216 = 696 GFLOP (~0.9 ms at ~770 TFLOP/s); eager's elementwise
traffic 7 x 151 MB = 1.06 GB (~0.35 ms). Tiny size: 37 tokens, 72 -> 40.
"""

import torch
import torch.nn.functional as F
from torch import nn

TOKENS, HIDDEN, INTERMEDIATE = 8192, 2304, 9216

tags = ["level2", "bf16", "gemm", "geglu", "fusion"]
compute_dtype = "bf16"
tiny_sizes = {"TOKENS": 37, "HIDDEN": 72, "INTERMEDIATE": 40}
forbidden_ops = ["aten::mm", "aten::matmul", "aten::addmm", "aten::bmm", "aten::linear"]
# Eager rounds gate, up, gelu(gate) and the product to bf16; fused rounds once.
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
        return F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x)


def get_inputs():
    return [torch.randn(TOKENS, HIDDEN).to(torch.bfloat16)]


def get_init_inputs():
    return [HIDDEN, INTERMEDIATE]

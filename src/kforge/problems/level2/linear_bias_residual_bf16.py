"""A linear layer with bias added to the residual stream, bf16: y = residual + x W^T + b, the
attention output projection of a ViT block (ViT-L/16: width 1024) and its skip connection.

The reference is eager: nn.Linear (cuBLAS with the bias in its epilogue) writes x W^T + b,
then the add reads it and the residual and writes y. A fused kernel adds the residual
tile to the accumulator before its only store: the projection never travels to HBM.

Sizes: 256 images x 197 tokens = 50432 tokens, 1024 -> 1024. The GEMM is
2 * 50432 * 1024 * 1024 = 106 GFLOP (~0.14-0.17 ms); the add moves 3 x 103 MB (~0.1 ms).
Minimum traffic: x, the residual, W, b read once and y written once.
Tiny size: 1 image x 37 tokens, width 72.
"""

import torch
from torch import nn

BATCH, SEQ, HIDDEN = 256, 197, 1024

tags = ["level2", "bf16", "gemm", "residual", "fusion"]
compute_dtype = "bf16"
tiny_sizes = {"BATCH": 1, "SEQ": 37, "HIDDEN": 72}
forbidden_ops = ["aten::mm", "aten::matmul", "aten::addmm", "aten::bmm", "aten::linear"]
# Eager rounds the projection to bf16 before the add; fused rounds once: outputs ~N(0, 1),
# about one bf16 step apart.
tolerance = {"atol": 2e-2, "rtol": 2e-2}


def flops(inputs):
    x, _ = inputs
    return 2 * x.numel() * HIDDEN


class Model(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.proj = nn.Linear(hidden, hidden, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return residual + self.proj(x)


def get_inputs():
    return [torch.randn(BATCH, SEQ, HIDDEN).to(torch.bfloat16), torch.randn(BATCH, SEQ, HIDDEN).to(torch.bfloat16)]


def get_init_inputs():
    return [HIDDEN]

"""kforge's persistent Triton GEMM, then one fused bias + gelu_tanh pass: the eight-kernel chain becomes one.

h = x W^T goes to HBM once and comes back once (2 x 268 MB) instead of the ~19 passes of the
eager chain. The GEMM runs without its bias; `bias_act` adds it in fp32 before the activation.
"""

import torch
from torch import nn

from kforge.kernels.fused.bias_act import bias_act
from kforge.kernels.gemm_bf16.triton_matmul import matmul


class ModelNew(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.c_fc = nn.Linear(in_features, out_features, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = matmul(x.contiguous(), self.c_fc.weight, b_layout="nk")
        return bias_act(h, self.c_fc.bias, activation="gelu_tanh")

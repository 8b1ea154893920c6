"""Our own GEMM (the problem forbids cuBLAS's), then one bias + gelu_tanh kernel: h crosses HBM twice, not ~19 times.

kforge's persistent Triton GEMM writes h = x W^T (268 MB) and `bias_act` reads it back once,
adding the bias in fp32 before the activation, where the eager chain makes ~19 passes of it.
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

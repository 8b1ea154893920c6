"""The bias and gelu_tanh move into the GEMM's epilogue, on the fp32 accumulator: h never reaches HBM.

`gemm_epilogue` is a persistent TMA GEMM whose epilogue adds the bias and applies gelu_tanh as
v * sigmoid(2u) (one exp, one division, no tanh) before its only store: y is written once.
"""

import torch
from torch import nn

from kforge.kernels.fused.gemm_epilogue import gemm_epilogue


class ModelNew(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.c_fc = nn.Linear(in_features, out_features, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemm_epilogue(x, self.c_fc.weight, bias=self.c_fc.bias, activation="gelu_tanh")

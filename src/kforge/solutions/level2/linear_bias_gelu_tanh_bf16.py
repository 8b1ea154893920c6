"""GPT-2's MLP up-projection: one persistent TMA GEMM (`kernels/fused/gemm_epilogue.py`) whose
epilogue adds the bias and applies gelu_tanh (as v * sigmoid(2u)) to the fp32 accumulator
before its only store. The nn.Linear is built as the reference's, so under the same seed
both hold the same weights. On a CPU the kernel runs under Triton's interpreter.
"""

import torch
from torch import nn

from kforge.kernels.fused.gemm_epilogue import gemm_epilogue


class ModelNew(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.c_fc = nn.Linear(in_features, out_features, dtype=torch.bfloat16)

    def forward(self, x):
        return gemm_epilogue(x, self.c_fc.weight, bias=self.c_fc.bias, activation="gelu_tanh")

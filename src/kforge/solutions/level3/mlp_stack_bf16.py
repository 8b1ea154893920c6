"""The GELU MLP stack on kforge's fused-epilogue GEMM (problem: the file of the same name in
problems/level3): each Linear is one `fused/gemm_epilogue.py` launch with its bias, and
GELU for all but the last, applied to the fp32 accumulator before the only store. Eager
writes every hidden activation, reads it back for GELU and writes it again (3 x 268 MB at
16384 x 4096); here each is written once. The GEMMs are the persistent TMA Triton schedule
(~0.96x cuBLAS at 4096^3), so the stack wins if the saved passes (~15% of eager's time at
these widths) outweigh the GEMMs' few percent. On the CPU the kernel runs under the
Triton interpreter.
"""

import torch
from torch import nn

from kforge.kernels.fused.gemm_epilogue import gemm_epilogue


class ModelNew(nn.Module):
    def __init__(self, in_features: int, hidden: int, out_features: int, layers: int):
        super().__init__()
        widths = [in_features] + [hidden] * (layers - 1) + [out_features]
        # the reference's layers, drawn in its order under the same seed
        self.layers = nn.ModuleList()
        for i in range(layers):
            linear = nn.Linear(widths[i], widths[i + 1], dtype=torch.bfloat16)
            with torch.no_grad():
                linear.weight.normal_(std=(2 / widths[i]) ** 0.5)
                linear.bias.copy_(0.1 * torch.randn(widths[i + 1]))
            self.layers.append(linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        last = len(self.layers) - 1
        for i, linear in enumerate(self.layers):
            x = gemm_epilogue(x, linear.weight, bias=linear.bias, activation="gelu" if i < last else "none")
        return x

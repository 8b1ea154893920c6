"""The GELU MLP stack on kforge's fused-epilogue GEMMs (problem: the file of the same name in
problems/level3): each Linear is one `fused/linear.py` launch with its bias, and GELU for all
but the last, applied to the fp32 accumulator before the only store. Eager writes every
hidden activation, reads it back for GELU and writes it again (3 x 268 MB at 16384 x 4096);
here each is written once. On an H100 fused_linear runs the CUDA rung 4 (the 128 x 256
persistent GEMM, ~1.00x cuBLAS at these shapes) with the epilogue compiled in, GELU's erf
evaluated branch-free (two MUFU ops a value). Measured per layer (H100, device time,
`scripts/fused_linear_bench.py`):
1.12x eager at K = 1024, 1.03x at K = 4096 (the epilogue's ~60 us a layer against eager's
~90 us GELU pass), 0.97x for the last, bias-only layer: ~1.03x for the stack. On the CPU
fused_linear takes the Triton epilogue GEMM under the interpreter.
"""

import torch
from torch import nn

from kforge.kernels.fused.linear import fused_linear


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
            x = fused_linear(x, linear.weight, bias=linear.bias, activation="gelu" if i < last else "none")
        return x

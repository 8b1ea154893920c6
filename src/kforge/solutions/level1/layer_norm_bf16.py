"""LayerNorm with the residual add fused in, on kforge's Triton norm kernel
(`kforge.kernels.serving.norms`): one pass reads x and the residual and writes h = x + residual
and the normalized output, where eager PyTorch runs the add and the norm as two passes.
The residual is used when the problem passes one (four inputs instead of three); eps is the
problem's. On a CPU the kernel runs under the Triton interpreter.
"""

from torch import nn

from kforge.kernels.serving.norms import layer_norm_forward
from kforge.problems.level1 import layer_norm_bf16 as problem


class ModelNew(nn.Module):
    def forward(self, x, *rest):
        if len(rest) == 3:
            residual, weight, bias = rest
            return layer_norm_forward(x, weight, bias, problem.EPS, residual)
        weight, bias = rest
        return layer_norm_forward(x, weight, bias, problem.EPS)

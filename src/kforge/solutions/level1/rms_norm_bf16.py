"""RMSNorm with the residual add fused in, on kforge's Triton norm kernel
(`kforge.kernels.serving.norms`): one read of x and the residual, one write of h and of the
output, where eager PyTorch's Hugging Face-style RMSNorm runs half a dozen kernels. The
residual is used when the problem passes one; eps is the problem's. On a CPU the kernel
runs under the Triton interpreter.
"""

from torch import nn

from kforge.kernels.serving.norms import rms_norm_forward
from kforge.problems.level1 import rms_norm_bf16 as problem


class ModelNew(nn.Module):
    def forward(self, x, *rest):
        if len(rest) == 2:
            residual, weight = rest
            return rms_norm_forward(x, weight, problem.EPS, residual)
        (weight,) = rest
        return rms_norm_forward(x, weight, problem.EPS)

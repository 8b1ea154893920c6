"""SwiGLU on kforge's Triton kernel (`kforge.kernels.serving.swiglu`): gate and up read once,
the product written once, 3/5 of eager's traffic in one launch. On a CPU it runs under the
Triton interpreter.
"""

from torch import nn

from kforge.kernels.serving.swiglu import swiglu_forward


class ModelNew(nn.Module):
    def forward(self, x):
        return swiglu_forward(x)

"""The batched NVFP4 GEMV on kforge's Triton kernel (`kforge.kernels.quant.nvfp4_gemv`): E2M1
codes and E4M3 block scales decoded in registers as they stream in, 4.5 bits a value read
once; the reference dequantizes both operands to fp32 in memory, then multiplies. On a CPU
it runs under the Triton interpreter.
"""

from torch import nn

from kforge.kernels.quant.nvfp4_gemv import nvfp4_batched_gemv


class ModelNew(nn.Module):
    def forward(self, a, a_scales, a_gs, b, b_scales, b_gs):
        return nvfp4_batched_gemv(a, a_scales, a_gs, b, b_scales, b_gs)

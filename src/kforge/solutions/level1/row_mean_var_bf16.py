"""Row mean and unbiased variance in one read of the bf16 input, on kforge's Triton kernel
(`kforge.kernels.reductions.row_reduce`: exact deviations from the mean in registers,
merged across chunks with Chan's update for long rows). On a CPU it runs under the Triton
interpreter.
"""

from torch import nn

from kforge.kernels.reductions.row_reduce import row_mean_var


class ModelNew(nn.Module):
    def forward(self, x):
        return row_mean_var(x, correction=1)

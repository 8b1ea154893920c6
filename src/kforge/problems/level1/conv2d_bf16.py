"""2-D convolution in bf16, channels-last: ResNet-50's 3 x 3 convolution of stage 2 (128 -> 128
channels at 28 x 28, stride 1, padding 1, no bias: a batch norm follows it), for a batch
of BATCH images. The reference is nn.Conv2d on channels_last tensors, which is cuDNN's
fastest layout for tensor cores (NHWC), so it runs its best kernels.

Why channels-last (torch.channels_last memory, shapes still N, C, H, W): an implicit GEMM
reduces over (r, s, c), and with c innermost in memory every (r, s) step reads whole
128-byte lines of channels; in NCHW the same step reads one element per channel plane.

Compute-bound: 2 x BATCH x 28 x 28 x 128 x 128 x 9 FLOPs = 59 GFLOP at BATCH = 256
(about 0.1 ms at ~600 TFLOP/s) over 104 MB. The weight (and the module) is built in
Model.__init__ from get_init_inputs(), so a candidate building the same nn.Conv2d under
the same seed gets the same weight.

Tiny size: 1 image of 16 channels at 9 x 7, 24 output channels.
"""

import torch
from torch import nn

BATCH, C_IN, C_OUT, HEIGHT, WIDTH = 256, 128, 128, 28, 28
KERNEL, STRIDE, PADDING = 3, 1, 1

tags = ["conv", "level1", "bf16"]
compute_dtype = "bf16"
tiny_sizes = {"BATCH": 1, "C_IN": 16, "C_OUT": 24, "HEIGHT": 9, "WIDTH": 7}
forbidden_ops = ["aten::convolution", "aten::_convolution", "aten::cudnn_convolution", "aten::conv2d",
                 "aten::mkldnn_convolution", "aten::convolution_overrideable", "aten::_nnpack_spatial_convolution"]
# Outputs are sums of 1152 products with weights of 1/sqrt(1152) at most (nn.Conv2d's
# default init): ~N(0, 0.6^2). fp32 sums in two orders agree to ~1e-6, then one bf16 rounding.
tolerance = {"atol": 2e-2, "rtol": 2e-2}


def flops(inputs):
    (x,) = inputs
    out_h = (x.shape[2] + 2 * PADDING - KERNEL) // STRIDE + 1
    out_w = (x.shape[3] + 2 * PADDING - KERNEL) // STRIDE + 1
    return 2 * x.shape[0] * out_h * out_w * C_OUT * x.shape[1] * KERNEL * KERNEL


class Model(nn.Module):
    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, KERNEL, stride=STRIDE, padding=PADDING, bias=False)
        self.conv.to(dtype=torch.bfloat16, memory_format=torch.channels_last)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


def get_inputs():
    x = torch.randn(BATCH, C_IN, HEIGHT, WIDTH).to(torch.bfloat16)
    return [x.contiguous(memory_format=torch.channels_last)]


def get_init_inputs():
    return [C_IN, C_OUT]

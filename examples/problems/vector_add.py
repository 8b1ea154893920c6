"""y = a + b over two fp32 vectors of 2M elements: a call of about 10 microseconds.

No arithmetic to speak of (one add per 12 bytes): memory-bound. The floor is three
8 MiB streams (two read, one written) at HBM bandwidth: 25 MB, ~8 us on an H100. At
this size a call's fixed costs (a launch, the first bytes' latency) are as large as its
traffic, which is what makes it a test of the timer as much as of the kernel.
"""

import torch
from torch import nn

N = 1 << 21

tags = ["elementwise", "level1"]
tiny_sizes = {"N": 1000}


def flops(inputs):
    return inputs[0].numel()


class Model(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b


def get_inputs():
    return [torch.randn(N), torch.randn(N)]


def get_init_inputs():
    return []

"""LayerNorm over the hidden dimension in bf16 with weight and bias, optionally fused with
the residual add before it: h = x + residual, out = (h - mean) / sqrt(var + eps) * weight
+ bias, returning (out, h). The reference is torch.nn.functional.layer_norm (fp32
statistics inside, bf16 out) after an eager add.

Memory-bound: per element one read of x (and residual), one write of out (and h); weight
and bias are read once. At ROWS = 16384, HIDDEN = 4096 with the residual: 512 MB.
"""

import torch
from torch import nn

ROWS, HIDDEN = 16384, 4096
RESIDUAL = 1
EPS = 1e-5

tags = ["serving", "level1", "bf16", "norm"]
tiny_sizes = {"ROWS": 37, "HIDDEN": 1000}
tolerance = {"atol": 2e-2, "rtol": 2e-2}  # as rms_norm_bf16.py: about one bf16 step of an N(0, 1) output


def bytes_moved(inputs):
    x, weight = inputs[0], inputs[-2]
    return x.numel() * x.element_size() * (4 if RESIDUAL else 2) + 2 * weight.numel() * weight.element_size()


class Model(nn.Module):
    def forward(self, x: torch.Tensor, *rest: torch.Tensor):
        if RESIDUAL:
            residual, weight, bias = rest
            x = x + residual
        else:
            weight, bias = rest
        out = torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, EPS)
        return (out, x) if RESIDUAL else out


def get_inputs():
    x = torch.randn(ROWS, HIDDEN).to(torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(HIDDEN)).to(torch.bfloat16)
    bias = (0.1 * torch.randn(HIDDEN)).to(torch.bfloat16)
    rest = [torch.randn(ROWS, HIDDEN).to(torch.bfloat16)] if RESIDUAL else []
    return [x, *rest, weight, bias]


def get_init_inputs():
    return []

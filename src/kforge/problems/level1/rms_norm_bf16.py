"""RMSNorm over the hidden dimension in bf16, optionally fused with the residual add that
precedes it in a transformer block: h = x + residual, out = h / rms(h) * weight, returning
(out, h) so that h carries on as the next residual. The reference is what Hugging Face's
Llama does in eager PyTorch (statistics in fp32, the result rounded to bf16).

Memory-bound: per element one read of x (and of residual) and one write of out (and of
h); the weight is read once. At ROWS = 16384, HIDDEN = 4096 with the residual: 512 MB,
about 0.17 ms at the H100's ~3 TB/s. No FLOP count: only bytes matter here.
"""

import torch
from torch import nn

ROWS, HIDDEN = 16384, 4096
RESIDUAL = 1
EPS = 1e-6

tags = ["serving", "level1", "bf16", "norm"]
tiny_sizes = {"ROWS": 37, "HIDDEN": 1000}
# Outputs are ~N(0, 1) rounded to bf16 (a step of 2^-7 near 1): a kernel that rounds h
# before or after its statistics differs from eager by about one step.
tolerance = {"atol": 2e-2, "rtol": 2e-2}


def bytes_moved(inputs):
    x = inputs[0]
    return x.numel() * x.element_size() * (4 if RESIDUAL else 2) + inputs[-1].numel() * inputs[-1].element_size()


class Model(nn.Module):
    def forward(self, x: torch.Tensor, *rest: torch.Tensor):
        if RESIDUAL:
            residual, weight = rest
            x = x + residual
        else:
            (weight,) = rest
        h = x.float()
        normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
        out = weight * normed.to(x.dtype)
        return (out, x) if RESIDUAL else out


def get_inputs():
    x = torch.randn(ROWS, HIDDEN).to(torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(HIDDEN)).to(torch.bfloat16)
    return [x, torch.randn(ROWS, HIDDEN).to(torch.bfloat16), weight] if RESIDUAL else [x, weight]


def get_init_inputs():
    return []

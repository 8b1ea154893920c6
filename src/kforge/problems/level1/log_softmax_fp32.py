"""Log-softmax over a vocabulary in fp32: log-probabilities of TOKENS rows of logits over
Llama 2's / Mistral's 32000-word vocabulary (what a loss or a beam search reads). The
reference is torch.log_softmax.

Memory-bound: read once, write once, 2 x TOKENS x VOCAB x 4 bytes: at 4096 x 32000,
1.05 GB, about 0.35 ms at ~3 TB/s. A 128 KB fp32 row is walked twice by a kernel (the
log-sum-exp, then x - lse); eager PyTorch's kernel for rows too long for its shared memory
walks it three times.

Tiny size: 2 rows of 17000, longer than one register tile: the same two-pass path.
"""

import torch
from torch import nn

TOKENS, VOCAB = 4096, 32000

tags = ["reduction", "softmax", "level1", "fp32"]
tiny_sizes = {"TOKENS": 2, "VOCAB": 17000}
forbidden_ops = ["aten::_log_softmax", "aten::log_softmax"]
# Outputs ~ -11 +- 3: fp32 log-sum-exps summed in different orders differ by ~1e-6.
tolerance = {"atol": 1e-4, "rtol": 1e-5}


def flops(inputs):
    (x,) = inputs
    return 5 * x.numel()


def bytes_moved(inputs):
    (x,) = inputs
    return 2 * x.numel() * x.element_size()


class Model(nn.Module):
    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(logits, dim=-1)


def get_inputs():
    return [2 * torch.randn(TOKENS, VOCAB)]


def get_init_inputs():
    return []

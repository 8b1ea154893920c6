"""Top-k of fp32 logits over Llama 3's vocabulary (128256): the K = 50 largest logits of each
of ROWS sequences with their token ids, largest first (torch.topk, sorted): a top-k
sampler's first step (50 is Hugging Face's default top_k).

Each row holds the standard normal's quantiles at (i + 1/2) / VOCAB in a random order:
logits shaped like a model's, and no two equal, so the top 50 and their order are unique
(torch.topk, like any kernel, may order equal values either way, and the indices are
compared exactly).

Memory-bound at best: the floor is one read of the logits, ROWS x VOCAB x 4 bytes (263 MB
at 512 rows, ~88 us at ~3 TB/s), plus K values and int64 indices a row.

Tiny size: 2 rows of 3000, k = 50.
"""

import torch
from torch import nn

ROWS, VOCAB, K = 512, 128256, 50

tags = ["reduction", "selection", "level1", "fp32"]
tiny_sizes = {"ROWS": 2, "VOCAB": 3000}
forbidden_ops = ["aten::topk", "aten::sort", "aten::argsort", "aten::kthvalue", "aten::msort"]
tolerance = {"atol": 0.0, "rtol": 0.0}  # values are copied, indices are integers: exact


def bytes_moved(inputs):
    (x,) = inputs
    return x.numel() * x.element_size() + x.shape[0] * K * (x.element_size() + 8)


class Model(nn.Module):
    def forward(self, logits: torch.Tensor):
        values, indices = torch.topk(logits, K, dim=-1)
        return values, indices


def get_inputs():
    quantiles = torch.special.ndtri((torch.arange(VOCAB, dtype=torch.float64) + 0.5) / VOCAB).float()
    order = torch.rand(ROWS, VOCAB).argsort(dim=-1)
    return [quantiles[order]]


def get_init_inputs():
    return []

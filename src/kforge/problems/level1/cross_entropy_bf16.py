"""Cross-entropy loss from bf16 logits over Llama 3's vocabulary (128256): the mean over
tokens of logsumexp(logits) - logits[target], skipping targets equal to -100 (padding and
prompt tokens, ~5% here). The reference is how Hugging Face's Llama computes its loss:
upcast the logits to fp32, then F.cross_entropy (log_softmax, then the negative
log-likelihood of the targets).

Memory-bound: the floor is one read of the logits (TOKENS x VOCAB x 2 bytes) and of the
targets: at 4096 x 128256, 1.05 GB, about 0.35 ms at ~3 TB/s. The eager reference also
writes and rereads an fp32 copy and the fp32 log-probabilities: several GB.

Tiny size: 4 tokens over 9000 classes (two chunks a row, the second one short).
"""

import torch
from torch import nn

TOKENS, VOCAB = 4096, 128256
IGNORE_INDEX = -100

tags = ["reduction", "loss", "level1", "bf16"]
tiny_sizes = {"TOKENS": 4, "VOCAB": 9000}
forbidden_ops = ["aten::_log_softmax", "aten::log_softmax", "aten::nll_loss_forward", "aten::nll_loss",
                 "aten::cross_entropy_loss", "aten::logsumexp"]
# A mean of ~12.5 over thousands of fp32 per-token losses: summation order moves it ~1e-6.
# An off-by-one target, or a missed ignore, moves it by ~1e-3 at least.
tolerance = {"atol": 1e-4, "rtol": 1e-5}


def bytes_moved(inputs):
    logits, targets = inputs
    return logits.numel() * logits.element_size() + targets.numel() * targets.element_size() + 4


class Model(nn.Module):
    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX)


def get_inputs():
    logits = (2 * torch.randn(TOKENS, VOCAB)).to(torch.bfloat16)
    targets = torch.randint(0, VOCAB, (TOKENS,))
    targets[torch.rand(TOKENS) < 0.05] = IGNORE_INDEX
    return [logits, targets]


def get_init_inputs():
    return []

"""The language-model loss from the last hidden states, bf16: mean cross-entropy of
x W^T (the LM head) against the next tokens, skipping targets of -100, as Hugging Face's
causal LMs compute it: lm_head, upcast the logits to fp32, F.cross_entropy.

The reference: the LM head GEMM writes (TOKENS, VOCAB) bf16 logits (1.05 GB at Llama-3's
vocabulary), the upcast reads them and writes them again in fp32 (2.1 GB), log_softmax
reads those and writes fp32 log-probabilities (2.1 GB), nll_loss picks the targets:
8.4 GB of traffic or more (~3 ms) beside the GEMM. A fused solution reduces each logits tile to a max and a sum
of exponentials per row in the GEMM's epilogue and merges them: the logits never exist.

Sizes: Llama-3-8B's LM head (hidden 4096, vocabulary 128256), 4096 tokens. The GEMM is
2 * 4096 * 4096 * 128256 = 4.3 TFLOP (~5.6 ms at ~770 TFLOP/s). Minimum traffic: x, W
and the targets read once. Tiny size: 20 tokens, hidden 40, 100 classes.
"""

import torch
import torch.nn.functional as F
from torch import nn

TOKENS, HIDDEN, VOCAB = 4096, 4096, 128256
IGNORE_INDEX = -100

tags = ["level2", "bf16", "gemm", "loss", "fusion"]
compute_dtype = "bf16"
tiny_sizes = {"TOKENS": 20, "HIDDEN": 40, "VOCAB": 100}
forbidden_ops = ["aten::mm", "aten::matmul", "aten::addmm", "aten::bmm", "aten::linear", "aten::_log_softmax",
                 "aten::log_softmax", "aten::cross_entropy_loss", "aten::nll_loss_forward", "aten::logsumexp"]
# A mean of ~12 over thousands of per-token losses. Eager rounds each logit to bf16 before
# the softmax (half a step: 2^-9 relative), a fused epilogue keeps fp32: the target
# logit's rounding moves a token's loss by ~5e-3 at random, the mean by ~1e-4 (~1e-3 at
# the tiny size's 20 tokens, up to 3.5e-3 seen). A wrong target column, or an ignored
# token counted, moves the mean by 5e-2 and more.
tolerance = {"atol": 1e-2, "rtol": 1e-4}


def flops(inputs):
    x, _ = inputs
    return 2 * x.shape[0] * x.shape[1] * VOCAB


def bytes_moved(inputs):
    x, targets = inputs
    return (x.numel() + VOCAB * x.shape[1]) * x.element_size() + targets.numel() * targets.element_size() + 4


class Model(nn.Module):
    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.lm_head = nn.Linear(hidden, vocab, bias=False, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(x)
        return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX)


def get_inputs():
    x = (4 * torch.randn(TOKENS, HIDDEN)).to(torch.bfloat16)  # logits ~N(0, 2.3): a peaked softmax
    targets = torch.randint(0, VOCAB, (TOKENS,))
    targets[torch.rand(TOKENS) < 0.05] = IGNORE_INDEX
    return [x, targets]


def get_init_inputs():
    return [HIDDEN, VOCAB]

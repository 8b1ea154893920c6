"""The DeepSeek-V3 mixture-of-experts layer of moe_deepseek_v3_prefill_bf16.py at decode: TOKENS =
64 (a batch of 64 sequences, one new token each), the same Model, sizes and tolerance.

Work: 6 * 64 * 9 * 7168 * 2048 = 51 GFLOP, nothing for the tensor cores; 64 x 8 = 512 routed
assignments over 256 experts reach ~220 of them, and the shared expert every token, so ~19.5 GB
of the 22.6 GB of expert weights are read: ~6.5 ms at 3 TB/s, memory-bound. A grouped GEMM's
tiles are almost all padding here (~2 rows an expert): the weight panels are the bytes that count.
"""

import torch

from kforge.problems.level3.moe_deepseek_v3_prefill_bf16 import Model  # noqa: F401  (the same layer)

TOKENS = 64
HIDDEN, INTER, EXPERTS, TOP_K, N_GROUP, TOPK_GROUP, SHARED = 7168, 2048, 256, 8, 8, 4, 1
SCALING = 2.5

tags = ["level3", "bf16", "moe", "gemm", "deepseek", "decode"]
compute_dtype = "bf16"
tiny_sizes = {"TOKENS": 5, "HIDDEN": 64, "INTER": 32, "EXPERTS": 16, "TOP_K": 4, "N_GROUP": 4, "TOPK_GROUP": 2}
tolerance = {"atol": 4e-2, "rtol": 3e-2}


def flops(inputs):
    tokens = inputs[0].numel() // HIDDEN
    return 2 * tokens * HIDDEN * EXPERTS + 6 * tokens * (TOP_K + SHARED) * HIDDEN * INTER


def bytes_moved(inputs):
    # every expert that receives a token is read whole. Which do depends on the weights, which
    # this function does not see: it counts the experts uniform routing reaches on average,
    # E (1 - (1 - top_k / E)^tokens) (222 of 256 at 64 tokens), less 10% so that a run whose
    # routing reaches fewer still sits above the floor, plus the shared expert and the router
    x = inputs[0]
    tokens = x.numel() // HIDDEN
    reached = 0.9 * EXPERTS * (1 - (1 - TOP_K / EXPERTS) ** tokens)
    weights = int((reached + SHARED) * 3 * HIDDEN * INTER) + EXPERTS * HIDDEN
    return 2 * weights + 4 * EXPERTS + 2 * x.numel() * x.element_size()


def get_inputs():
    return [torch.randn(TOKENS, HIDDEN).to(torch.bfloat16)]


def get_init_inputs():
    return [HIDDEN, INTER, EXPERTS, TOP_K, N_GROUP, TOPK_GROUP, SHARED, SCALING]

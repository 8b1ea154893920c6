"""Attention forward in bf16, O = softmax(Q K^T / sqrt(D)) V per head, against PyTorch's
SDPA pinned to its flash backend (FlashAttention-2): the baseline of `kforge bench attention`.

Q is (B, H, N, D), K and V (B, KV_HEADS, N, D) with KV_HEADS dividing H (grouped-query
attention); CAUSAL=1 masks keys after the query (top-left, as SDPA's is_causal).
FLOPs: 4*B*H*N^2*D (two products of 2*N^2*D each), half of it causal (the convention of
the FlashAttention papers). Minimum HBM bytes: Q, K, V read and O written once. At
B=8, H=16, N=4096, D=128: 1.1 TFLOP over 0.5 GB, compute-bound (about 2.2 ms at 500
TFLOP/s).
"""

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention

B, H, N, D = 8, 16, 4096, 128
KV_HEADS = 16
CAUSAL = 0

tags = ["attention", "level1", "bf16"]
compute_dtype = "bf16"
tiny_sizes = {"B": 1, "H": 4, "KV_HEADS": 2, "N": 67, "D": 32}
# A candidate computes attention itself: every SDPA kernel is out of bounds.
forbidden_ops = [
    "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_flash_attention_forward", "aten::_efficient_attention_forward",
]
# Outputs are softmax-weighted averages of N(0, 1) values, sums of terms p*v whose sizes
# add up to about E|v| = 0.8 while the output itself can be far smaller (it cancels). bf16
# keeps 8 bits: rounding the probabilities (every flash kernel feeds P V in bf16), and in
# eager code the scores too (|s| ~ 4 rounds by 2^-7), moves an output by up to ~1e-2 in
# absolute terms (measured up to 1.6e-2 on 67 keys). A wrong mask or a missed rescale moves whole rows by their own size.
tolerance = {"atol": 2e-2, "rtol": 2e-2}


def flops(inputs):
    q, k, _ = inputs
    full = 4 * q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * q.shape[3]
    return full // 2 if CAUSAL else full


class Model(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return scaled_dot_product_attention(q, k, v, is_causal=bool(CAUSAL), enable_gqa=KV_HEADS != H)


def get_inputs():
    return [torch.randn(B, H, N, D).to(torch.bfloat16), torch.randn(B, KV_HEADS, N, D).to(torch.bfloat16),
            torch.randn(B, KV_HEADS, N, D).to(torch.bfloat16)]


def get_init_inputs():
    return []

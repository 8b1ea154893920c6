"""Variable-length prefill attention in bf16: SEQS sequences packed end to end without
padding, each attending only to itself (causal, top-left aligned per sequence), as a
prefill batch of prompts of different lengths. q is (total, H, D), k and v
(total, KV_HEADS, D), sequence b in rows cu_seqlens[b] .. cu_seqlens[b + 1].

Lengths are fixed by the constants (so a kernel knows the longest without reading the
device): sequence i has 1 + (i * 2654435761) % MAX_LEN tokens, a spread from a few to
MAX_LEN. The reference is eager PyTorch without a varlen kernel: one SDPA call per
sequence. FLOPs: 4 * H * D * (visible query-key pairs), n(n + 1)/2 per causal sequence.
"""

import torch
from torch import nn

SEQS, MAX_LEN = 8, 4096
H, KV_HEADS, D = 32, 8, 128
CAUSAL = 1

tags = ["serving", "level1", "bf16", "attention", "prefill"]
compute_dtype = "bf16"
tiny_sizes = {"SEQS": 3, "MAX_LEN": 70, "H": 4, "KV_HEADS": 2, "D": 32}
forbidden_ops = [
    "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_flash_attention_forward", "aten::_efficient_attention_forward",
]
tolerance = {"atol": 2e-2, "rtol": 2e-2}  # as attention_bf16.py


def lengths():
    return [1 + (i * 2654435761) % MAX_LEN for i in range(SEQS)]


def cumulative(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def flops(inputs):
    pairs = sum(n * (n + 1) // 2 if CAUSAL else n * n for n in lengths())
    return 4 * H * D * pairs


def bytes_moved(inputs):
    q, k, v, _ = inputs
    return (2 * q.numel() + k.numel() + v.numel()) * q.element_size()


class Model(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        out, start = torch.empty_like(q), 0
        for n in lengths():  # (n, heads, D) -> (1, heads, n, D) for SDPA, and back
            rows = slice(start, start + n)
            o = torch.nn.functional.scaled_dot_product_attention(
                q[rows].transpose(0, 1)[None], k[rows].transpose(0, 1)[None], v[rows].transpose(0, 1)[None],
                is_causal=bool(CAUSAL), enable_gqa=H != KV_HEADS)
            out[rows] = o[0].transpose(0, 1)
            start += n
        return out


def get_inputs():
    total = sum(lengths())
    return [torch.randn(total, H, D).to(torch.bfloat16), torch.randn(total, KV_HEADS, D).to(torch.bfloat16),
            torch.randn(total, KV_HEADS, D).to(torch.bfloat16), cumulative(lengths())]


def get_init_inputs():
    return []

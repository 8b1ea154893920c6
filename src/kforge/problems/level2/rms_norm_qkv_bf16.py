"""RMSNorm fused into the QKV projection, bf16: y = rms_norm(x; gamma) @ W_qkv^T, the first
two steps of every Llama attention block. The reference is the two ops as eager PyTorch
runs them: the norm (Hugging Face's way: fp32 statistics, bf16 out) written to memory,
then cuBLAS reading it back.

What fusing saves is that round trip of the normalized activations (2 * M * K * 2 bytes)
and one launch. At decode (M = 1..16) the op is a GEMV, bound by reading W
(K * N * 2 bytes: 50 MB at Llama-3-8B's K = 4096, N = 6144); at prefill (M = 4096) a
GEMM, bound by its 2 * M * N * K FLOPs (206 GFLOP, ~0.26 ms at ~790 TFLOP/s).
"""

import torch
from torch import nn

M, N, K = 4096, 6144, 4096
EPS = 1e-6

tags = ["serving", "level2", "bf16", "norm", "gemm"]
compute_dtype = "bf16"
tiny_sizes = {"M": 37, "N": 80, "K": 96}  # rows of 16-byte multiples: the GEMM reads through TMA
forbidden_ops = ["aten::mm", "aten::matmul", "aten::addmm", "aten::bmm", "aten::linear"]
# W scales by 1/sqrt(K): outputs ~N(0, 1). The reference rounds the normalized x to bf16
# before the GEMM; a fused kernel may not: about one bf16 step apart, as gemv_bf16.py.
tolerance = {"atol": 2e-2, "rtol": 2e-2}


def flops(inputs):
    x, _, w = inputs
    return 2 * x.shape[0] * x.shape[1] * w.shape[0]


def bytes_moved(inputs):
    x, gamma, w = inputs
    return (x.numel() + gamma.numel() + w.numel() + x.shape[0] * w.shape[0]) * x.element_size()


class Model(nn.Module):
    def forward(self, x: torch.Tensor, gamma: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = x.float()
        normed = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)
        return torch.nn.functional.linear(gamma * normed, w)


def get_inputs():
    x = torch.randn(M, K).to(torch.bfloat16)
    gamma = (1 + 0.1 * torch.randn(K)).to(torch.bfloat16)
    return [x, gamma, (torch.randn(N, K) / K**0.5).to(torch.bfloat16)]


def get_init_inputs():
    return []

"""Grouped GEMM in bf16, one of DeepGEMM's two MoE layouts: out_g = x_g W_g^T for G experts, each
with its own weight W_g (N, K) (a linear layer's) and M rows of activations.

MASKED = 0, contiguous (prefill): x (G * M, K) holds the groups one after another, m_indices
(G * M,) int32 names each row's group, offs (G,) int32 the end of each group's rows (what
torch._grouped_mm takes); out (G * M, N). M is a multiple of 128, so every run starts on a tile.
MASKED = 1, masked (decode): x (G, M, K), a block an expert, masked_m (G,) int32 its valid rows;
out (G, M, N). Every block is full (masked_m = M): DeepGEMM's contract leaves the rows past
masked_m unwritten, so a ragged block has no output to compare; the full block is the masked
layout's most work, and what torch._grouped_mm's 3-D batch computes.

The weights are the Model's (get_init_inputs), normal with std K^-1/2, so out ~ N(0, 1). BASELINE
picks the reference: 0 torch._grouped_mm (one grouped CUTLASS launch), 1 a loop of cuBLAS GEMMs,
torch.mm per expert into its rows of one output (the group sizes are constants here, so the loop
needs no host sync, which a real router's counts would cost it).

FLOPs 2 * G * M * N * K. Minimum bytes: the G weights, x and out once, the group tensor. At
DeepGEMM's contiguous shape (G 4, M 8192, N 4096, K 7168) 1.92 TFLOP over 0.97 GB:
compute-bound. Masked 1 x 1024: 60 GFLOP over 82 MB; 4 x 256: 60 GFLOP over 258 MB; 256 experts
x 4 rows: 60 GFLOP over 15 GB, the weights, read at copy bandwidth in ~5 ms: memory-bound.
"""

import torch
from torch import nn

G, M, N, K = 4, 8192, 4096, 7168
MASKED = 0
BASELINE = 0

tags = ["moe", "grouped-gemm", "bf16", "bench"]
compute_dtype = "bf16"
tiny_sizes = {"G": 3, "M": 32, "N": 48, "K": 64}


def flops(inputs):
    x = inputs[0]
    return 2 * (x.numel() // K) * N * K


def bytes_moved(inputs):
    x, groups = inputs[0], inputs[1]
    rows = x.numel() // K
    return 2 * (G * N * K + rows * K + rows * N) + groups.numel() * groups.element_size()


class Model(nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.register_buffer("weight", weight)  # (G, N, K)

    def forward(self, x, groups, *offs):
        w = self.weight
        if BASELINE == 0:
            if MASKED:
                return torch._grouped_mm(x, w.transpose(1, 2), out_dtype=torch.bfloat16)
            return torch._grouped_mm(x, w.transpose(1, 2), offs=offs[0], out_dtype=torch.bfloat16)
        out = torch.empty(*x.shape[:-1], N, dtype=torch.bfloat16, device=x.device)
        for g in range(G):
            rows = slice(g * M, (g + 1) * M)
            torch.mm(x[g] if MASKED else x[rows], w[g].t(), out=out[g] if MASKED else out[rows])
        return out


def get_inputs():
    if MASKED:
        return [torch.randn(G, M, K, dtype=torch.bfloat16), torch.full((G,), M, dtype=torch.int32)]
    m_indices = torch.arange(G, dtype=torch.int32).repeat_interleave(M)
    offs = torch.arange(1, G + 1, dtype=torch.int32) * M
    return [torch.randn(G * M, K, dtype=torch.bfloat16), m_indices, offs]


def get_init_inputs():
    return [torch.randn(G, N, K, dtype=torch.bfloat16).mul_(K**-0.5)]

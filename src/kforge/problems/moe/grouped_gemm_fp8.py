"""Grouped GEMM in FP8 (e4m3), DeepGEMM's MoE format: out_g = (x_g * sx) (W_g * sw)^T in bf16 with
fp32 sums, for G experts of M rows each, contiguous (MASKED = 0: x (G * M, K), m_indices) or masked
(MASKED = 1: x (G, M, K), masked_m, every block full) as in grouped_gemm_bf16.py.

The scales are DeepGEMM's blocks: 1 x 128 for the activations, 128 x 128 for each expert's weight.
Drawn as in problems/quant/fp8_gemm_e4m3.py: the codes are 64 * N(0, 1) in e4m3 and every scale is
one power of two (sx = 2^-6, sw = 2^-13), so one set of numbers is at once block-, row- and
tensor-scaled and every path multiplies the same values; out ~ N(0, K / 2^14) (std 0.66 at K
7168). The inputs carry each
scale in the layout its consumer reads, so no call converts one:

    x_scale      (G * M, K/128) or (G, M, K/128)   1 x 128 blocks, row-major (ours)
    x_scale_t    (G, K/128, M)                     the same blocks M-major per expert (cuBLAS's)
    x_scale_row  (G, M, 1)                         one scale a row (_scaled_mm row-wise)
    w_scale      (G, ceil(N/128), K/128)           128 x 128 blocks (ours; transposed for cuBLAS)
    w_scale_row  (G, 1, N)                         one scale a column (_scaled_mm row-wise)

BASELINE picks the reference, a loop over the experts of torch._scaled_mm into each one's rows of
one output (no host sync: the group sizes are constants here):
  0  block scales (1 x 128 activations, 128 x 128 weights): cuBLAS's DeepSeek-style path (cuBLASLt
     12.9+ on sm_90, which torch's _scaled_mm takes since 2.9), the same work as ours, promotion
     included. On a CPU, which has no block-scaled _scaled_mm, it runs the row-wise call below on
     the same numbers, so the tiny size still checks the rest.
  1  row-wise scales (per activation row and weight column): the scaling _scaled_mm takes on every
     version; it does less than block scaling (no rescale every 128 K), so it bounds from above
     what a block-scaled kernel can reach.

FLOPs 2 * G * M * N * K; minimum bytes: the fp8 weights, x and the bf16 out once, the scales and
the group tensor. At DeepGEMM's contiguous shape (G 4, M 8192, N 4096, K 7168) 1.92 TFLOP over
0.49 GB (DeepGEMM: 1297 TFLOP/s on an H800); masked, 256 experts x 4 rows: 60 GFLOP over 7.5 GB
of weights, memory-bound.
"""

import torch
from torch import nn

G, M, N, K = 4, 8192, 4096, 7168
MASKED = 0
BASELINE = 0
BLOCK = 128
X_SCALE, W_SCALE = 2.0**-6, 2.0**-13

tags = ["moe", "grouped-gemm", "fp8", "bench"]
precision = "as_drawn"  # fp8 codes and their scales keep their format: not exposed
compute_dtype = "fp8"
tiny_sizes = {"G": 3, "M": 32, "N": 160, "K": 256}
tolerance = {"atol": 2e-2, "rtol": 2e-2}  # one bf16 rounding of out, fp32 sums in different orders


def flops(inputs):
    x = inputs[0]
    return 2 * (x.numel() // K) * N * K


def bytes_moved(inputs):
    x, x_scale, groups = inputs[0], inputs[1], inputs[-1]
    rows = x.numel() // K
    w_scales = G * -(-N // BLOCK) * (K // BLOCK)
    return G * N * K + rows * K + 2 * rows * N + 4 * (x_scale.numel() + w_scales) + 4 * groups.numel()


def _scaled(a, b, scale_a, scale_b, out):
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16, out=out)


class Model(nn.Module):
    def __init__(self, weight, w_scale, w_scale_row):
        super().__init__()
        self.register_buffer("weight", weight)  # (G, N, K) e4m3
        self.register_buffer("w_scale", w_scale)  # (G, ceil(N/128), K/128)
        self.register_buffer("w_scale_row", w_scale_row)  # (G, 1, N)

    def forward(self, x, x_scale, x_scale_t, x_scale_row, groups):
        out = torch.empty(*x.shape[:-1], N, dtype=torch.bfloat16, device=x.device)
        block = BASELINE == 0 and x.is_cuda
        for g in range(G):
            rows = slice(g * M, (g + 1) * M)
            a, dst = (x[g], out[g]) if MASKED else (x[rows], out[rows])
            w = self.weight[g].t()
            if block:  # scale_a (M, K/128) M-major, scale_b (K/128, N/128): cuBLAS's layouts
                _scaled(a, w, x_scale_t[g].t(), self.w_scale[g].t(), dst)
            else:
                _scaled(a, w, x_scale_row[g], self.w_scale_row[g], dst)
        return out


def _e4m3(*shape):
    return (64 * torch.randn(*shape)).clamp_(-448, 448).to(torch.float8_e4m3fn)


def get_inputs():
    blocks = K // BLOCK
    x = _e4m3(G, M, K) if MASKED else _e4m3(G * M, K)
    x_scale = torch.full((*x.shape[:-1], blocks), X_SCALE)
    x_scale_t = torch.full((G, blocks, M), X_SCALE)
    x_scale_row = torch.full((G, M, 1), X_SCALE)
    if MASKED:
        groups = torch.full((G,), M, dtype=torch.int32)
    else:
        groups = torch.arange(G, dtype=torch.int32).repeat_interleave(M)
    return [x, x_scale, x_scale_t, x_scale_row, groups]


def get_init_inputs():
    weight = torch.empty(G, N, K, dtype=torch.float8_e4m3fn)
    for g in range(G):  # an expert at a time: 256 experts' fp32 draws at once would need 30 GB
        weight[g] = _e4m3(N, K)
    return [weight, torch.full((G, -(-N // BLOCK), K // BLOCK), W_SCALE), torch.full((G, 1, N), W_SCALE)]

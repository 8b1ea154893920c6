"""2-D convolution as an implicit GEMM on tensor cores, in Triton: channels-last (NHWC) bf16/fp16.

For input x (N, C, H, W), weight (K, C, R, S), stride and zero padding, the output is
(N, K, P, Q) with P = (H + 2 pad - R) // stride + 1 (Q likewise) and

    out[n, k, p, q] = sum_{r, s, c} x[n, c, p stride - pad + r, q stride - pad + s] w[k, c, r, s].

That is a GEMM: rows are the M = N P Q output pixels, columns the K output channels, and
the reduction runs over R S C. "Implicit": the (M, R S C) matrix of input patches
(im2col) is never built; each program computes the addresses of its patch rows as it
goes. The reduction is walked (r, s) by (r, s) and, within one, C in BLOCK_C slices:

    A tile [BLOCK_M, BLOCK_C]: x at pixel (n, p stride - pad + r, q stride - pad + s), channels c..c+BLOCK_C,
    B tile [BLOCK_C, BLOCK_N]: the weight as a (R S C, K) matrix, rows (r, s, c..c+BLOCK_C),

zeros where the pixel falls in the padding. Why channels-last: there the BLOCK_C channels
of one pixel are contiguous (128 bytes at BLOCK_C = 64 in bf16), so every A row is one
coalesced line and the tile goes to shared memory with 16-byte async copies; in NCHW the
same slice is BLOCK_C values H W elements apart, one sector each. cuDNN's fastest tensor-
core kernels want NHWC for the same reason, so the eager reference (nn.Conv2d on a
channels_last input) runs its best too. The weight is rearranged once (`conv_weight_matrix`,
cached by the caller), 2 x R S C K bytes.

The (r, s, c) steps form one flat loop, so Triton's software pipeline keeps `num_stages`
tiles of A and B in flight (cp.async into shared memory) while wgmma multiplies the
current ones; pixel coordinates are recomputed each step from BLOCK_M integer divisions
done once. Tiles are autotuned (128 x 128 or 128 x 64 or 64 x 128 outputs, BLOCK_C 32 or
64, 3-4 stages, all within the 227 KB of shared memory an H100 block may use); the grid
is grouped (GROUP_M row tiles share a column of weights in L2).

Work: 2 M K R S C FLOPs. ResNet-50's 3x3 conv at 28 x 28 with 128 -> 128 channels, batch
256: 59 GFLOP over 104 MB, compute-bound. Expected on the H100 (not measured here): a
pointer-fed Triton GEMM reaches ~60-75% of cuBLAS at these sizes; cuDNN's implicit GEMM
is at least as good, so expect this kernel to trail cuDNN (0.6-0.9x). It is here for
correctness and as the readable version of what cuDNN does, not to beat it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

DTYPES = (torch.float16, torch.bfloat16)


@triton.jit
def conv2d_nhwc_kernel(x_ptr, w_ptr, out_ptr, batch, channels, height, width, out_channels, out_h, out_w,
                       sx_n, sx_c, sx_h, sx_w, so_n, so_k, so_p, so_q, stride, padding,
                       R: tl.constexpr, S: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_C: tl.constexpr, GROUP_M: tl.constexpr):
    pixels = batch * out_h * out_w
    tiles_m, tiles_n = tl.cdiv(pixels, BLOCK_M), tl.cdiv(out_channels, BLOCK_N)
    pid = tl.program_id(0)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % per_group) % group_rows
    tile_n = (pid % per_group) // group_rows

    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, BLOCK_C)
    n = offs_m // (out_h * out_w)
    p = (offs_m // out_w) % out_h
    q = offs_m % out_w
    pixel_ok = offs_m < pixels
    h0, w0 = p * stride - padding, q * stride - padding
    x_pixel = x_ptr + n.to(tl.int64) * sx_n
    channel_steps = tl.cdiv(channels, BLOCK_C)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(0, R * S * channel_steps):
        rs = step // channel_steps
        c = (step % channel_steps) * BLOCK_C + offs_c
        h, w = h0 + rs // S, w0 + rs % S
        inside = pixel_ok & (h >= 0) & (h < height) & (w >= 0) & (w < width)
        a = tl.load(x_pixel[:, None] + (h * sx_h + w * sx_w).to(tl.int64)[:, None] + c[None, :] * sx_c,
                    mask=inside[:, None] & (c < channels)[None, :], other=0.0)
        b = tl.load(w_ptr + (rs * channels + c).to(tl.int64)[:, None] * out_channels + offs_n[None, :],
                    mask=(c < channels)[:, None] & (offs_n < out_channels)[None, :], other=0.0)
        acc = tl.dot(a, b, acc)

    out = (out_ptr + n.to(tl.int64)[:, None] * so_n + (p * so_p + q * so_q).to(tl.int64)[:, None]
           + offs_n.to(tl.int64)[None, :] * so_k)
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=pixel_ok[:, None] & (offs_n < out_channels)[None, :])


def _config(block_m, block_n, block_c, stages, warps):
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_C": block_c, "GROUP_M": 8},
                         num_stages=stages, num_warps=warps)


# Shared memory: stages x (BLOCK_M + BLOCK_N) x BLOCK_C x 2 bytes (plus the layout
# conversion of the epilogue): at most 4 x 256 x 64 x 2 = 128 KB. tests/kernels/test_conv2d.py
# compiles each for sm_90 and checks the 227 KB limit.
CONFIGS = [
    _config(128, 128, 64, 3, 8), _config(128, 128, 64, 4, 8), _config(128, 128, 32, 4, 4),
    _config(128, 64, 64, 4, 4), _config(64, 128, 64, 4, 4),
]
conv2d_autotuned = triton.autotune(CONFIGS, key=["batch", "channels", "height", "width", "out_channels", "stride",
                                                 "padding", "R", "S"])(conv2d_nhwc_kernel)
INTERPRETER_CONFIG = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_C": 16, "GROUP_M": 2}
# Each shape's pick, once tuned: later calls launch it directly, without the autotuner's dispatch.
_TUNED: dict[tuple, dict] = {}


def conv_weight_matrix(weight: torch.Tensor) -> torch.Tensor:
    """The weight (K, C, R, S) as the GEMM's B: a contiguous (R S C, K) matrix, rows in (r, s, c) order."""
    if weight.dim() != 4:
        raise ValueError(f"weight must be (K, C, R, S), got {tuple(weight.shape)}")
    out_channels, channels, r, s = weight.shape
    return weight.permute(2, 3, 1, 0).reshape(r * s * channels, out_channels).contiguous()


def check_conv2d_inputs(x: torch.Tensor, weight: torch.Tensor, stride: int, padding: int) -> tuple[int, int]:
    """ValueError on anything the kernel cannot take; the output's (P, Q)."""
    if x.dim() != 4 or weight.dim() != 4:
        raise ValueError(f"x must be (N, C, H, W) and weight (K, C, R, S), got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if x.dtype not in DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share one dtype of float16, bfloat16; got {x.dtype} and {weight.dtype}")
    if x.device != weight.device:
        raise ValueError(f"x is on {x.device}, weight on {weight.device}")
    if weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight has {weight.shape[1]} input channels, x has {x.shape[1]} (groups are not supported)")
    if not (isinstance(stride, int) and stride >= 1 and isinstance(padding, int) and padding >= 0):
        raise ValueError(f"stride must be an int >= 1 and padding an int >= 0, got {stride!r} and {padding!r}")
    out_h = (x.shape[2] + 2 * padding - weight.shape[2]) // stride + 1
    out_w = (x.shape[3] + 2 * padding - weight.shape[3]) // stride + 1
    if out_h < 1 or out_w < 1:
        raise ValueError(f"a {weight.shape[2]}x{weight.shape[3]} kernel does not fit the padded "
                         f"{x.shape[2]}x{x.shape[3]} input")
    return out_h, out_w


def conv2d_nhwc(x: torch.Tensor, weight: torch.Tensor, *, stride: int = 1, padding: int = 0,
                weight_matrix: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """conv2d(x, weight, stride, padding) without bias, dilation 1, one group; bf16/fp16, fp32 accumulation.

    x is read through its strides (fast when channels-last: `x.to(memory_format=torch.channels_last)`);
    the output is (N, K, P, Q) in channels-last memory. `weight_matrix` is
    `conv_weight_matrix(weight)`, to pass when cached; `config` (BLOCK_M, BLOCK_N, BLOCK_C,
    GROUP_M, num_warps, num_stages) skips the autotuner.
    """
    out_h, out_w = check_conv2d_inputs(x, weight, stride, padding)
    batch, channels, height, width = x.shape
    out_channels, _, r, s = weight.shape
    matrix = conv_weight_matrix(weight) if weight_matrix is None else weight_matrix
    if matrix.shape != (r * s * channels, out_channels) or not matrix.is_contiguous():
        raise ValueError(f"weight_matrix must be conv_weight_matrix(weight): contiguous "
                         f"({r * s * channels}, {out_channels}), got {tuple(matrix.shape)}")
    out = torch.empty((batch, out_channels, out_h, out_w), dtype=x.dtype, device=x.device,
                      memory_format=torch.channels_last)
    if out.numel() == 0:
        return out
    args = (x, matrix, out, batch, channels, height, width, out_channels, out_h, out_w, *x.stride(), *out.stride(),
            stride, padding)
    shape = (batch, channels, height, width, out_channels, r, s, stride, padding, x.dtype)
    if config is None and not x.is_cuda:  # the Triton interpreter: one small tile, no autotuning
        config = INTERPRETER_CONFIG
    if config is None and shape in _TUNED:
        config = _TUNED[shape]
    if config is None:
        def grid(meta):
            return (triton.cdiv(batch * out_h * out_w, meta["BLOCK_M"]) * triton.cdiv(out_channels, meta["BLOCK_N"]),)

        conv2d_autotuned[grid](*args, R=r, S=s)
        best = conv2d_autotuned.best_config
        _TUNED[shape] = dict(best.kwargs, num_stages=best.num_stages, num_warps=best.num_warps)
    else:
        blocks = {key: config[key] for key in ("BLOCK_M", "BLOCK_N", "BLOCK_C", "GROUP_M")}
        grid = (triton.cdiv(batch * out_h * out_w, blocks["BLOCK_M"]) * triton.cdiv(out_channels, blocks["BLOCK_N"]),)
        conv2d_nhwc_kernel[grid](*args, R=r, S=s, **blocks, num_warps=config.get("num_warps", 4),
                                 num_stages=config.get("num_stages", 2))
    return out


def conv2d_flops(batch: int, out_channels: int, out_h: int, out_w: int, channels: int, r: int, s: int) -> int:
    """2 x M x K x (R S C): one multiply and one add a weight a pixel."""
    return 2 * batch * out_h * out_w * out_channels * channels * r * s

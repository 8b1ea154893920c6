"""Depthwise causal 1-D convolution with its bias and activation, one pass, in Triton: the
short convolution of Mamba-style blocks.

The math. For x (B, C, L), one filter of W taps per channel w (C, W) and a bias b (C,):

    y[b, c, l] = act( b[c] + sum_{j=0}^{W-1} w[c, j] * x[b, c, l - (W - 1) + j] ),   x[.., < 0] = 0

so output l sees inputs l - W + 1 .. l: causal. Eager PyTorch writes it as
nn.Conv1d(C, C, W, groups=C, padding=W - 1) (which also computes W - 1 outputs past the
end, sliced off), then F.silu: the convolution writes L + W - 1 outputs per row and the
activation reads them back and writes L: ~3 bytes moved per byte of x, against 2 here
(x read once, y written once), in one launch instead of two.

Choices, each for the H100:
- A program owns a [BLOCK_C, BLOCK_L] tile of one batch element: W shifted loads of the
  same x tile (the halo of W - 1 elements on the left comes with them). The shifted
  loads overlap, so only the first reaches HBM; the rest hit L1. Rows (L) are
  contiguous: 16-byte vector accesses when L is a multiple of 8.
- The taps are a compile-time constant: the loop over j unrolls into W FMAs per output.
- ~2048 outputs per program over 4 warps: 16 per thread; thousands of programs at
  Mamba sizes fill 132 SMs.
- Offsets are 64-bit: B x C x L passes 2^31 at 8 x 5120 x 65536.

Expected on the H100 (not measured here): ~85-90% of copy bandwidth on 2 x B x C x L x E
bytes, like any streaming kernel with a tiny stencil.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ACTIVATIONS = ("none", "silu")
MAX_TAPS = 16
TILE = 2048


@triton.jit
def causal_conv1d_kernel(x_ptr, w_ptr, b_ptr, y_ptr, channels, length, batch_stride, channel_stride,
                         TAPS: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                         BLOCK_C: tl.constexpr, BLOCK_L: tl.constexpr):
    offs_l = tl.program_id(0) * BLOCK_L + tl.arange(0, BLOCK_L)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    batch = tl.program_id(2).to(tl.int64)
    in_c = offs_c < channels
    row = x_ptr + batch * batch_stride + offs_c.to(tl.int64)[:, None] * channel_stride
    acc = tl.zeros((BLOCK_C, BLOCK_L), dtype=tl.float32)
    for j in tl.static_range(TAPS):
        src = offs_l - (TAPS - 1) + j  # the input this tap multiplies; < 0 is the causal zero padding
        x = tl.load(row + src[None, :], mask=in_c[:, None] & ((src >= 0) & (src < length))[None, :], other=0.0)
        w = tl.load(w_ptr + offs_c * TAPS + j, mask=in_c, other=0.0)
        acc += w.to(tl.float32)[:, None] * x.to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_c, mask=in_c, other=0.0).to(tl.float32)[:, None]
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    out = y_ptr + batch * channels * length + offs_c.to(tl.int64)[:, None] * length + offs_l[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=in_c[:, None] & (offs_l < length)[None, :])


def conv_tile(length: int) -> tuple[int, int]:
    """(BLOCK_C, BLOCK_L): up to 1024 positions of a row, channels to make a TILE-output tile."""
    block_l = min(triton.next_power_of_2(length), 1024)
    return max(1, TILE // block_l), block_l


def check_causal_conv1d_inputs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                               activation: str) -> None:
    """Raise ValueError on anything the kernel cannot take."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}; got {activation!r}")
    if x.dim() != 3 or 0 in x.shape:
        raise ValueError(f"x must be (batch, channels, length) with no empty dimension, got {tuple(x.shape)}")
    channels = x.shape[1]
    if weight.dim() == 3 and weight.shape[1] == 1:  # nn.Conv1d's depthwise (C, 1, W)
        weight = weight[:, 0]
    if weight.dim() != 2 or weight.shape[0] != channels or not 1 <= weight.shape[1] <= MAX_TAPS:
        raise ValueError(f"weight must be (C, W) or (C, 1, W) with C = {channels} and 1 <= W <= {MAX_TAPS}; got "
                         f"{tuple(weight.shape)}")
    if bias is not None and bias.shape != (channels,):
        raise ValueError(f"bias must be ({channels},), got {tuple(bias.shape)}")
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is not None and (t.dtype not in KERNEL_DTYPES or t.device != x.device):
            raise ValueError(f"{name} must be float16, bfloat16 or float32 on {x.device}; got {t.dtype} on {t.device}")
    if x.stride(2) != 1:
        raise ValueError(f"x needs contiguous rows (stride 1 along length); got strides {x.stride()}")


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  activation: str = "silu") -> torch.Tensor:
    """act(depthwise causal conv1d of x (B, C, L) with weight (C, W) or (C, 1, W) + bias (C,)).

    Returns (B, C, L) in x's dtype, contiguous, computed in fp32 and rounded once."""
    check_causal_conv1d_inputs(x, weight, bias, activation)
    taps = weight.shape[-1]
    weight = weight.reshape(x.shape[1], taps).contiguous()
    batch, channels, length = x.shape
    y = torch.empty((batch, channels, length), dtype=x.dtype, device=x.device)
    block_c, block_l = conv_tile(length)
    grid = (triton.cdiv(length, block_l), triton.cdiv(channels, block_c), batch)
    causal_conv1d_kernel[grid](x, weight, bias.contiguous() if bias is not None else weight, y, channels, length,
                               x.stride(0), x.stride(1), TAPS=taps, HAS_BIAS=bias is not None,
                               SILU=activation == "silu", BLOCK_C=block_c, BLOCK_L=block_l, num_warps=4)
    return y


def causal_conv1d_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                            activation: str = "silu") -> torch.Tensor:
    """The same math in float64 (unrounded), through F.conv1d with left padding."""
    taps = weight.shape[-1]
    w = weight.reshape(x.shape[1], 1, taps).double()
    y = torch.nn.functional.conv1d(torch.nn.functional.pad(x.double(), (taps - 1, 0)), w,
                                   None if bias is None else bias.double(), groups=x.shape[1])
    return torch.nn.functional.silu(y) if activation == "silu" else y


def causal_conv1d_min_bytes(batch: int, channels: int, length: int, taps: int, itemsize: int = 2) -> int:
    """HBM bytes the op must move: x read once, y written once, the filters and bias read."""
    return 2 * batch * channels * length * itemsize + channels * (taps + 1) * itemsize

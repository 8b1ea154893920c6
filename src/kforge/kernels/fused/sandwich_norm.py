"""The "sandwich" norms around a residual add (Gemma 2 / Gemma 3): normalize a sublayer's output,
add it to the residual stream, normalize the sum for the next sublayer, one pass, in Triton.

The math, per row of H values (RMSNorm with Gemma's (offset + w) weights; offset 1.0 for
Gemma, whose weights are stored as deviations from 1, 0.0 for Llama-style weights):

    a = x / sqrt(mean(x^2) + eps) * (offset + w_post)    post-attention (or post-MLP) norm
    h = residual + round(a)                               the new residual stream
    y = h / sqrt(mean(h^2) + eps) * (offset + w_pre)      the next sublayer's input norm

returning (y, h). Each norm is computed in fp32 and rounded once to x's dtype, as Gemma's
RMSNorm does (`output.type_as(x)`), and h is rounded before its statistics, as eager adds.

What fusing saves. Eager runs each Gemma RMSNorm as ~7 kernels (upcast, square, mean,
rsqrt, scale, weight, downcast: ~18 bytes moved per bf16 element) and the add as one more
(6 bytes): ~42 bytes per element, ~15 launches. Here: x and the residual read, h and y
written, 8 bytes; a never leaves registers.

Choices, each for the H100 (as `serving/norms.py`'s register path): whole rows in
registers (H <= 16384; Gemma widths 2304-5376), short rows packed to ~2048 elements a
program, 16 elements a thread; both weights stay in L2 (evict_last); 64-bit row offsets.

Expected on the H100 (not measured here): ~85-90% of copy bandwidth on 8 bytes an element
(~180 us at 16384 x 3584).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_ROW = 16384
TILE = 2048


@triton.jit
def _rms_scaled(v, w_ptr, cols, hidden, offset, eps):
    w = tl.load(w_ptr + cols, mask=cols < hidden, other=0.0, eviction_policy="evict_last").to(tl.float32)
    return v * tl.rsqrt(tl.sum(v * v, 1) / hidden + eps)[:, None] * (offset + w)[None, :]


@triton.jit
def sandwich_norm_kernel(x_ptr, res_ptr, w_post_ptr, w_pre_ptr, y_ptr, h_ptr, n_rows, hidden, x_stride, res_stride,
                         offset, eps, BLOCK_ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_H)
    mask = (rows < n_rows)[:, None] & (cols < hidden)[None, :]
    rows = rows.to(tl.int64)
    x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    r = tl.load(res_ptr + rows[:, None] * res_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    a = _rms_scaled(x, w_post_ptr, cols, hidden, offset, eps).to(h_ptr.dtype.element_ty).to(tl.float32)
    h = (r + a).to(h_ptr.dtype.element_ty)
    out = rows[:, None] * hidden + cols[None, :]
    tl.store(h_ptr + out, h, mask=mask)
    y = _rms_scaled(h.to(tl.float32), w_pre_ptr, cols, hidden, offset, eps)
    tl.store(y_ptr + out, y.to(y_ptr.dtype.element_ty), mask=mask)


def norm_tile(hidden: int) -> tuple[int, int, int]:
    """(BLOCK_ROWS, BLOCK_H, num_warps): whole rows, packed to TILE elements, 16 a thread."""
    block_h = triton.next_power_of_2(hidden)
    block_rows = max(1, TILE // block_h)
    return block_rows, block_h, min(16, max(4, block_rows * block_h // 512))


def check_sandwich_norm_inputs(x, residual, w_post, w_pre, eps) -> None:
    """Raise ValueError on anything the kernel cannot take."""
    if x.dim() == 0 or x.shape[-1] == 0 or residual.shape != x.shape:
        raise ValueError(f"x and residual must share one shape (..., H) with H > 0; got {tuple(x.shape)} and "
                         f"{tuple(residual.shape)}")
    hidden = x.shape[-1]
    if hidden > MAX_ROW:
        raise ValueError(f"rows of {hidden} elements: at most {MAX_ROW} are held in registers")
    if x.dtype not in KERNEL_DTYPES or residual.dtype != x.dtype:
        raise ValueError(f"x and residual must share one dtype of float16, bfloat16, float32; got {x.dtype} and "
                         f"{residual.dtype}")
    for name, w in (("w_post", w_post), ("w_pre", w_pre)):
        if w.shape != (hidden,) or w.dtype not in KERNEL_DTYPES:
            raise ValueError(f"{name} must be a float vector of H = {hidden}, got {w.dtype} {tuple(w.shape)}")
    if not x.device == residual.device == w_post.device == w_pre.device:
        raise ValueError("x, residual and both weights must share a device")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps}")


def _rows(t: torch.Tensor) -> torch.Tensor:
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(1) == 1 else rows.contiguous()


def sandwich_norm(x: torch.Tensor, residual: torch.Tensor, w_post: torch.Tensor, w_pre: torch.Tensor,
                  eps: float = 1e-6, *, weight_offset: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, h): h = residual + rmsnorm(x) * (weight_offset + w_post), y = rmsnorm(h) *
    (weight_offset + w_pre), both in x's dtype, new and contiguous."""
    check_sandwich_norm_inputs(x, residual, w_post, w_pre, eps)
    x_rows, res_rows = _rows(x), _rows(residual)
    n_rows, hidden = x_rows.shape
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if n_rows:
        block_rows, block_h, warps = norm_tile(hidden)
        sandwich_norm_kernel[(triton.cdiv(n_rows, block_rows),)](
            x_rows, res_rows, w_post.contiguous(), w_pre.contiguous(), y, h, n_rows, hidden, x_rows.stride(0),
            res_rows.stride(0), float(weight_offset), float(eps), BLOCK_ROWS=block_rows, BLOCK_H=block_h,
            num_warps=warps)
    return y, h


def sandwich_norm_reference(x, residual, w_post, w_pre, eps: float = 1e-6, *, weight_offset: float = 1.0):
    """Gemma's eager RMSNorm twice around the add, with x's roundings (float64 inputs: none)."""
    def norm(v, w):
        vf = v.double() if v.dtype == torch.float64 else v.float()
        out = vf * torch.rsqrt(vf.pow(2).mean(-1, keepdim=True) + eps) * (weight_offset + w.to(vf.dtype))
        return out.type_as(v)

    h = residual + norm(x, w_post)
    return norm(h, w_pre), h


def sandwich_norm_min_bytes(rows: int, hidden: int, itemsize: int = 2) -> int:
    """HBM bytes: x and the residual read, h and y written, both weights once."""
    return 4 * rows * hidden * itemsize + 2 * hidden * itemsize

"""Residual add, RMSNorm and per-row FP8 quantization in one pass, in Triton: the input of an
FP8 GEMM (attention or MLP) straight from the residual stream.

The math, per row of H values in bf16 (the rounding steps are eager's, one by one):

    h      = bf16(x + r)                                      the new residual stream
    normed = bf16(h / sqrt(mean(h^2) + eps))                  Hugging Face LlamaRMSNorm ...
    y      = bf16(w * normed)                                 ... then its weight
    s      = amax(|y|) / 448   (1.0 for an all-zero row)      fp32, one scale per row
    q      = e4m3(y / s)       round to nearest even, saturating at +-448

which is `quant.formats.quantize_fp8_rowwise` applied to eager's RMSNorm output: the
result is bit for bit what the eager chain computes, up to the last bits of the mean of
squares and of rsqrt (the sum runs in another order, rsqrt is the approximate
instruction), which move a bf16 rounding of `normed` about once in 10^5 elements.

What fusing saves. Eager: the add (read 2, write 1), the norm's seven kernels (upcast,
square, mean, rsqrt, scale, downcast, weight), then amax, divide, clamp and cast (each a
pass over the row): ~45 bytes per element, against 2 + 2 read, 2 + 1 written here (x
and r in; h and q out; the row's scale is 4 bytes). One launch.

Exact on the CPU too: Triton's interpreter rounds fp32 -> bf16 by truncation and its
fp8 conversion drops carries, so the roundings go through `quant.quantize`'s bit-exact
helpers (`bf16_bits`, `fp8_code`), which on a GPU are the hardware's cvt.rn
instructions. Divisions are IEEE (`div_rn`), as torch's.

Choices, each for the H100: whole rows in registers (H <= 16384; Llama widths 4096-8192),
short rows packed to ~2048 elements a program, 16 elements a thread; the weight stays
in L2 (evict_last) while rows stream past; 64-bit row offsets.

Expected on the H100 (not measured here): ~85-90% of copy bandwidth on 7 bytes an
element (~310 us at 16384 x 8192), against eager's ~45 (~2 ms).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kforge.kernels.quant.quantize import bf16_bits, fp8_code, fp8_constants, hardware_cvt

MAX_ROW = 16384
TILE = 2048


@triton.jit
def round_bf16(y, HARDWARE_CVT: tl.constexpr):
    """fp32 y rounded to the nearest bf16 (ties to even), returned as fp32."""
    return (bf16_bits(y, HARDWARE_CVT).to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def add_rms_norm_fp8_kernel(x_ptr, res_ptr, w_ptr, q_ptr, scale_ptr, h_ptr, n_rows, hidden, x_stride, res_stride,
                            eps, FP8_MAX: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr,
                            MAX_MAG: tl.constexpr, HARDWARE_CVT: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                            BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_H)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols < hidden)[None, :]
    rows = rows.to(tl.int64)
    x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    r = tl.load(res_ptr + rows[:, None] * res_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    out = rows[:, None] * hidden + cols[None, :]
    h_bits = bf16_bits(x + r, HARDWARE_CVT)
    tl.store(h_ptr + out, h_bits, mask=mask)
    h = (h_bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    rstd = tl.rsqrt(tl.sum(h * h, 1) / hidden + eps)
    normed = round_bf16(h * rstd[:, None], HARDWARE_CVT)
    w = tl.load(w_ptr + cols, mask=cols < hidden, other=0.0, eviction_policy="evict_last").to(tl.float32)
    y = round_bf16(w[None, :] * normed, HARDWARE_CVT)
    scale = tl.math.div_rn(tl.max(tl.abs(y), 1), tl.full([BLOCK_ROWS], FP8_MAX, tl.float32))
    scale = tl.where(scale == 0, 1.0, scale)
    tl.store(scale_ptr + rows, scale, mask=row_ok)
    q = fp8_code(tl.math.div_rn(y, tl.broadcast_to(scale[:, None], y.shape)), FP8_MAX, MANT, BIAS, MAX_MAG,
                 HARDWARE_CVT)
    tl.store(q_ptr + out, q, mask=mask)


def norm_tile(hidden: int) -> tuple[int, int, int]:
    """(BLOCK_ROWS, BLOCK_H, num_warps): whole rows, packed to TILE elements, 16 a thread."""
    block_h = triton.next_power_of_2(hidden)
    block_rows = max(1, TILE // block_h)
    return block_rows, block_h, min(16, max(4, block_rows * block_h // 512))


def check_add_rms_norm_fp8_inputs(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """Raise ValueError on anything the kernel cannot take."""
    if x.dim() == 0 or x.shape[-1] == 0 or residual.shape != x.shape:
        raise ValueError(f"x and residual must share one shape (..., H) with H > 0; got {tuple(x.shape)} and "
                         f"{tuple(residual.shape)}")
    if x.dtype != torch.bfloat16 or residual.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        raise ValueError(f"x, residual and weight must be bfloat16 (the rounding steps are bf16's); got {x.dtype}, "
                         f"{residual.dtype}, {weight.dtype}")
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must be ({x.shape[-1]},), got {tuple(weight.shape)}")
    if x.shape[-1] > MAX_ROW:
        raise ValueError(f"rows of {x.shape[-1]} elements: at most {MAX_ROW} are held in registers")
    if not x.device == residual.device == weight.device:
        raise ValueError(f"x, residual and weight must share a device; got {x.device}, {residual.device}, "
                         f"{weight.device}")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps}")


def _rows(t: torch.Tensor) -> torch.Tensor:
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(1) == 1 else rows.contiguous()


def add_rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6):
    """(q, scale, h): h = x + residual (bf16), q = e4m3 of RMSNorm(h) * weight per row with
    scale (..., 1) fp32, so q.float() * scale ~ the normed row. All outputs new and contiguous."""
    check_add_rms_norm_fp8_inputs(x, residual, weight, eps)
    x_rows, res_rows = _rows(x), _rows(residual)
    n_rows, hidden = x_rows.shape
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if n_rows:
        block_rows, block_h, warps = norm_tile(hidden)
        add_rms_norm_fp8_kernel[(triton.cdiv(n_rows, block_rows),)](
            x_rows, res_rows, weight.contiguous(), q.view(torch.uint8), scale, h.view(torch.int16), n_rows, hidden,
            x_rows.stride(0), res_rows.stride(0), float(eps), **fp8_constants(torch.float8_e4m3fn),
            HARDWARE_CVT=hardware_cvt(x), BLOCK_ROWS=block_rows, BLOCK_H=block_h, num_warps=warps)
    return q, scale, h


def add_rms_norm_fp8_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6):
    """The eager chain (as the level-2 problem writes it), quantized by `quant.formats`."""
    from kforge.kernels.quant.formats import quantize_fp8_rowwise

    h = x + residual
    hf = h.float()
    normed = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    q, scale = quantize_fp8_rowwise(weight * normed)
    return q, scale, h


def add_rms_norm_fp8_min_bytes(rows: int, hidden: int) -> int:
    """HBM bytes: x and residual read (bf16), h written (bf16), q written (1 byte), a scale
    per row, the weight once."""
    return rows * hidden * (2 + 2 + 2 + 1) + rows * 4 + hidden * 2

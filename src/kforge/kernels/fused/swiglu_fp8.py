"""SwiGLU and the down projection's FP8 input quantization in one pass, in Triton: silu(gate) * up
quantized per (1, 128) group of each row, the activation layout of DeepSeek-V3 / DeepGEMM.

The math, per row of a fused gate/up projection output x = [gate | up] (2H values, bf16;
the rounding steps are eager's, one by one):

    a      = bf16(silu(gate))                    F.silu on bf16 rounds its result
    y      = bf16(a * up)
    s_g    = amax_{k in g}(|y_k|) / 448          one fp32 scale per group g of 128 columns
                                                 (1.0 for an all-zero group)
    q_k    = e4m3(y_k / s_g)                     round to nearest even, saturating at +-448

which is `quant.formats.quantize_fp8_blockwise(y, block=(1, 128))` of eager's SwiGLU, bit
for bit up to the last bits of exp in the sigmoid (Triton's exp is the approximate
ex2 instruction, eager's expf is correctly rounded: about one bf16 rounding of `a` in
10^4 moves by an ulp).

What fusing saves. Eager: silu (read H, write H), the product (read 2H, write H), then
per group abs, amax, upcast, divide, clamp, cast (each a pass): ~33 bytes per output
element. Here: 4 read (gate and up), 1 written (q) and 4 bytes per 128 (the scale).

Exact on the CPU as well: roundings through `quant.quantize`'s bit-exact helpers
(see add_rms_norm_fp8.py), IEEE divisions (`div_rn`).

Choices, each for the H100: a program owns [BLOCK_ROWS, BLOCK_H] outputs (up to 2048
columns: 16 groups, viewed [BLOCK_ROWS, BLOCK_H / 128, 128] for the group max), 16
elements a thread over 4 warps; gate and up are two contiguous runs per row (16-byte
vectors); columns along grid axis 1; 64-bit row offsets.

Expected on the H100 (not measured here): ~85-90% of copy bandwidth on ~5 bytes an
output element (~400 us at 16384 x 14336), against eager's ~33.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kforge.kernels.fused.add_rms_norm_fp8 import round_bf16
from kforge.kernels.quant.quantize import fp8_code, fp8_constants, hardware_cvt

GROUP = 128
MAX_BLOCK_H = 2048
TILE = 2048


@triton.jit
def swiglu_fp8_kernel(x_ptr, q_ptr, scale_ptr, n_rows, hidden, x_stride, FP8_MAX: tl.constexpr,
                      MANT: tl.constexpr, BIAS: tl.constexpr, MAX_MAG: tl.constexpr, HARDWARE_CVT: tl.constexpr,
                      GROUP_SIZE: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols < hidden)[None, :]
    rows = rows.to(tl.int64)
    gate_ptrs = x_ptr + rows[:, None] * x_stride + cols[None, :]
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + hidden, mask=mask, other=0.0).to(tl.float32)
    a = round_bf16(tl.math.div_rn(gate, 1.0 + tl.exp(-gate)), HARDWARE_CVT)
    y = round_bf16(a * up, HARDWARE_CVT)
    groups = tl.reshape(y, (BLOCK_ROWS, BLOCK_H // GROUP_SIZE, GROUP_SIZE))
    amax = tl.max(tl.abs(groups), 2)
    scale = tl.math.div_rn(amax, tl.full(amax.shape, FP8_MAX, tl.float32))
    scale = tl.where(scale == 0, 1.0, scale)
    q = fp8_code(tl.reshape(tl.math.div_rn(groups, tl.broadcast_to(scale[:, :, None], groups.shape)),
                            (BLOCK_ROWS, BLOCK_H)), FP8_MAX, MANT, BIAS, MAX_MAG, HARDWARE_CVT)
    tl.store(q_ptr + rows[:, None] * hidden + cols[None, :], q, mask=mask)
    n_groups = hidden // GROUP_SIZE
    group_cols = tl.program_id(1) * (BLOCK_H // GROUP_SIZE) + tl.arange(0, BLOCK_H // GROUP_SIZE)
    tl.store(scale_ptr + rows[:, None] * n_groups + group_cols[None, :], scale,
             mask=row_ok[:, None] & (group_cols < n_groups)[None, :])


def swiglu_fp8_tile(hidden: int) -> tuple[int, int]:
    """(BLOCK_ROWS, BLOCK_H): whole groups, up to MAX_BLOCK_H columns, rows to make TILE outputs."""
    block_h = max(GROUP, min(triton.next_power_of_2(hidden), MAX_BLOCK_H))
    return max(1, TILE // block_h), block_h


def check_swiglu_fp8_input(x: torch.Tensor) -> None:
    """Raise ValueError on anything the kernel cannot take."""
    if x.dim() == 0 or x.shape[-1] == 0 or x.shape[-1] % (2 * GROUP):
        raise ValueError(f"x must be (..., 2H) with H a positive multiple of {GROUP} (gate then up); got shape "
                         f"{tuple(x.shape)}")
    if x.dtype != torch.bfloat16:
        raise ValueError(f"x must be bfloat16 (the rounding steps are bf16's), got {x.dtype}")


def swiglu_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scales): q (..., H) float8_e4m3fn of silu(x[..., :H]) * x[..., H:], scales
    (..., H / 128) fp32 per group of 128 columns; q.float() * scale ~ the SwiGLU output."""
    check_swiglu_fp8_input(x)
    hidden = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * hidden)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    q = torch.empty((*x.shape[:-1], hidden), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((*x.shape[:-1], hidden // GROUP), dtype=torch.float32, device=x.device)
    if rows.shape[0]:
        block_rows, block_h = swiglu_fp8_tile(hidden)
        grid = (triton.cdiv(rows.shape[0], block_rows), triton.cdiv(hidden, block_h))
        swiglu_fp8_kernel[grid](rows, q.view(torch.uint8), scales, rows.shape[0], hidden, rows.stride(0),
                                **fp8_constants(torch.float8_e4m3fn), HARDWARE_CVT=hardware_cvt(x), GROUP_SIZE=GROUP,
                                BLOCK_ROWS=block_rows, BLOCK_H=block_h, num_warps=4)
    return q, scales


def swiglu_fp8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager SwiGLU in bf16, quantized by `quant.formats` (2-D: rows of the flattened x)."""
    from kforge.kernels.quant.formats import quantize_fp8_blockwise

    gate, up = x.chunk(2, dim=-1)
    y = torch.nn.functional.silu(gate) * up
    q, scales = quantize_fp8_blockwise(y.reshape(-1, y.shape[-1]), block=(1, GROUP))
    return q.view(y.shape), scales.view(*y.shape[:-1], -1)


def swiglu_fp8_min_bytes(rows: int, hidden: int) -> int:
    """HBM bytes: gate and up read (bf16), q written (1 byte), a fp32 scale per 128 outputs."""
    return rows * hidden * (4 + 1) + rows * (hidden // GROUP) * 4

"""Cumulative sum along the last dimension in Triton: y[i, j] = sum_{j' <= j} x[i, j'].

The sum runs in fp32 (float32 input stays float32; fp16/bf16 accumulate in fp32 and round
each output once). A scan is a reduction that keeps every prefix: within a tile Triton's
`tl.cumsum` scans each thread's elements, then across the warp by shuffles, then across
warps through shared memory; along a row the tiles are chained by a carry, the total of
everything before the tile.
- Rows of up to 16384 elements sit in registers: one tile, no carry; short rows are
  packed several to a program.
- Longer rows are walked in 8192-element chunks, y = cumsum(chunk) + carry, carry += the
  chunk's total. The carry chains the chunks' arithmetic, not their loads.
The order of the additions differs from a sequential scan's, so results differ from
torch.cumsum's in the last bits of fp32 (both are within n * 2^-24 of exact).

Bytes: read E and write E an element; the roof is HBM bandwidth. Eager PyTorch's scan
along the innermost dimension (`tensor_kernel_scan_innermost_dim`) advances each row a
small block at a time, a block-wide barrier each step; how far that stays from the
bandwidth on long rows is what the Level 1 suite measures. Compiled for sm_90
(tests/kernels/test_reductions_sm90.py), the looped kernel takes 60 (bf16) to 76 (fp32)
registers a thread at 16 warps: one or two programs an SM, each with a 16-32 KB chunk of
loads in flight. Expected on the H100 (not measured here):
80-90% of copy bandwidth for thousands of rows; a handful of rows cannot fill 132 SMs
with one program a row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kforge.kernels.reductions.rows import as_rows, check_rows_input, row_plan


@triton.jit
def cumsum_rows_kernel(x_ptr, out_ptr, n_rows, n_cols, x_stride, out_stride,
                       BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_COLS)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    rows = rows.to(tl.int64)
    x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = tl.cumsum(x, 1)
    tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def cumsum_looped_kernel(x_ptr, out_ptr, n_cols, x_stride, out_stride, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row, out_row = x_ptr + row * x_stride, out_ptr + row * out_stride
    cols = tl.arange(0, CHUNK)
    carry = 0.0
    for start in range(0, n_cols, CHUNK):
        inside = start + cols < n_cols
        x = tl.load(x_row + start + cols, mask=inside, other=0.0).to(tl.float32)
        y = tl.cumsum(x, 0) + carry
        tl.store(out_row + start + cols, y.to(out_ptr.dtype.element_ty), mask=inside)
        carry += tl.sum(x, 0)


def cumsum_forward(x: torch.Tensor, *, chunk: int | None = None) -> torch.Tensor:
    """torch.cumsum(x, dim=-1) on the Triton kernels, x fp16/bf16/fp32 of any shape, same dtype out.
    `chunk` (a power of two) forces the looped path for rows longer than it."""
    check_rows_input(x, "cumsum")
    rows = as_rows(x)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    n_rows, n_cols = rows.shape
    if n_rows:
        plan = row_plan(n_cols, chunk)
        if plan.looped:
            cumsum_looped_kernel[plan.grid(n_rows)](rows, out, n_cols, rows.stride(0), out.stride(0),
                                                    CHUNK=plan.block_cols, num_warps=plan.num_warps)
        else:
            cumsum_rows_kernel[plan.grid(n_rows)](rows, out, n_rows, n_cols, rows.stride(0), out.stride(0),
                                                  BLOCK_ROWS=plan.block_rows, BLOCK_COLS=plan.block_cols,
                                                  num_warps=plan.num_warps)
    return out.view(x.shape)


def cumsum_reference(x: torch.Tensor) -> torch.Tensor:
    """The cumulative sum in float64, for checking."""
    return torch.cumsum(x.double(), dim=-1)

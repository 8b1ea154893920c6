"""Softmax over the last dimension in Triton: y = exp(x - max x) / sum exp(x - max x).

Statistics in fp32 whatever the input dtype; y is rounded once, to x's dtype (what
`torch.softmax` returns for fp16/bf16/fp32 input).

Bytes per element, E bytes each: read E, write E. A handful of FLOPs (one exp) per
element against 2E bytes: HBM-bound, the target is a copy's bandwidth.

Two paths (`rows.row_plan`):
- Rows of up to 16384 elements sit in registers: one read, the max and the sum reduced
  from registers, one write. Exactly the minimum traffic.
- Longer rows (a 128k vocabulary: 250 KB a bf16 row) cannot: pass 1 walks the row in
  8192-element chunks keeping the online max and sum (`rows.online_max_sum`, one exp an
  element), pass 2 reads it again, normalizes and writes. Pass 2 walks the chunks in
  reverse, so the chunks read last, the likeliest still in L2, come first; and a
  persistent grid of two programs an SM (`rows.resident_programs`) keeps few enough rows
  in flight for most of each row to still be in L2 then (rows.py says why). Eager
  PyTorch (cunn_SoftMaxForward, for rows too long for its shared memory) walks such a
  row three times: max, sum, then normalize.

Expected on the H100 (not measured here): the register path ~90% of copy bandwidth (the
example softmax of 8192-wide fp32 rows, one row a program, measured 98%); the looped
path between 2/3 (every re-read from HBM: 3 accesses instead of 2) and ~90% (every
re-read from L2) of the two-access roof; by the estimate in rows.py, ~80%.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kforge.kernels.reductions.rows import (as_rows, check_rows_input, finite_shift, online_max_sum,
                                            resident_programs, row_plan)


@triton.jit
def softmax_rows_kernel(x_ptr, out_ptr, n_rows, n_cols, x_stride, out_stride,
                        BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_COLS)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    rows = rows.to(tl.int64)
    x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=mask, other=-float("inf")).to(tl.float32)
    e = tl.exp(x - finite_shift(tl.max(x, 1))[:, None])
    y = e / tl.sum(e, 1)[:, None]
    tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def softmax_looped_kernel(x_ptr, out_ptr, n_rows, n_cols, x_stride, out_stride, CHUNK: tl.constexpr):
    cols = tl.arange(0, CHUNK)
    n_chunks = tl.cdiv(n_cols, CHUNK)
    for row in range(tl.program_id(0), n_rows, tl.num_programs(0)):  # persistent: rows in turn
        row64 = tl.cast(row, tl.int64)
        x_row, out_row = x_ptr + row64 * x_stride, out_ptr + row64 * out_stride
        m, s = online_max_sum(x_row, n_cols, CHUNK)
        shift, inv_sum = finite_shift(m), 1.0 / s
        for i in range(0, n_chunks):  # last chunk first: it is the likeliest still in L2
            offs = (n_chunks - 1 - i) * CHUNK + cols
            x = tl.load(x_row + offs, mask=offs < n_cols, other=-float("inf")).to(tl.float32)
            tl.store(out_row + offs, (tl.exp(x - shift) * inv_sum).to(out_ptr.dtype.element_ty),
                     mask=offs < n_cols)


def softmax_forward(x: torch.Tensor, *, chunk: int | None = None) -> torch.Tensor:
    """softmax(x) over the last dimension on the Triton kernels; x fp16/bf16/fp32 of any shape.
    `chunk` (a power of two) forces the looped path for rows longer than it (tests, sweeps)."""
    check_rows_input(x, "softmax")
    rows = as_rows(x)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    n_rows, n_cols = rows.shape
    if n_rows:
        plan = row_plan(n_cols, chunk)
        if plan.looped:
            softmax_looped_kernel[(resident_programs(x.device, n_rows),)](
                rows, out, n_rows, n_cols, rows.stride(0), out.stride(0), CHUNK=plan.block_cols,
                num_warps=plan.num_warps)
        else:
            softmax_rows_kernel[plan.grid(n_rows)](rows, out, n_rows, n_cols, rows.stride(0), out.stride(0),
                                                   BLOCK_ROWS=plan.block_rows, BLOCK_COLS=plan.block_cols,
                                                   num_warps=plan.num_warps)
    return out.view(x.shape)


def softmax_reference(x: torch.Tensor) -> torch.Tensor:
    """Softmax in float64 (exact to the last bits of fp32), for checking."""
    return torch.softmax(x.double(), dim=-1)


def softmax_min_bytes(rows: int, cols: int, dtype: torch.dtype) -> int:
    """HBM bytes a softmax must move: the input read once, the output written once."""
    return 2 * rows * cols * torch.empty((), dtype=dtype).element_size()

"""Log-softmax over the last dimension in Triton: y = x - (m + log sum exp(x - m)), m = max x.

The same two paths as softmax.py (rows in registers up to 16384 elements; longer rows in
two passes over chunks, the second in reverse, by a persistent grid sized for L2), with
one difference that makes it cheaper: the output needs no exp, only the row's
log-sum-exp, so pass 2 is a subtraction. Statistics in fp32, y rounded once to x's dtype.
Computing x - lse directly keeps tiny probabilities exact: log(softmax(x)) would take the
log of a probability that underflowed to 0 (e^-300 in fp32) and return -inf.

Bytes per element: read E, write E. Expected on the H100 (not measured here): as softmax.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kforge.kernels.reductions.rows import (as_rows, check_rows_input, finite_shift, online_max_sum,
                                            resident_programs, row_plan)


@triton.jit
def log_softmax_rows_kernel(x_ptr, out_ptr, n_rows, n_cols, x_stride, out_stride,
                            BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_COLS)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    rows = rows.to(tl.int64)
    x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=mask, other=-float("inf")).to(tl.float32)
    shift = finite_shift(tl.max(x, 1))
    lse = shift + tl.log(tl.sum(tl.exp(x - shift[:, None]), 1))
    tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :], (x - lse[:, None]).to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def log_softmax_looped_kernel(x_ptr, out_ptr, n_rows, n_cols, x_stride, out_stride, CHUNK: tl.constexpr):
    cols = tl.arange(0, CHUNK)
    n_chunks = tl.cdiv(n_cols, CHUNK)
    for row in range(tl.program_id(0), n_rows, tl.num_programs(0)):  # persistent: rows in turn
        row64 = tl.cast(row, tl.int64)
        x_row, out_row = x_ptr + row64 * x_stride, out_ptr + row64 * out_stride
        m, s = online_max_sum(x_row, n_cols, CHUNK)
        lse = m + tl.log(s)  # a row of only -inf: -inf, then x - lse = NaN, as eager
        for i in range(0, n_chunks):  # last chunk first: it is the likeliest still in L2
            offs = (n_chunks - 1 - i) * CHUNK + cols
            x = tl.load(x_row + offs, mask=offs < n_cols, other=0.0).to(tl.float32)
            tl.store(out_row + offs, (x - lse).to(out_ptr.dtype.element_ty), mask=offs < n_cols)


def log_softmax_forward(x: torch.Tensor, *, chunk: int | None = None) -> torch.Tensor:
    """log_softmax(x) over the last dimension on the Triton kernels; x fp16/bf16/fp32 of any shape.
    `chunk` (a power of two) forces the looped path for rows longer than it."""
    check_rows_input(x, "log_softmax")
    rows = as_rows(x)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    n_rows, n_cols = rows.shape
    if n_rows:
        plan = row_plan(n_cols, chunk)
        if plan.looped:
            log_softmax_looped_kernel[(resident_programs(x.device, n_rows),)](
                rows, out, n_rows, n_cols, rows.stride(0), out.stride(0), CHUNK=plan.block_cols,
                num_warps=plan.num_warps)
        else:
            log_softmax_rows_kernel[plan.grid(n_rows)](rows, out, n_rows, n_cols, rows.stride(0), out.stride(0),
                                                       BLOCK_ROWS=plan.block_rows, BLOCK_COLS=plan.block_cols,
                                                       num_warps=plan.num_warps)
    return out.view(x.shape)


def log_softmax_reference(x: torch.Tensor) -> torch.Tensor:
    """Log-softmax in float64, for checking."""
    return torch.log_softmax(x.double(), dim=-1)

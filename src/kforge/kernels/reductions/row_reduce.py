"""Row statistics in Triton: the mean and the variance of each row, in fp32, in one read.

    mean = sum(x) / n,    var = sum((x - mean)^2) / (n - correction)

(correction 1: the unbiased estimate, `torch.var`'s default; 0: the biased one a norm uses).
The variance is never taken as E[x^2] - E[x]^2, which cancels to noise when the mean is
large beside the spread (activations with a mean of 1e4 and a spread of 1 lose every
digit in fp32); it is a sum of squared deviations from the mean, computed exactly:
- rows of up to 16384 elements sit in registers: the mean first, then the deviations,
  from the same registers;
- longer rows are walked in 8192-element chunks; each chunk's own mean and sum of
  squared deviations are exact in registers, and merge into the row's running ones with
  Chan, Golub and LeVeque's pairwise update: for counts n_a, n_b and delta = mean_b - mean_a,
      mean = mean_a + delta n_b / n,   M2 = M2_a + M2_b + delta^2 n_a n_b / n.

Bytes: the input once (rows x n x E) and 8 bytes a row out: a streaming reduction, the
roof is HBM bandwidth. Eager `h = x.float(); h.mean(-1), h.var(-1)` on bf16 input writes
and reads back an fp32 copy and reads it twice more: 2 + 4 + 4 + 4 = 14 bytes an element
where 2 suffice. Expected on the H100 (not measured here): ~90% of copy bandwidth, as
any read-only reduction over thousands of rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kforge.kernels.reductions.rows import as_rows, check_rows_input, row_plan


@triton.jit
def row_mean_var_rows_kernel(x_ptr, mean_ptr, var_ptr, n_rows, n_cols, x_stride, correction,
                             BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_COLS)
    keep = rows < n_rows
    mask = keep[:, None] & (cols < n_cols)[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * x_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, 1) / n_cols
    deviation = tl.where(mask, x - mean[:, None], 0.0)
    var = tl.sum(deviation * deviation, 1) / (n_cols - correction)
    tl.store(mean_ptr + rows, mean, mask=keep)
    tl.store(var_ptr + rows, var, mask=keep)


@triton.jit
def row_mean_var_looped_kernel(x_ptr, mean_ptr, var_ptr, n_cols, x_stride, correction, CHUNK: tl.constexpr):
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * x_stride
    cols = tl.arange(0, CHUNK)
    count = 0.0
    mean = 0.0
    m2 = 0.0
    for start in range(0, n_cols, CHUNK):
        inside = start + cols < n_cols
        x = tl.load(x_row + start + cols, mask=inside, other=0.0).to(tl.float32)
        chunk_count = tl.minimum(n_cols - start, CHUNK).to(tl.float32)
        chunk_mean = tl.sum(x, 0) / chunk_count
        deviation = tl.where(inside, x - chunk_mean, 0.0)
        total = count + chunk_count
        delta = chunk_mean - mean
        mean += delta * (chunk_count / total)
        m2 += tl.sum(deviation * deviation, 0) + delta * delta * (count * chunk_count / total)
        count = total
    tl.store(mean_ptr + row, mean)
    tl.store(var_ptr + row, m2 / (n_cols - correction))


def row_mean_var(x: torch.Tensor, *, correction: int = 1, chunk: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, var) of x over its last dimension, both fp32 of x's leading shape; x fp16/bf16/fp32.
    var divides by n - correction (a row of n <= correction gives inf or NaN, as torch.var).
    `chunk` (a power of two) forces the looped path for rows longer than it."""
    check_rows_input(x, "row_mean_var")
    if correction < 0:
        raise ValueError(f"correction must be >= 0, got {correction}")
    rows = as_rows(x)
    n_rows, n_cols = rows.shape
    mean = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    var = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if n_rows:
        plan = row_plan(n_cols, chunk)
        if plan.looped:
            row_mean_var_looped_kernel[plan.grid(n_rows)](rows, mean, var, n_cols, rows.stride(0), float(correction),
                                                          CHUNK=plan.block_cols, num_warps=plan.num_warps)
        else:
            row_mean_var_rows_kernel[plan.grid(n_rows)](rows, mean, var, n_rows, n_cols, rows.stride(0),
                                                        float(correction), BLOCK_ROWS=plan.block_rows,
                                                        BLOCK_COLS=plan.block_cols, num_warps=plan.num_warps)
    return mean.view(x.shape[:-1]), var.view(x.shape[:-1])


def row_mean_var_reference(x: torch.Tensor, *, correction: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, var) over the last dimension in float64, for checking."""
    h = x.double()
    return h.mean(-1), h.var(-1, correction=correction)


def row_mean_var_min_bytes(rows: int, cols: int, dtype: torch.dtype) -> int:
    """HBM bytes: the input read once, two fp32 statistics a row written."""
    return rows * cols * torch.empty((), dtype=dtype).element_size() + 8 * rows

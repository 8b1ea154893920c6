"""What the row kernels of this family share: the (rows, columns) view, the tile plan, and
the online max / sum of exponentials.

Every op here reduces along the last dimension. A tensor of any leading shape is viewed
as (rows, n) with a unit column stride (a view when one exists, else a copy), each row
at its own stride.

The tile plan (`row_plan`): rows of up to MAX_ROW_IN_REGISTERS elements are held whole
in registers (one read; the op's result is computed from the registers), short rows
packed several to a program so a program moves at least MIN_TILE elements; longer rows
are walked in chunks of CHUNK elements, once per pass the op needs. Warps: 16 elements a
thread (two 16-byte vectors of bf16, four of fp32), up to 16 warps (so 32 a thread for a
16384-wide row). Compiled for sm_90
(tests/kernels/test_reductions_sm90.py), the softmax, log-softmax, cross-entropy and
statistics kernels use 32-40 registers a thread on the looped path and 51-63 on the
16384-wide register tile (the scans of cumsum take more: 60-87), without spills.

Two-pass kernels (softmax, log-softmax) read each long row twice, and the second read is
cheap only if the row is still in L2. What decides that is how many rows are in flight:
the 50 MB L2 holds the last ~17 us of traffic at 3 TB/s, and a row's first pass takes as
long as its program's share of the bandwidth allows. Their looped path therefore runs a
persistent grid of RESIDENT_ROWS_PER_SM programs an SM (`resident_programs`), each taking
rows in turn: 264 rows in flight on an H100, each first pass of a 250 KB bf16 row ~22 us,
so most of the row (read back last chunk first) is still in L2 when pass 2 starts. 16 KB
of bf16 loads a program a chunk, 32 KB an SM, meets Little's law (~23 KB at ~1 us).

The online max and sum (`online_max_sum`), for a row walked in chunks: after each chunk,
m is the largest value seen and s = sum of exp(x - m) over the values seen. A new chunk
with maximum c moves the running max to m' = max(m, c), and

    s' = s * exp(m - m') + sum over the chunk of exp(x - m'),

so one read of the row gives both (Milakov and Gimelshein's online softmax, one scalar
rescale a chunk). -inf entries (masked logits) contribute exp(-inf) = 0; while every
value seen is -inf the shift is taken as 0 instead of m' = -inf, so no -inf - -inf = NaN
enters s. A row of only -inf ends with s = 0, and the ops then produce what eager PyTorch
does: NaN, for softmax and log-softmax alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kforge.device import sm_count

MAX_ROW_IN_REGISTERS = 16384
CHUNK = 8192
MIN_TILE = 2048
RESIDENT_ROWS_PER_SM = 2  # two-pass kernels: rows in flight, so a row's second read finds it in L2
INTERPRETER_SMS = 4
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class RowPlan:
    block_rows: int  # rows a program holds (register path)
    block_cols: int  # the padded row (register path) or the chunk (looped path)
    looped: bool
    num_warps: int

    def grid(self, n_rows: int) -> tuple[int]:
        return (n_rows,) if self.looped else (triton.cdiv(n_rows, self.block_rows),)


def row_plan(n_cols: int, chunk: int | None = None) -> RowPlan:
    """The tile for rows of n_cols: whole rows up to MAX_ROW_IN_REGISTERS, else chunks of CHUNK.
    `chunk` (a power of two >= 16) forces the looped path whenever the row is longer than it."""
    if chunk is not None and (chunk < 16 or chunk & (chunk - 1)):
        raise ValueError(f"chunk must be a power of two >= 16, got {chunk}")
    padded = triton.next_power_of_2(max(1, n_cols))
    cap = MAX_ROW_IN_REGISTERS if chunk is None else chunk
    if padded <= cap:
        block_rows = max(1, MIN_TILE // padded)
        return RowPlan(block_rows, padded, False, warps_for(block_rows * padded))
    block = CHUNK if chunk is None else chunk
    return RowPlan(1, block, True, warps_for(block))


def resident_programs(device: torch.device, n_rows: int) -> int:
    """Programs of a persistent two-pass grid: RESIDENT_ROWS_PER_SM an SM (INTERPRETER_SMS off the GPU)."""
    if device.type != "cuda":
        return min(n_rows, RESIDENT_ROWS_PER_SM * INTERPRETER_SMS)
    return min(n_rows, RESIDENT_ROWS_PER_SM * sm_count(device))


def warps_for(tile: int) -> int:
    """16 elements a thread, 4 to 16 warps."""
    return min(16, max(4, tile // 512))


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x as (rows, n) with a unit column stride: a view where one exists, else a copy."""
    rows = x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)
    return rows if rows.stride(1) == 1 or rows.shape[1] <= 1 else rows.contiguous()


def check_rows_input(x: torch.Tensor, what: str) -> None:
    """ValueError unless x is a floating-point tensor of a kernel dtype with a non-empty last dim."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{what} takes a tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{what} takes float16, bfloat16 or float32, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"{what} needs a non-empty last dimension, got shape {tuple(x.shape)}")


@triton.jit
def online_max_sum(row_ptr, n_cols, CHUNK: tl.constexpr):
    """(m, s) of one row walked in CHUNK-element chunks: m = max x, s = sum exp(x - m) (module docstring)."""
    cols = tl.arange(0, CHUNK)
    m = -float("inf")
    s = 0.0
    for start in range(0, n_cols, CHUNK):
        x = tl.load(row_ptr + start + cols, mask=start + cols < n_cols, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        shift = tl.where(m_new == -float("inf"), 0.0, m_new)
        s = s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), 0)
        m = m_new
    return m, s


@triton.jit
def finite_shift(m):
    """m where it is finite, 0 where a row held only -inf (so x - shift stays -inf, not NaN)."""
    return tl.where(m == -float("inf"), 0.0, m)

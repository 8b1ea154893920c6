"""Row softmax in TileLang: y = exp(x - max x) / sum exp(x - max x), bf16 in and out, fp32 inside.

The algorithm of the other levels: one CTA a row, two passes (a 128k-entry row is too long
for registers). Pass 1 keeps, per element slot of a CHUNK-wide fragment, a running max m
and sum s of exp(x - m), one exp an element (e = exp(-|x - m|): s += e if x <= m, else
s = s * e + 1, m = x); `T.reduce_max` and `T.reduce_sum` combine the slots once; pass 2
re-reads the row (from L2, mostly) and writes exp(x - M) / S. Everything is in base 2.

What the kernel names: the fragments (registers spread over the CTA) and the loops over
them, `T.Parallel` for the elementwise ones. What TileLang infers: the fragment's layout
(8 consecutive elements a thread, so a CHUNK is one coalesced sweep of 16-byte loads), the
vectorization, the bounds check (at the granularity of a vector, since the row's length
is a multiple of 8), and the reductions across threads (shuffles, then shared memory).
The kernel is compiled per row length (a constant); the number of rows is a runtime size.
"""

from __future__ import annotations

from functools import cache

import tilelang
import tilelang.language as T
import torch

VECTOR = 8  # bf16 a thread loads at once: 16 bytes
THREADS = 512
CHUNK = VECTOR * THREADS  # elements of a row the CTA holds per step
LOG2E = 1.4426950408889634
TARGET = {"kind": "cuda", "arch": "sm_90a"}


def softmax_program(cols: int):
    """The TileLang program for rows of `cols` entries (a TIR PrimFunc): what `tilelang.compile` lowers."""
    rows = T.dynamic("rows")
    minus_infinity = -T.infinity("float32")

    @T.prim_func
    def softmax_kernel(X: T.Tensor((rows, cols), "bfloat16"), Y: T.Tensor((rows, cols), "bfloat16")):
        with T.Kernel(rows, threads=THREADS) as row:
            x = T.alloc_fragment((CHUNK,), "float32")
            slot_max = T.alloc_fragment((CHUNK,), "float32")
            slot_sum = T.alloc_fragment((CHUNK,), "float32")
            row_max = T.alloc_fragment((1,), "float32")
            row_sum = T.alloc_fragment((1,), "float32")
            T.fill(slot_max, minus_infinity)
            T.fill(slot_sum, 0.0)

            # Pass 1: per-slot running max and sum of exp2(x - max), one exp2 an element.
            for step in T.serial(T.ceildiv(cols, CHUNK)):
                for i in T.Parallel(CHUNK):
                    col = step * CHUNK + i
                    x[i] = T.if_then_else(col < cols, T.cast(X[row, col], "float32") * LOG2E, minus_infinity)
                for i in T.Parallel(CHUNK):
                    rises = x[i] > slot_max[i]
                    # exp2(-|x - m|), and 0 for a masked (or -inf) x, even while the slot's max is -inf too
                    scale = T.if_then_else(x[i] == minus_infinity, 0.0,
                                           T.exp2(T.if_then_else(rises, slot_max[i] - x[i], x[i] - slot_max[i])))
                    slot_sum[i] = T.if_then_else(rises, slot_sum[i] * scale + 1.0, slot_sum[i] + scale)
                    slot_max[i] = T.max(slot_max[i], x[i])

            # The row's statistics: each slot's sum rescaled to the row's max, then summed.
            T.reduce_max(slot_max, row_max, dim=0)
            for i in T.Parallel(CHUNK):
                slot_sum[i] = slot_sum[i] * T.exp2(slot_max[i] - row_max[0])
            T.reduce_sum(slot_sum, row_sum, dim=0)

            # Pass 2: normalize and write, rounded once to bf16.
            for step in T.serial(T.ceildiv(cols, CHUNK)):
                for i in T.Parallel(CHUNK):
                    col = step * CHUNK + i
                    if col < cols:
                        y = T.exp2(T.cast(X[row, col], "float32") * LOG2E - row_max[0]) / row_sum[0]
                        Y[row, col] = T.cast(y, "bfloat16")

    return softmax_kernel


@cache
def compiled(cols: int):
    """The kernel for rows of `cols` entries, compiled for sm_90a (TileLang runs nvcc); Y is its output."""
    return tilelang.compile(softmax_program(cols), out_idx=[1], target=TARGET)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """softmax(x, dim=-1) for a contiguous 2-D bf16 x whose rows are 16-byte aligned (columns % 8 == 0)."""
    if x.dtype != torch.bfloat16 or x.dim() != 2 or not x.is_contiguous() or x.shape[1] % VECTOR:
        raise ValueError(f"tilelang_softmax: needs a contiguous 2-D bf16 tensor with a multiple of {VECTOR} "
                         f"columns, got {x.dtype} {tuple(x.shape)}")
    if not x.numel():
        return torch.empty_like(x)
    return compiled(x.shape[1])(x)

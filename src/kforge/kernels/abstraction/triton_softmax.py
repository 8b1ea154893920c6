"""Row softmax in Triton: the abstraction ladder's Triton level, the same algorithm as the Gluon one.

y = exp(x - max x) / sum exp(x - max x) per row, bf16 in and out, fp32 inside. One program
a row and two passes: pass 1 keeps a running max m and sum s of exp(x - m) per element
slot of a CHUNK-wide vector, one exp an element (s' = s + e if x <= m, s * e + 1 if x > m,
with e = exp(-|x - m|)); the slots are combined once; pass 2 re-reads the row (from L2,
mostly) and writes exp(x - M) / S. Memory-bound: two reads and a write of the row.

What Triton leaves implicit and Gluon spells out: how CHUNK elements spread over threads
(Triton picks 16-byte vectors from the alignment it infers), and where the two final
reductions go through shared memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 2048  # elements of a row a program holds per step: 8 per thread at 8 warps
NUM_WARPS = 8
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def softmax_kernel(x_ptr, y_ptr, n_cols, CHUNK: tl.constexpr):
    offsets = tl.arange(0, CHUNK)
    row = tl.program_id(0).to(tl.int64) * n_cols
    slot_max = tl.full([CHUNK], -float("inf"), tl.float32)
    slot_sum = tl.zeros([CHUNK], tl.float32)
    for start in range(0, n_cols, CHUNK):  # pass 1: statistics, in base 2
        cols = start + offsets
        x = tl.load(x_ptr + row + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32) * LOG2E
        rises = x > slot_max
        scale = tl.where(x == -float("inf"), 0.0, tl.exp2(tl.where(rises, slot_max - x, x - slot_max)))
        slot_sum = tl.where(rises, slot_sum * scale + 1.0, slot_sum + scale)
        slot_max = tl.maximum(slot_max, x)
    row_max = tl.max(slot_max, 0)
    inverse = 1.0 / tl.sum(slot_sum * tl.exp2(slot_max - row_max), 0)
    for start in range(0, n_cols, CHUNK):  # pass 2: normalize, round once
        cols = start + offsets
        mask = cols < n_cols
        x = tl.load(x_ptr + row + cols, mask=mask, other=-float("inf")).to(tl.float32) * LOG2E
        tl.store(y_ptr + row + cols, (tl.exp2(x - row_max) * inverse).to(y_ptr.dtype.element_ty), mask=mask)


def softmax(x: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """softmax(x, dim=-1) for a contiguous 2-D x (bf16 on the ladder; any float dtype works).
    `chunk` (a power of 2): the CPU tests use a small one under the Triton interpreter."""
    if x.dim() != 2 or not x.is_contiguous() or not x.is_floating_point():
        raise ValueError(f"triton_softmax: needs a contiguous 2-D float tensor, got {x.dtype} {tuple(x.shape)}")
    y = torch.empty_like(x)
    if x.numel():
        softmax_kernel[(x.shape[0],)](x, y, x.shape[1], CHUNK=chunk, num_warps=NUM_WARPS)
    return y

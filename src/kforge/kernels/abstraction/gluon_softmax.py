"""Row softmax in Gluon: y = exp(x - max x) / sum exp(x - max x), bf16 in and out, fp32 inside.

One CTA a row, two passes over it (a 128k-entry row is too long for registers):
pass 1 keeps, in each lane, a running max m and a running sum s of exp(x - m) over its
share of the row; pass 2 reads the row again (from L2, mostly) and writes exp(x - M) / S
with the row's M and S combined from the lanes. The row's bytes cross HBM twice: it is
memory-bound, and the target is a copy's bandwidth.

What Gluon makes explicit is the register layout Triton would pick: a BlockedLayout of 8
consecutive bf16 a thread (one 16-byte load), 32 threads a warp, the warps side by side,
so a chunk of 8 x 32 x num_warps elements is one fully coalesced sweep. The lanes' state
is a tensor in that same layout; only the two reductions at the end cross threads.

The online update costs one exp an element: with d = x - m, either x <= m and
s += exp(d), or x > m and s = s * exp(-d) + 1, m = x; both are s' = f(exp(-|d|)).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

VECTOR = 8  # bf16 elements a thread loads at once: 16 bytes
NUM_WARPS = 8
LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def softmax_kernel(x_ptr, y_ptr, n_cols, VECTOR: gl.constexpr, num_warps: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[VECTOR], threads_per_warp=[32],
                                            warps_per_cta=[num_warps], order=[0])
    CHUNK: gl.constexpr = VECTOR * 32 * num_warps
    offsets = gl.arange(0, CHUNK, layout=layout)
    row = gl.program_id(0).to(gl.int64) * n_cols
    x_row = x_ptr + row
    y_row = y_ptr + row

    # Pass 1: per-lane running max and sum of exp(x - max), one exp2 an element.
    lane_max = gl.full([CHUNK], -float("inf"), gl.float32, layout)
    lane_sum = gl.zeros([CHUNK], gl.float32, layout)
    for start in range(0, n_cols, CHUNK):
        cols = start + offsets
        x = gl.load(x_row + cols, mask=cols < n_cols, other=-float("inf")).to(gl.float32) * LOG2E
        rises = x > lane_max
        # exp2(-|x - m|), and 0 for a masked (or -inf) x, even while the lane's max is -inf too
        scale = gl.where(x == -float("inf"), 0.0, gl.exp2(gl.where(rises, lane_max - x, x - lane_max)))
        lane_sum = gl.where(rises, lane_sum * scale + 1.0, lane_sum + scale)
        lane_max = gl.maximum(lane_max, x)

    # The row's statistics: each lane's sum rescaled to the row's max, then summed.
    row_max = gl.max(lane_max, axis=0)
    row_sum = gl.sum(lane_sum * gl.exp2(lane_max - row_max), axis=0)
    inverse = 1.0 / row_sum

    # Pass 2: normalize and write, rounded once to bf16.
    for start in range(0, n_cols, CHUNK):
        cols = start + offsets
        mask = cols < n_cols
        x = gl.load(x_row + cols, mask=mask, other=-float("inf")).to(gl.float32) * LOG2E
        gl.store(y_row + cols, (gl.exp2(x - row_max) * inverse).to(gl.bfloat16), mask=mask)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """softmax(x, dim=-1) for a contiguous 2-D bf16 x whose rows are 16-byte aligned (columns % 8 == 0)."""
    if x.dtype != torch.bfloat16 or x.dim() != 2 or not x.is_contiguous() or x.shape[1] % VECTOR:
        raise ValueError(f"gluon_softmax: needs a contiguous 2-D bf16 tensor with a multiple of {VECTOR} columns, "
                         f"got {x.dtype} {tuple(x.shape)}")
    y = torch.empty_like(x)
    if x.numel():
        softmax_kernel[(x.shape[0],)](x, y, x.shape[1], VECTOR=VECTOR, num_warps=NUM_WARPS)
    return y

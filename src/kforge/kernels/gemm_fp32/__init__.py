"""The fp32 GEMM ladder on CUDA cores: C = A @ B, from a naive kernel to a tuned one.

Each rung is one numbered `.cu` file beside this one, opening with what it changed, why,
and what it should buy; `kforge ladder gemm --dtype fp32` runs them all through the
harness against cuBLAS (torch.matmul with TF32 off). This module only knows how to
launch them: which file, which grid and block for a given shape.

Every rung takes the same arguments, `sgemm(A, B, C, M, N, K)`, row-major fp32, and
handles any size (tails of partial tiles and of sizes that are not multiples of 4).

The work: 2*M*N*K flops over (M*K + K*N + M*N) * 4 bytes; at 4096^3 that is 137 GFLOP
against 201 MB, ~680 flops per byte, far above the H100's ~20 fp32 flops per byte of
HBM: compute-bound. The floor is the fp32 FMA rate: 132 SMs x 128 lanes x 2 flops x
1.98 GHz = 67 TFLOP/s (2.05 ms at 4096^3); cuBLAS reaches about three quarters of it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from kforge.kernels import RungSource
from kforge.runtime.cuda import CudaKernel, LaunchError

HERE = Path(__file__).parent


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Rung(RungSource):
    directory = HERE
    block: Callable[[Mapping[str, int]], tuple[int, int]]  # from the source's parameters
    grid: Callable[[Mapping[str, int], int, int], tuple[int, int]]  # parameters, M, N
    shared_bytes: Callable[[Mapping[str, int]], int] = lambda p: 0  # dynamic shared memory per block


def _square(p):  # one thread per element, TILE x TILE threads
    return (p["TILE"], p["TILE"])


def _by_rows(p, m, n):  # rung 1: blockIdx.x walks rows (part of its flaw)
    return (_cdiv(m, p["TILE"]), _cdiv(n, p["TILE"]))


def _tiles(p, m, n):  # blockIdx.x walks column tiles, blockIdx.y row tiles
    if "TILE" in p:
        return (_cdiv(n, p["TILE"]), _cdiv(m, p["TILE"]))
    return (_cdiv(n, p["BN"]), _cdiv(m, p["BM"]))


def _double_buffers(p):  # two buffers of the (transposed, padded) A tile and the B tile, as SHARED_BYTES
    return 2 * p["BK"] * (p["BM"] + p["APAD"] + p["BN"]) * 4


def _ring(p):  # STAGES buffers of the (transposed, padded) A tile and the (padded) B tile, as SHARED_BYTES
    return p["STAGES"] * p["BK"] * (p["BM"] + p["APAD"] + p["BN"] + p["BPAD"]) * 4


RUNGS: tuple[Rung, ...] = (
    Rung(1, "naive", _square, _by_rows),
    Rung(2, "coalesced", _square, _tiles),
    Rung(3, "smem_tiling", _square, _tiles),
    Rung(4, "blocktile_1d", lambda p: (p["BM"] * p["BN"] // p["TM"], 1), _tiles),
    Rung(5, "blocktile_2d", lambda p: (p["BM"] * p["BN"] // (p["TM"] * p["TN"]), 1), _tiles),
    Rung(6, "vectorized", lambda p: (p["BM"] * p["BN"] // (p["TM"] * p["TN"]), 1), _tiles),
    Rung(7, "double_buffered", lambda p: (p["BM"] * p["BN"] // (p["TM"] * p["TN"]), 1), _tiles),
    Rung(8, "warptiling", lambda p: (p["NUM_THREADS"], 1), _tiles, _double_buffers),
    Rung(9, "async_copy", lambda p: (p["NUM_THREADS"], 1), _tiles, _ring),
    Rung(10, "tuned", lambda p: (p["NUM_THREADS"], 1), _tiles, _ring),
)
BEST = RUNGS[-1]  # the rung the bf16 ladder starts from and the tests launch by default

# The shapes rung 10's sweep tries: (rung, defines) over rung 8's and rung 9's kernels,
# each satisfying its kernel's static_asserts. Thread tile = (WM*WN) / (32 lanes) values;
# MIN_BLOCKS caps registers so that many blocks fit on an SM; GROUP_M > 1 orders blocks
# for L2 reuse; STAGES is rung 9's ring depth.
# Why these shapes (H100; docs/worklogs/gemm-fp32.md): around rung 8, 8 x 16 per thread led at
# first (85.5%), BK = 16 added ~5% on 128 x 128,
# GROUP_M did nothing at 4096; once rung 8 double-buffered its fragments, 16 warps of
# 8 x 8 per thread at 128 x 256 x 16 led (86.5% of cuBLAS, 12 bytes spilled at its
# 128-register cap). This sweep keeps that shape on rung 8 as the yardstick and explores
# rung 9 (no staging registers, a deeper ring) around it.
_WARP16 = dict(BM=128, BN=256, BK=16, WM=64, WN=32, WNITER=2, TM=4, TN=4, NUM_THREADS=512, GROUP_M=1, MIN_BLOCKS=1)
_WIDE = {**_WARP16, "WN": 64, "WNITER": 4, "NUM_THREADS": 256}  # 8 warps of 64 x 64, 8 x 16 per thread
# cuBLAS's own SGEMM on the H100 (seen in ncu) is a 256 x 128 x 8 tile, 3 stages, 8 warps of
# 64 x 64, 254 registers: 8 x 16 per thread.
_CUBLAS_LIKE = {**_WIDE, "BM": 256, "BN": 128, "BK": 8}
_SMALL = {**_WARP16, "BN": 128, "NUM_THREADS": 256, "MIN_BLOCKS": 2}  # 128 x 128, 8 x 8 per thread, 2 blocks/SM
SWEEP: tuple[tuple[int, dict[str, int]], ...] = (
    (8, _WARP16),  # rung 8's best, for the side-by-side
    # the four best of rung 9's first sweep (2026-11-21, 16 shapes, 80-88% of cuBLAS):
    (9, {**_WIDE, "STAGES": 3}),
    (9, {**_SMALL, "STAGES": 3}),
    (9, {**_WARP16, "STAGES": 3}),
    (9, {**_WIDE, "STAGES": 4}),
    # around the leader (8 warps, 8 x 16 per thread): fewer barriers, other warp and lane
    # layouts, paddings, the block order
    (9, {**_WIDE, "BK": 32, "STAGES": 2}),
    (9, {**_WIDE, "BK": 32, "STAGES": 3}),
    (9, {**_WIDE, "STAGES": 3, "GROUP_M": 8}),
    (9, {**_WIDE, "WM": 32, "WN": 128, "STAGES": 3}),
    (9, {**_WIDE, "WNITER": 2, "TN": 8, "STAGES": 3}),
    (9, {**_WIDE, "TM": 8, "STAGES": 3}),
    (9, {**_WIDE, "APAD": 0, "STAGES": 3}),
    (9, {**_WIDE, "APAD": 8, "STAGES": 3}),
    (9, {**_WIDE, "BM": 256, "BN": 128, "STAGES": 2}),
    (9, {**_SMALL, "APAD": 0, "STAGES": 3}),
)


def rung(which: int | str) -> Rung:
    for r in RUNGS:
        if which in (r.number, r.name, r.label, str(r.number)):
            return r
    raise LaunchError(f"no fp32 GEMM rung {which!r} (rungs: {', '.join(r.label for r in RUNGS)})")


_PREPARED: dict[tuple, tuple[CudaKernel, dict[str, int]]] = {}


def prepared(step: Rung, defines: Mapping[str, int] | None = None) -> tuple[CudaKernel, dict[str, int]]:
    """The rung's compiled kernel and its parameters, once per process (compiled cubins are
    also cached on disk across processes; reading the parameters parses the sources, ~0.4 ms)."""
    key = (step.number, tuple(sorted((defines or {}).items())))
    if key not in _PREPARED:
        _PREPARED[key] = (CudaKernel.from_file(step.source, "sgemm", defines=defines), step.parameters(defines))
    return _PREPARED[key]


def sgemm(a: torch.Tensor, b: torch.Tensor, step: Rung | int | str = 9,
          defines: Mapping[str, int] | None = None) -> torch.Tensor:
    """C = a @ b with one rung's kernel; a: (M, K), b: (K, N), fp32, contiguous, one GPU."""
    step = step if isinstance(step, Rung) else rung(step)
    for name, x in (("a", a), ("b", b)):
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise LaunchError(f"sgemm: {name} must be a 2-D tensor, got "
                              f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        if x.dtype != torch.float32:
            raise LaunchError(f"sgemm: {name} is {x.dtype}, the fp32 ladder takes torch.float32")
    (m, k), (k2, n) = a.shape, b.shape
    if k != k2:
        raise LaunchError(f"sgemm: a is {m}x{k} and b is {k2}x{n}: inner dimensions differ")
    for name, x in (("a", a), ("b", b)):
        if not x.is_contiguous():
            raise LaunchError(f"sgemm: {name} must be contiguous (row-major); call .contiguous() first")
        if not x.is_cuda:
            raise LaunchError(f"sgemm: {name} is on {x.device}; the kernels run on a CUDA device")
    if a.device != b.device:
        raise LaunchError(f"sgemm: a is on {a.device} and b on {b.device}")
    if max(m, n, k) >= 2**31 or max(m * k, k * n, m * n) >= 2**40:
        raise LaunchError(f"sgemm: {m}x{k} @ {k}x{n} is beyond the kernels' 32-bit index range")
    c = torch.empty((m, n), dtype=torch.float32, device=a.device)
    if m == 0 or n == 0:
        return c
    kernel, params = prepared(step, defines)
    kernel.launch(step.grid(params, m, n), step.block(params), (a, b, c, m, n, k),
                                     shared_bytes=step.shared_bytes(params))
    return c


class RungModel(nn.Module):
    """A rung as a harness candidate (ModelNew): forward(a, b) = a @ b on that rung."""

    def __init__(self, step: Rung, defines: Mapping[str, int] | None = None):
        super().__init__()
        self.step, self.defines = step, dict(defines or {})

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return sgemm(a, b, self.step, self.defines)

"""The bf16 GEMM ladder on tensor cores: C = A @ B in bf16 with fp32 accumulation.

Each rung is one numbered `.cu` file beside this one (the same header convention as the
fp32 ladder: what changed, why, predicted); `hopper.cuh` wraps the PTX they share.
A is M x K row-major; B is K x N row-major (`b_layout="kn"`, an N-major tile for wgmma)
or N x K row-major (`b_layout="nk"`, C = A @ B^T, K-major like A: the layout of a
linear layer's weight). C is M x N bf16.

The work: 2*M*N*K flops over (M*K + K*N + M*N) * 2 bytes; at 4096^3 that is 137 GFLOP
over 101 MB, ~1370 flops per byte against the H100's ~260 (bf16 dense peak / HBM
bandwidth): compute-bound, the floor is the tensor-core rate (989 TFLOP/s on the data
sheet; ~790 sustained, measured by `kforge ceilings`).

TMA needs 16-byte row strides, so K and N must be multiples of 8 (bf16); M, N and K
need not be multiples of any tile: the copy engine reads zeros outside A and B and
clips the stores of C.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from kforge.kernels import RungSource
from kforge.runtime.cuda import CudaKernel, LaunchError, tensor_map

HERE = Path(__file__).parent
B_LAYOUTS = ("kn", "nk")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _stage_bytes(p: Mapping[str, int]) -> int:
    return (p["BM"] + p["BN"]) * p["BK"] * 2


def _persistent_bytes(p: Mapping[str, int]) -> int:  # the stages, one epilogue slice per consumer, barriers
    return p["STAGES"] * _stage_bytes(p) + p["BM"] * p["EPI_COLS"] * 2 + 1024 + 2 * p["STAGES"] * 8


@dataclass(frozen=True)
class Rung(RungSource):
    directory = HERE
    threads: Callable[[Mapping[str, int]], int]
    shared_bytes: Callable[[Mapping[str, int]], int]  # SHARED_BYTES of the source, from its parameters
    persistent: bool = False  # one CTA (cluster) per SM walking the tiles; stores C through a tensor map
    pointers: bool = False  # takes A, B and C as plain pointers (no TMA): rung 1


RUNGS: tuple[Rung, ...] = (
    Rung(1, "mma_sync", lambda p: (p["BM"] // 64) * (p["BN"] // 64) * 32,
         lambda p: p["STAGES"] * (p["BM"] + p["BN"]) * p["BK"] * 2, pointers=True),
    Rung(2, "tma_wgmma", lambda p: 128 * p["BM"] // 64, lambda p: p["STAGES"] * _stage_bytes(p) + 1024 + p["STAGES"] * 8),
    Rung(3, "warp_specialized", lambda p: 128 * (p["BM"] // 64 + 1),
         lambda p: p["STAGES"] * _stage_bytes(p) + 1024 + 2 * p["STAGES"] * 8),
    Rung(4, "persistent", lambda p: 128 * (p["BM"] // 64 + 1),
         _persistent_bytes, True),
    Rung(5, "clusters", lambda p: 128 * (p["BM"] // 64 + 1),
         _persistent_bytes, True),
)


def rung(which: int | str) -> Rung:
    for r in RUNGS:
        if which in (r.number, r.name, r.label, str(r.number)):
            return r
    raise LaunchError(f"no bf16 GEMM rung {which!r} (rungs: {', '.join(r.label for r in RUNGS)})")


_PREPARED: dict[tuple, tuple[CudaKernel, dict[str, int]]] = {}


def prepared(step: Rung, b_layout: str, defines: Mapping[str, int] | None = None) -> tuple[CudaKernel, dict[str, int]]:
    """The rung's compiled kernel and its parameters, once per process: reading the
    parameters parses the sources (~0.4 ms), too slow to repeat on every call."""
    defines = {**(defines or {}), "B_KMAJOR": int(b_layout == "nk")}
    key = (step.number, tuple(sorted(defines.items())))
    if key not in _PREPARED:
        _PREPARED[key] = (CudaKernel.from_file(step.source, "gemm", defines=defines), step.parameters(defines))
    return _PREPARED[key]


def _check(a: torch.Tensor, b: torch.Tensor, b_layout: str) -> tuple[int, int, int]:
    if b_layout not in B_LAYOUTS:
        raise LaunchError(f"gemm_bf16: b_layout must be 'kn' (B is K x N) or 'nk' (B is N x K), got {b_layout!r}")
    for name, x in (("a", a), ("b", b)):
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise LaunchError(f"gemm_bf16: {name} must be a 2-D tensor, got "
                              f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        if x.dtype != torch.bfloat16:
            raise LaunchError(f"gemm_bf16: {name} is {x.dtype}; this ladder takes torch.bfloat16")
    m, k = a.shape
    n, k2 = (b.shape[1], b.shape[0]) if b_layout == "kn" else tuple(b.shape)
    if k != k2:
        raise LaunchError(f"gemm_bf16: a is {m}x{k} and b ({b_layout}) is {tuple(b.shape)}: inner dimensions differ")
    if k % 8 or n % 8:
        raise LaunchError(f"gemm_bf16: K={k} and N={n} must be multiples of 8 (TMA needs 16-byte row strides)")
    for name, x in (("a", a), ("b", b)):
        if not x.is_cuda:
            raise LaunchError(f"gemm_bf16: {name} is on {x.device}; the kernels run on a CUDA device")
        if not x.is_contiguous():
            raise LaunchError(f"gemm_bf16: {name} must be contiguous (row-major); call .contiguous() first")
        if x.data_ptr() % 16:
            raise LaunchError(f"gemm_bf16: {name} must start on a 16-byte boundary (TMA), it is at {x.data_ptr():#x}")
    if a.device != b.device:
        raise LaunchError(f"gemm_bf16: a is on {a.device} and b on {b.device}")
    if max(m, n, k) >= 2**31:
        raise LaunchError(f"gemm_bf16: {m}x{n}x{k} is beyond the kernels' 32-bit coordinates")
    return m, n, k


_PLANS: dict[tuple, tuple] = {}


def _plan(step: Rung, b_layout: str, defines: Mapping[str, int] | None, m: int, n: int, index: int) -> tuple:
    """Grid, block and shared memory for one problem shape, checked once: the per-call path is
    then only the tensor maps and the launch (Python time per call matters at small shapes)."""
    kernel, p = prepared(step, b_layout, defines)
    cluster = p.get("CLUSTER_M", 1)
    with torch.cuda.device(index):
        if step.persistent:
            jobs = _cdiv(_cdiv(m, p["BM"]), cluster) * _cdiv(n, p["BN"])
            resident = kernel.max_active_clusters(step.threads(p), cluster, step.shared_bytes(p), index)
            grid = (min(jobs, resident) * cluster,)
        else:
            grid = (_cdiv(n, p["BN"]), _cdiv(m, p["BM"]))
        launch = kernel.prepare(grid, step.threads(p), index, shared_bytes=step.shared_bytes(p),
                                cluster=cluster if cluster > 1 else None)
    return launch, p, cluster


def gemm(a: torch.Tensor, b: torch.Tensor, step: Rung | int | str = 5, *, b_layout: str = "kn",
         defines: Mapping[str, int] | None = None) -> torch.Tensor:
    """C = a @ b (b_layout "kn") or a @ b.T ("nk") with one rung's kernel, bf16 in and out."""
    step = step if isinstance(step, Rung) else rung(step)
    m, n, k = _check(a, b, b_layout)
    c = torch.empty((m, n), dtype=torch.bfloat16, device=a.device)
    if m == 0 or n == 0:
        return c
    if k == 0:
        return c.zero_()
    index = a.device.index if a.device.index is not None else torch.cuda.current_device()
    plan_key = (step.number, b_layout, tuple(sorted((defines or {}).items())), m, n, k, index)
    plan = _PLANS.get(plan_key)
    if plan is None:
        plan = _PLANS[plan_key] = _plan(step, b_layout, defines, m, n, index)
    launch, p, cluster = plan
    sizes = (np.int32(m), np.int32(n), np.int32(k))
    if step.pointers:
        launch(a.data_ptr(), b.data_ptr(), c.data_ptr(), *sizes)
        return c
    a_map = tensor_map(a, (p["BM"], p["BK"]))
    # K-major B: one box of BN rows (a cluster's CTAs each load their share); N-major: 64-column boxes.
    b_map = tensor_map(b, (p["BN"] // cluster, p["BK"]) if b_layout == "nk" else (p["BK"], 64))
    if step.persistent:
        launch(a_map, b_map, tensor_map(c, (64, 64)), *sizes)
    else:
        launch(a_map, b_map, c.data_ptr(), *sizes)
    return c


class RungModel(nn.Module):
    """A rung as a harness candidate (ModelNew): forward(a, b) = a @ b on that rung."""

    def __init__(self, step: Rung, b_layout: str = "kn", defines: Mapping[str, int] | None = None):
        super().__init__()
        self.step, self.b_layout, self.defines = step, b_layout, dict(defines or {})

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return gemm(a, b, self.step, b_layout=self.b_layout, defines=self.defines)


class Fp32RungOnBf16(nn.Module):
    """The fp32 ladder's best rung on the bf16 problem (inputs widened, the result rounded):
    where the bf16 climb starts, CUDA cores against tensor cores."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        from kforge.kernels.gemm_fp32 import BEST, sgemm

        return sgemm(a.float(), b.float(), BEST).to(torch.bfloat16)


TRITON_SOURCE = HERE / "triton_matmul.py"


class TritonMatmul(nn.Module):
    """The Triton kernel (autotuned, persistent, TMA descriptors) as a harness candidate."""

    def __init__(self, b_layout: str = "kn"):
        super().__init__()
        self.b_layout = b_layout

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        from kforge.kernels.gemm_bf16.triton_matmul import matmul

        return matmul(a, b, b_layout=self.b_layout)


# `kforge ladder gemm --dtype bf16 --sweep`: variants of the persistent rungs (rung number, defines).
SWEEP: tuple[tuple[int, dict[str, int]], ...] = (
    (4, {}),
    (4, {"STAGES": 3, "EPI_COLS": 256}),
    (4, {"STAGES": 4, "EPI_COLS": 64}),
    (4, {"GROUP_M": 16}),
    (4, {"BN": 128, "STAGES": 6, "EPI_COLS": 64}),
    (5, {}),
    (5, {"STAGES": 4, "EPI_COLS": 64}),
)

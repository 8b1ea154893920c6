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

import math

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from threading import get_ident

import torch
from torch import nn

from kforge.kernels import RungSource
from kforge.runtime.cuda import CudaKernel, LaunchError
from kforge.runtime.driver import TensorMaps

HERE = Path(__file__).parent
B_LAYOUTS = ("kn", "nk")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _stage_bytes(p: Mapping[str, int]) -> int:
    return (p["BM"] + p["BN"]) * p["BK"] * 2


def _persistent_bytes(p: Mapping[str, int]) -> int:  # the stages, the consumers' epilogue slices, barriers
    epilogue = p["BM"] // p.get("WG_ROWS", 64) * 64 * p["EPI_COLS"] * p.get("EPI_BUFFERS", 1) * 2
    gamma = p["STAGES"] * p["BK"] * 2 if p.get("NORM_A") else 0  # GAMMA_BYTES: a k-tile of the norm's gamma a stage
    return p["STAGES"] * _stage_bytes(p) + epilogue + 1024 + 2 * p["STAGES"] * 8 + gamma


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
    Rung(4, "persistent", lambda p: 128 * (p["BM"] // p["WG_ROWS"] + 1),
         _persistent_bytes, True),
    Rung(5, "clusters", lambda p: 128 * (p["BM"] // p["WG_ROWS"] + 1),
         _persistent_bytes, True),
    # one producer and two consumers, each consumer a whole BM x BN tile; two turn barriers
    Rung(6, "pingpong", lambda p: 384, lambda p: _persistent_bytes(p) + 16, True),
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


TMA_L2_PROMOTION_BYTES = 0  # the operand descriptors' L2 promotion (0, 64, 128, 256): how TMA fills L2 lines

# Rung 4 for shapes with fewer 128 x 256 tiles than SMs: 128 x 128 tiles and split-K.
SPLIT_K_VARIANT = {"BN": 128, "STAGES": 6, "EPI_COLS": 64, "EPI_BUFFERS": 1, "SPLIT_K": 1}
MIN_K_TILES_PER_SPLIT = 4  # below this a split's pipeline fill and its partial's round trip outweigh the work
# Rung 4 with the last, partial wave of tiles shared out by k-tile across all CTAs.
STREAM_K_VARIANT = {"STREAM_K": 1}
# Rungs 4 and 5 with the epilogue after the k-loop, not under the next tile's (the variants' yardstick).
EPILOGUE_AFTER_KLOOP = {"EPI_OVERLAP": 0, "EPI_COLS": 128, "EPI_BUFFERS": 1}
# Rungs 4 and 5 with cuBLAS's tile at 4096^3 (ncu, 2026-11-22): 256 x 128, each consumer 128 rows.
TALL_TILE = {"BM": 256, "BN": 128, "WG_ROWS": 128}
# Rung 4 on 128 x 192 tiles: where they fill the SMs' last wave better than 128 x 256 (cuBLAS's width
# at 512-1024 rows, ncu 2026-11-26; kforge.ops.matmul.best_kernel picks it by that rule).
NARROW_TILE = {"BN": 192}


def wave_fill(m: int, n: int, block_n: int, sms: int) -> float:
    """The share of the SMs busy over all waves of 128 x block_n tiles of an M x N output."""
    tiles = _cdiv(m, 128) * _cdiv(n, block_n)
    return tiles / (_cdiv(tiles, sms) * sms)


def narrow_tile_fills_better(m: int, n: int, sms: int) -> bool:
    """Whether 128 x 192 tiles (NARROW_TILE) leave at least 15% fewer SMs idle than 128 x 256:
    where the narrow tile wins (the plain GEMM, kforge.ops.matmul.best_kernel; the NORM_A
    prefill, norm_qkv.prefill_tile_width). Below that margin 128 x 256's fewer, larger tiles
    are the faster."""
    return wave_fill(m, n, 192, sms) > 1.15 * wave_fill(m, n, 256, sms)


def auto_splits(tiles: int, resident_ctas: int, k_tiles: int) -> int:
    """Split-K factor for `tiles` output tiles on `resident_ctas` resident CTAs: none while
    the tiles alone fill at least half the SMs; else enough splits to fill them, each split
    keeping at least MIN_K_TILES_PER_SPLIT k-tiles."""
    if 2 * tiles > resident_ctas:
        return 1
    return max(1, min(resident_ctas // tiles, k_tiles // MIN_K_TILES_PER_SPLIT))


class _Plan:
    """Everything about one launch that depends only on the shape, made once: the grid, the
    prepared driver launch, each operand's TMA descriptors kept by address (only the
    addresses change from call to call), the split-K workspace. The per-call path is then a handful of ctypes calls: the harness
    times each call as max(device, host), and at small shapes the host side was the call."""

    def __init__(self, step: Rung, b_layout: str, defines: Mapping[str, int] | None, m: int, n: int, k: int,
                 index: int, split_k: int | None = None):
        kernel, p = prepared(step, b_layout, defines)
        cluster = p.get("CLUSTER_M", 1)
        self.splits, self.workspace = 1, ()
        with torch.cuda.device(index):
            if step.persistent:
                tiles = _cdiv(_cdiv(m, p["BM"]), cluster) * cluster * _cdiv(n, p["BN"])  # CTA tiles, with padding
                resident = kernel.max_active_clusters(step.threads(p), cluster, step.shared_bytes(p), index)
                if split_k is not None and not p.get("SPLIT_K"):
                    raise LaunchError(f"gemm_bf16: split_k needs a variant compiled with SPLIT_K=1, "
                                      f"e.g. {SPLIT_K_VARIANT}")
                auto = auto_splits(tiles, resident * cluster, _cdiv(k, p["BK"])) if p.get("SPLIT_K") else 1
                self.splits = split_k or auto
                grid = (min(tiles // cluster * self.splits, resident) * cluster,)
                if p.get("STREAM_K"):  # two BM x BN fp32 partials a CTA (its share spans two tiles at most); counters
                    where = torch.device("cuda", index)
                    self.workspace = (torch.empty(2 * grid[0] * p["BM"] * p["BN"], dtype=torch.float32, device=where),
                                      torch.zeros(grid[0] * p["BM"] // 64, dtype=torch.int32, device=where))
                if self.splits > 1:  # per 64-row slice of a tile, one 64 x BN fp32 partial per split; counters
                    slices = tiles * p["BM"] // 64
                    where = torch.device("cuda", index)
                    self.workspace = (torch.empty(slices * self.splits * 64 * p["BN"], dtype=torch.float32,
                                                  device=where),
                                      torch.zeros(slices, dtype=torch.int32, device=where))
            else:
                grid = (_cdiv(n, p["BN"]), _cdiv(m, p["BM"]))
            if step.pointers:
                self.maps = ()
                kinds = ("ptr", "ptr", "ptr", "i32", "i32", "i32")
            else:
                # K-major B: one box of BN rows (a cluster's CTAs each load their share); N-major: 64-column boxes.
                b_rows, b_cols = (k, n) if b_layout == "kn" else (n, k)
                b_box = (p["BN"] // cluster, p["BK"]) if b_layout == "nk" else (p["BK"], 64)
                promote = dict(l2_promotion_bytes=TMA_L2_PROMOTION_BYTES)
                self.maps = (TensorMaps("bfloat16", m, k, 2 * k, (p["BM"], p["BK"]), **promote),
                             TensorMaps("bfloat16", b_rows, b_cols, 2 * b_cols, b_box, **promote))
                self.maps += (TensorMaps("bfloat16", m, n, 2 * n, (64, 64)),) if step.persistent else ()
                persistent = ("map", "map", "map", "i32", "i32", "i32", "i32", "ptr", "ptr", "ptr", "ptr", "ptr", "f32")
                kinds = persistent if step.persistent else ("map", "map", "ptr", "i32", "i32", "i32")
            self.launch = kernel.lean(grid, step.threads(p), index, kinds=kinds, shared_bytes=step.shared_bytes(p),
                                      cluster=(cluster, 1, 1) if cluster > 1 else None)
        partials, arrivals = (w.data_ptr() for w in self.workspace) if self.workspace else (0, 0)
        self.tail = (m, n, k, self.splits, partials, arrivals) if step.persistent else (m, n, k)
        self.index = index

    def __call__(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, bias: int = 0, residual: int = 0,
                 norm_weight: int = 0, norm_eps: float = 0.0) -> None:
        """C = a @ b into c; `bias`, `residual`, `norm_weight` are addresses (0: none) for a fused variant."""
        stream = torch._C._cuda_getCurrentRawStream(self.index)
        if not self.maps:
            self.launch(stream, a.data_ptr(), b.data_ptr(), c.data_ptr(), *self.tail)
            return
        a_map, b_map = self.maps[0].address_of(a.data_ptr()), self.maps[1].address_of(b.data_ptr())
        if len(self.maps) == 3:
            self.launch(stream, a_map, b_map, self.maps[2].address_of(c.data_ptr()), *self.tail, bias, residual,
                        norm_weight, norm_eps)
        else:
            self.launch(stream, a_map, b_map, c.data_ptr(), *self.tail)


_PLANS: dict[tuple, _Plan] = {}


# The fused epilogue's activations (EPI_ACT in the persistent rungs), applied after the bias.
ACTIVATIONS = {"none": 0, "gelu": 1, "gelu_tanh": 2, "silu": 3}


def _epilogue_defines(step: Rung, a: torch.Tensor, b: torch.Tensor, b_layout: str, bias: torch.Tensor | None,
                      activation: str, residual: torch.Tensor | None, norm_weight: torch.Tensor | None = None,
                      defines: Mapping[str, int] | None = None) -> dict[str, int]:
    """The compile-time switches of a fused norm/bias/activation/residual, after checking
    them (the operands themselves are checked by `_check`)."""
    if activation not in ACTIVATIONS:
        raise LaunchError(f"gemm_bf16: activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")
    if not step.persistent:
        raise LaunchError(f"gemm_bf16: a fused epilogue needs a persistent rung (4, 5, 6), not {step.label}")
    if norm_weight is not None and (bias is not None or activation != "none" or residual is not None):
        raise LaunchError("gemm_bf16: norm_weight takes no bias, activation or residual (that build spilled "
                          "registers)")
    if norm_weight is not None and (step.number == 6 or any((defines or {}).get(d) for d in ("SPLIT_K", "STREAM_K"))):
        raise LaunchError(f"gemm_bf16: norm_weight needs rung 4 or 5 without split-K or stream-K (whole rows of K "
                          f"a CTA), not {step.label} {dict(defines or {})}")
    if isinstance(a, torch.Tensor) and a.dim() == 2 and isinstance(b, torch.Tensor) and b.dim() == 2:
        m, n, k = a.shape[0], (b.shape[1] if b_layout == "kn" else b.shape[0]), a.shape[1]
        for name, t, shape, align in (("bias", bias, (n,), 4), ("residual", residual, (m, n), 4),
                                      ("norm_weight", norm_weight, (k,), 16)):
            if t is not None and (not isinstance(t, torch.Tensor) or t.dtype != torch.bfloat16
                                  or tuple(t.shape) != shape or not t.is_contiguous() or t.device != a.device
                                  or t.data_ptr() % align):
                got = f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else t
                raise LaunchError(f"gemm_bf16: {name} must be a contiguous, {align}-byte aligned bf16 tensor of shape "
                                  f"{shape} on {a.device}, got {got}")
    return {"EPI_BIAS": int(bias is not None), "EPI_ACT": ACTIVATIONS[activation],
            "EPI_RESIDUAL": int(residual is not None), "NORM_A": int(norm_weight is not None)}


def gemm(a: torch.Tensor, b: torch.Tensor, step: Rung | int | str = 5, *, b_layout: str = "kn",
         defines: Mapping[str, int] | None = None, split_k: int | None = None, bias: torch.Tensor | None = None,
         activation: str = "none", residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
         norm_eps: float = 1e-6) -> torch.Tensor:
    """C = act(a @ b + bias) + residual (b_layout "kn"; a @ b.T for "nk") with one rung's
    kernel, bf16 in and out; with `norm_weight`, rmsnorm(a; norm_weight, norm_eps) in a's place.

    `split_k` (persistent rungs 4 and 5): how many K ranges each tile is cut into; default
    `auto_splits`'s choice. Plans hold a split-K workspace: one stream at a time per thread.
    `bias` (bf16, N), `activation` (one of ACTIVATIONS) and `residual` (bf16, M x N) run in the
    persistent rungs' epilogue on the fp32 accumulator, rounded once. `norm_weight` (bf16, K;
    rung 4 or 5, alone): each A tile is multiplied by it in registers on its way from shared
    memory to wgmma, its squares summed per row, and each output row scaled by
    1/sqrt(mean(a_row^2) + norm_eps) in the epilogue: the normed rows never exist."""
    step = step if isinstance(step, Rung) else rung(step)
    if split_k is not None and (not step.persistent or not isinstance(split_k, int) or split_k < 1):
        raise LaunchError(f"gemm_bf16: split_k must be a positive int and the rung persistent (4 or 5), got "
                          f"split_k={split_k!r} for rung {step.label}")
    fused = bias is not None or activation != "none" or residual is not None or norm_weight is not None
    if norm_weight is not None and not (isinstance(norm_eps, (int, float)) and math.isfinite(norm_eps) and norm_eps >= 0):
        raise LaunchError(f"gemm_bf16: norm_eps must be a finite number >= 0, got {norm_eps!r}")
    if fused:
        defines = {**(defines or {}),
                   **_epilogue_defines(step, a, b, b_layout, bias, activation, residual, norm_weight, defines)}
    # The common case in a few attribute reads; anything unusual takes the full check and its message.
    if (not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.dtype is not torch.bfloat16
            or b.dtype is not torch.bfloat16 or not a.is_cuda or a.device != b.device
            or not (a.is_contiguous() and b.is_contiguous()) or (a.data_ptr() | b.data_ptr()) & 15
            or a.dim() != 2 or b.dim() != 2 or b_layout not in B_LAYOUTS):
        _check(a, b, b_layout)
    m, k = a.shape
    n, k2 = (b.shape[1], b.shape[0]) if b_layout == "kn" else b.shape
    if k != k2 or k % 8 or n % 8 or max(m, n, k) >= 2**31:
        _check(a, b, b_layout)
    c = torch.empty((m, n), dtype=torch.bfloat16, device=a.device)
    if m == 0 or n == 0:
        return c
    if k == 0:  # the kernels need one k-tile; the epilogue of an empty sum, here
        c.zero_()
        if fused:
            c.copy_(epilogue_reference(c.float(), bias, activation, residual))  # (norm_weight too: a sum over K = 0 is 0)
        return c
    index = a.device.index
    # per thread: a plan's buffers are rewritten on every call
    key = (step.number, b_layout, tuple(sorted(defines.items())) if defines else (), m, n, k, index, get_ident(),
           split_k)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = _Plan(step, b_layout, defines, m, n, k, index, split_k)
    plan(a, b, c, bias.data_ptr() if bias is not None else 0, residual.data_ptr() if residual is not None else 0,
         norm_weight.data_ptr() if norm_weight is not None else 0, float(norm_eps))
    return c


def epilogue_reference(c: torch.Tensor, bias: torch.Tensor | None, activation: str,
                       residual: torch.Tensor | None = None) -> torch.Tensor:
    """act(c + bias) + residual in c's dtype: the fused epilogue's math in PyTorch (erf and
    tanh GELU exact), shared with the Triton epilogue GEMM's reference."""
    if bias is not None:
        c = c + bias.to(c.dtype)
    if activation == "gelu":
        c = torch.nn.functional.gelu(c)
    elif activation == "gelu_tanh":
        c = torch.nn.functional.gelu(c, approximate="tanh")
    elif activation == "silu":
        c = torch.nn.functional.silu(c)
    return c + residual.to(c.dtype) if residual is not None else c


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
    (4, {"STAGES": 3, "EPI_COLS": 256, "EPI_BUFFERS": 1}),
    (4, EPILOGUE_AFTER_KLOOP),
    (4, {"GROUP_M": 16}),
    (4, {"BN": 128, "STAGES": 6, "EPI_COLS": 64, "EPI_BUFFERS": 1}),
    (4, SPLIT_K_VARIANT),
    (5, {}),
    (5, EPILOGUE_AFTER_KLOOP),
    (6, {}),
    (6, {"EPI_COLS": 128}),
    (4, TALL_TILE),
    (5, TALL_TILE),
    (4, STREAM_K_VARIANT),
    (4, NARROW_TILE),
)

"""Block-scaled FP8 GEMM in CUDA (`fp8_block_gemm.cu`): C = sum_j sa_j sb_j (A_j @ B_j^T) in bf16.

The same contract as `fp8_gemm(..., scaling="block")` (fp8_gemm.py, the Triton kernel):
A [M, K] and B [N, K] float8_e4m3fn, row-major; a_scale [M, K/128] fp32 (any strides, so an
expanded or transposed tensor is taken as it is); b_scale [ceil(N/128), K/128] fp32; C [M, N]
bf16. K must be a multiple of 128 (one scale block a K step) and N of 8 (C's rows are stored
by TMA, 16-byte aligned). The kernel's design and why it differs from the Triton one: the
header of the `.cu` file.

`fp8_grouped_gemm_contiguous` runs the same kernel built with GROUPED: DeepGEMM's contiguous grouped
layout of MoE prefill (the experts' weights [E, N, K], a row's expert in m_indices, runs of rows
aligned to 128), the contract of `kernels/moe/grouped_gemm.py`'s FP8 contiguous path.

`fp8_block_gemm` launches it through the lean driver path (`runtime/driver.py`): a plan per
(M, N, K, device) keeps the prepared launch and the operands' TMA descriptors by address.

The cubin is loaded with the promotion's FFMA scheduling bits rewritten (`runtime/sass_control.py`,
PROMOTION): every 8th FFMA of a run yields and the factor stays in the operand-reuse cache
between, where ptxas yields at every other one; 2.5-2.9% faster on the H100 at 4096 x 7168 x
16384, the same numbers bit for bit. Without a disassembler (cuobjdump) the compiled cubin
runs as it is, with a warning.
"""

from __future__ import annotations

import subprocess
import warnings
from pathlib import Path
from threading import get_ident

import torch

from kforge.kernels.quant.fp8_gemm import check_fp8_gemm_operands
from kforge.errors import KforgeError
from kforge.runtime import sass_control
from kforge.runtime.cuda import CudaKernel, compile_cuda
from kforge.runtime.driver import TensorMaps

SOURCE = Path(__file__).with_name("fp8_block_gemm.cu")
PROMOTION = "yield-every-8"  # sass_control's style for the promotion's FFMAs (module docstring)
KINDS = ("map", "map", "map", "i32", "i32", "i32", "ptr", "i32", "i32", "ptr", "i32", "i32")
GROUPED_KINDS = (*KINDS, "ptr", "i32", "ptr")  # m_indices, w_scale's expert stride, C


def shared_bytes(stages: int, block_n: int) -> int:
    """SHARED_BYTES of the source: the ring (A tiles of 128 x 128 bytes, B tiles of block_n x 128,
    and each stage's 128 fp32 scales a 128-column half), two 64 x 64 bf16 epilogue buffers, the
    1024-byte alignment slack and two mbarriers a stage."""
    return stages * ((128 + block_n) * 128 + block_n // 128 * 128 * 4) + 2 * 64 * 64 * 2 + 1024 + 2 * stages * 8


def check_fp8_block_gemm_inputs(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor,
                                b_scale: torch.Tensor) -> None:
    """What the CUDA kernel needs beyond the block-scaling contract: a Hopper GPU, TMA-readable rows."""
    check_fp8_gemm_operands(a, b, a_scale, b_scale, "block")
    if not a.is_cuda or torch.cuda.get_device_capability(a.device) < (9, 0):
        raise ValueError("fp8_block_gemm needs a Hopper GPU (sm_90a: wgmma and TMA)")
    if b.shape[0] % 8:
        raise ValueError(f"N = {b.shape[0]}: C's rows are stored by TMA (16-byte aligned), so N must be a multiple "
                         "of 8")
    if not (a.is_contiguous() and b.is_contiguous()) or a.data_ptr() % 16 or b.data_ptr() % 16:
        raise ValueError("a and b must be contiguous (row-major) and 16-byte aligned: TMA reads them")
    last = max(sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride())) for t in (a_scale, b_scale))
    if last >= 2**31:
        raise ValueError("the scales' element offsets must fit 32-bit ints (the kernel indexes them so)")


class _Plan:
    """One shape's launch: grid = one CTA per SM (or per tile, if fewer), the prepared driver
    launch, and A's, B's and C's TMA descriptors kept by address."""

    def __init__(self, kernel: CudaKernel, stages: int, block_n: int, cluster: int, m: int, n: int, k: int,
                 index: int, experts: int = 0):
        jobs = -(-m // (128 * cluster)) * -(-n // block_n)  # a job: one tile per CTA of a cluster
        threads, smem = 384, shared_bytes(stages, block_n)
        with torch.cuda.device(index):
            resident = kernel.max_active_clusters(threads, cluster, smem, index)
            self.launch = kernel.lean((min(jobs, resident) * cluster,), threads, index,
                                      kinds=GROUPED_KINDS if experts else KINDS, shared_bytes=smem,
                                      cluster=(cluster, 1, 1) if cluster > 1 else None)
        # B's box: this CTA's share of a tile's rows (each CTA of a cluster multicasts its share to all);
        # grouped, B is every expert's N rows stacked
        self.maps = (TensorMaps("uint8", m, k, k, (128, 128)),
                     TensorMaps("uint8", max(experts, 1) * n, k, k, (block_n // cluster, 128)),
                     TensorMaps("bfloat16", m, n, 2 * n, (64, 64)))
        self.shape, self.index = (m, n, k), index

    def __call__(self, a, b, c, a_scale, b_scale, *grouped) -> None:
        """grouped: (m_indices, b_scale's expert stride) for a GROUPED build."""
        maps = (self.maps[0].address_of(a.data_ptr()), self.maps[1].address_of(b.data_ptr()),
                self.maps[2].address_of(c.data_ptr()))
        extra = (grouped[0].data_ptr(), grouped[1], c.data_ptr()) if grouped else ()
        self.launch(torch._C._cuda_getCurrentRawStream(self.index), *maps, *self.shape,
                    a_scale.data_ptr(), *a_scale.stride()[-2:], b_scale.data_ptr(), *b_scale.stride()[-2:], *extra)


SHARED_LIMIT = 227 * 1024
DEEPEST = {block_n: max(s for s in range(2, 12) if shared_bytes(s, block_n) <= SHARED_LIMIT) for block_n in (128, 256)}
_KERNELS: dict[tuple[int, int, int, str], CudaKernel] = {}
_PLANS: dict[tuple, _Plan] = {}


def compiled_kernel(stages: int, block_n: int, cluster: int, promotion: str = PROMOTION,
                    grouped: bool = False) -> CudaKernel:
    """The compiled kernel for one variant, its promotion's FFMAs rewritten in `promotion`'s style
    (`sass_control.STYLES`; "ptxas" leaves them as compiled). Kept per variant."""
    variant = (stages, block_n, cluster, promotion, grouped)
    if variant not in _KERNELS:
        defines = {"STAGES": stages, "BN": block_n, "CLUSTER_M": cluster, **({"GROUPED": 1} if grouped else {})}
        cubin = compile_cuda(SOURCE, defines=defines)
        try:
            cubin = sass_control.rewrite_promotion(cubin, "fp8_block_gemm", promotion)
        except (KforgeError, OSError, subprocess.SubprocessError) as exc:  # no cuobjdump: correct, 2-3% slower
            warnings.warn(f"fp8_block_gemm runs as compiled (its promotion not rewritten: {exc})", stacklevel=3)
        _KERNELS[variant] = CudaKernel(cubin, "fp8_block_gemm")
    return _KERNELS[variant]


def fp8_block_gemm(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor, *,
                   block_n: int = 256, stages: int | None = None, cluster: int = 2,
                   promotion: str = PROMOTION) -> torch.Tensor:
    """C [M, N] bf16 = the block-scaled product of fp8 e4m3 a [M, K] and b [N, K] (module docstring).
    The defaults are the fastest measured (the `.cu` header): block_n, the tile's columns, 256
    (or 128); `stages`, the ring depth, the deepest that fits shared memory; `cluster`, 2 CTAs
    on consecutive row tiles sharing each load of B by TMA multicast (or 1); `promotion`, the
    promotion's FFMA scheduling bits (`compiled_kernel`)."""
    if block_n not in DEEPEST:
        raise ValueError(f"block_n must be one of {tuple(DEEPEST)}, got {block_n}")
    if cluster not in (1, 2):
        raise ValueError(f"cluster must be 1 or 2, got {cluster}")
    if promotion not in sass_control.STYLES:
        raise ValueError(f"promotion must be one of {sass_control.STYLES}, got {promotion!r}")
    stages = stages or DEEPEST[block_n]
    if shared_bytes(stages, block_n) > SHARED_LIMIT:
        raise ValueError(f"{stages} stages of 128 x {block_n} tiles need {shared_bytes(stages, block_n)} bytes of "
                         f"shared memory; at most {SHARED_LIMIT}")
    check_fp8_block_gemm_inputs(a, b, a_scale, b_scale)
    (m, k), n = a.shape, b.shape[0]
    c = torch.empty((m, n), dtype=torch.bfloat16, device=a.device)
    if m == 0 or n == 0:
        return c
    variant = (stages, block_n, cluster)
    compiled = compiled_kernel(*variant, promotion)
    index = a.device.index if a.device.index is not None else torch.cuda.current_device()
    key = (m, n, k, *variant, promotion, index, get_ident())  # a plan's launch is not shared between threads
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = _Plan(compiled, *variant, m, n, k, index)
    plan(a, b, c, a_scale, b_scale)
    return c



def check_fp8_grouped_inputs(x: torch.Tensor, weight: torch.Tensor, m_indices: torch.Tensor, x_scale: torch.Tensor,
                             w_scale: torch.Tensor, align: int) -> None:
    """What the GROUPED build needs beyond `grouped_gemm.check_layout_inputs`' contiguous FP8 contract
    (which the caller has checked): a Hopper GPU, expert runs aligned to the 128-row tile, TMA rows."""
    if align % 128:
        raise ValueError(f"the CUDA grouped FP8 GEMM's tile is 128 rows: align must be a multiple of 128, got {align}")
    if weight.shape[1] % 8:
        raise ValueError(f"N = {weight.shape[1]}: C's rows are stored as 4-byte pairs, so N must be a multiple of 8")
    if not x.is_cuda or torch.cuda.get_device_capability(x.device)[0] != 9:
        raise ValueError("the CUDA grouped FP8 GEMM needs a Hopper GPU (it is built for sm_90a: wgmma and TMA)")
    if x.data_ptr() % 16 or weight.data_ptr() % 16:
        raise ValueError("x and weight must be 16-byte aligned: TMA reads them")
    last = max(sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride())) for t in (x_scale, w_scale))
    if last >= 2**31:
        raise ValueError("the scales' element offsets must fit 32-bit ints (the kernel indexes them so)")


def fp8_grouped_gemm_contiguous(x: torch.Tensor, weight: torch.Tensor, m_indices: torch.Tensor,
                                x_scale: torch.Tensor, w_scale: torch.Tensor, *, align: int = 128,
                                block_n: int = 256, stages: int | None = None,
                                promotion: str = PROMOTION) -> torch.Tensor:
    """out [M, N] bf16: row r of e4m3 x [M, K] times weight[m_indices[r]]^T (weight [E, N, K] e4m3), block
    scaled by x_scale [M, K/128] and w_scale [E, ceil(N/128), K/128]; runs of rows start at multiples of
    `align` (of 128); rows with m_indices -1 are not written. The kernel is `fp8_block_gemm` built with
    GROUPED (the `.cu` header), without clusters; block_n, stages and promotion as `fp8_block_gemm`'s."""
    check_fp8_grouped_inputs(x, weight, m_indices, x_scale, w_scale, align)
    if block_n not in DEEPEST:
        raise ValueError(f"block_n must be one of {tuple(DEEPEST)}, got {block_n}")
    stages = stages or DEEPEST[block_n]
    (m, k), (experts, n, _) = x.shape, weight.shape
    out = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    if m == 0:
        return out
    compiled = compiled_kernel(stages, block_n, 1, promotion, grouped=True)
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    key = ("grouped", experts, m, n, k, stages, block_n, promotion, index, get_ident())
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = _Plan(compiled, stages, block_n, 1, m, n, k, index, experts=experts)
    plan(x, weight, out, x_scale, w_scale, m_indices, w_scale.stride(0))
    return out

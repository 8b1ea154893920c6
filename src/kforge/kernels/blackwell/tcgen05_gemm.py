"""The bf16 tcgen05 GEMM (`tcgen05_gemm.cu`): C [M, N] = A [M, K] @ B [N, K]^T in bf16, fp32
accumulation in tensor memory, for sm_100a. Not yet run on a GPU (docs/blackwell.md).

Two variants of the same source, chosen at compile time: one CTA per 128 x 256 tile of C
(`cta_pair=False`), or a cluster of two CTAs sharing one M = 256 MMA (`cta_pair=True`, each CTA
loading half of B's tile). The design is in the `.cu` header.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kforge.kernels.blackwell import ARCH, require_sm100
from kforge.runtime.cuda import CudaKernel, compile_cuda

SOURCE = Path(__file__).with_name("tcgen05_gemm.cu")
BLOCK_M, BLOCK_N, BLOCK_K = 128, 256, 64
VARIANTS = {False: {"CTA_PAIR": 0, "BN": BLOCK_N, "STAGES": 4}, True: {"CTA_PAIR": 1, "BN": BLOCK_N, "STAGES": 6}}
KINDS = ("map", "map", "ptr", "i32", "i32", "i32")
THREADS = 128


def shared_bytes(cta_pair: bool, block_n: int, stages: int) -> int:
    """SHARED_BYTES of the source: the ring (A's 128 x 64 box and this CTA's rows of B's, bf16),
    two mbarriers a slot, `done`, the TMEM address and 1024 bytes of alignment slack."""
    b_rows = block_n // (2 if cta_pair else 1)
    return stages * (BLOCK_M + b_rows) * BLOCK_K * 2 + (2 * stages + 1) * 8 + 8 + 1024


def check_tcgen05_gemm_inputs(a: torch.Tensor, b: torch.Tensor) -> None:
    """ValueError unless a [M, K] and b [N, K] are bf16, row-major, 16-byte aligned, with N and K
    multiples of 8 (TMA's rows and the epilogue's stores are 16 bytes)."""
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.bfloat16 or t.dim() != 2:
            raise ValueError(f"{name} must be a 2-D torch.bfloat16 tensor, got "
                             f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
        if not t.is_contiguous() or t.data_ptr() % 16:
            raise ValueError(f"{name} must be contiguous (row-major) and 16-byte aligned: TMA reads it")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"a [M, K] and b [N, K] must share K, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[1] % 8 or b.shape[0] % 8:
        raise ValueError(f"N and K must be multiples of 8 (16-byte rows), got N = {b.shape[0]}, K = {a.shape[1]}")


_KERNELS: dict[bool, CudaKernel] = {}
_PLANS: dict[tuple, tuple] = {}


def _plan(cta_pair: bool, m: int, n: int, k: int, index: int) -> tuple:
    """One shape's prepared launch and its A and B TMA descriptors (kept by address), made once."""
    from kforge.runtime.driver import TensorMaps

    key = (cta_pair, m, n, k, index)
    if key not in _PLANS:
        defines = VARIANTS[cta_pair]
        if cta_pair not in _KERNELS:
            _KERNELS[cta_pair] = CudaKernel(compile_cuda(SOURCE, arch=ARCH, defines=defines), "tcgen05_gemm")
        pair = 2 if cta_pair else 1
        grid = (-(-m // (BLOCK_M * pair)) * pair, -(-n // defines["BN"]))  # a pair's CTAs are adjacent in x
        with torch.cuda.device(index):
            launch = _KERNELS[cta_pair].lean(grid, THREADS, index, kinds=KINDS,
                                             shared_bytes=shared_bytes(cta_pair, defines["BN"], defines["STAGES"]),
                                             cluster=(2, 1, 1) if cta_pair else None)
        _PLANS[key] = (launch, TensorMaps("bfloat16", m, k, 2 * k, (BLOCK_M, BLOCK_K)),
                       TensorMaps("bfloat16", n, k, 2 * k, (defines["BN"] // pair, BLOCK_K)))
    return _PLANS[key]


def tcgen05_gemm(a: torch.Tensor, b: torch.Tensor, *, cta_pair: bool = False) -> torch.Tensor:
    """C [M, N] bf16 = a [M, K] @ b [N, K]^T on an sm_100 GPU; `cta_pair` runs the 2-CTA variant."""
    check_tcgen05_gemm_inputs(a, b)
    index = require_sm100(a, "tcgen05_gemm")
    (m, k), n = a.shape, b.shape[0]
    if k == 0:  # no K block: the kernel would never write its accumulator
        return torch.zeros((m, n), dtype=torch.bfloat16, device=a.device)
    c = torch.empty((m, n), dtype=torch.bfloat16, device=a.device)
    if m == 0 or n == 0:
        return c
    launch, a_map, b_map = _plan(cta_pair, m, n, k, index)
    launch(torch.cuda.current_stream(index).cuda_stream, a_map.address_of(a.data_ptr()),
           b_map.address_of(b.data_ptr()), c.data_ptr(), m, n, k)
    return c

"""The same GEMM one rung up the abstraction ladder: Triton, persistent, TMA descriptors.

What the CUDA rungs spell out by hand, Triton derives: `tl.dot` on sm_90 becomes wgmma,
descriptor loads become TMA copies into swizzled shared memory, and `num_stages` is the
depth of the mbarrier ring. What is left to write is the schedule: one program per SM
walking the output tiles in grouped order (as rung 4 does), and the tile shapes, which
the autotuner picks per problem shape. C = A @ B, or A @ B^T when `b_layout == "nk"`.

The TMA descriptors are built on the device (`tl.make_tensor_descriptor`, in a few bytes
of scratch from `triton.set_allocator`), not on the host: host descriptors are encoded by
the driver at every launch, and at 4096^3 that Python launch (150-230 us) was as long as
the kernel (185 us), so an eager caller waited on the host (H100, 2026-11-21).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kforge.device import sm_count


def _descriptor_scratch(size: int, alignment: int, stream):
    """Global memory for the device-built TMA descriptors of one launch (Triton asks per launch)."""
    return torch.empty(size, dtype=torch.int8, device="cuda" if torch.cuda.is_available() else "cpu")


triton.set_allocator(_descriptor_scratch)


@triton.jit
def _tile_coords(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    # GROUP_M rows of tiles at a time, column by column inside a group: the tiles in
    # flight share panels of A and B in L2.
    per_group = GROUP_M * tiles_n
    first = (tile // per_group) * GROUP_M
    rows = tl.minimum(tiles_m - first, GROUP_M)
    return first + (tile % per_group) % rows, (tile % per_group) // rows


@triton.jit
def matmul_persistent(a_ptr, b_ptr, c_ptr, M, N, K, NUM_PROGRAMS: tl.constexpr, BM: tl.constexpr,
                      BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, B_KMAJOR: tl.constexpr,
                      FLATTEN: tl.constexpr):
    # Row-major A (M x K), B (K x N, or N x K when B_KMAJOR) and C (M x N); boxes reaching
    # past the edges load zeros and store nothing.
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    if B_KMAJOR:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    else:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[N, 1], block_shape=[BK, BN])
    c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    # FLATTEN: Triton pipelines the tile loop and the k loop as one, so the next tile's
    # first loads are in flight during this tile's epilogue (the store of C).
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, NUM_PROGRAMS, flatten=FLATTEN):
        tm, tn = _tile_coords(tile, tiles_m, tiles_n, GROUP_M)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, K, BK):
            a = a_desc.load([tm * BM, k])
            if B_KMAJOR:
                b = b_desc.load([tn * BN, k]).T
            else:
                b = b_desc.load([k, tn * BN])
            acc = tl.dot(a, b, acc)
        c_desc.store([tm * BM, tn * BN], acc.to(c_desc.dtype))


# Every config must fit the 227 KB a block may use (the stages, plus C's tile for the TMA
# store): 128 x 256 with 4 stages needs 262 KB and was dropped (the autotuner had been
# skipping it silently). tests/kernels/test_gemm_bf16.py compiles each for sm_90 to check.
CONFIGS = [
    triton.Config({"BM": bm, "BN": bn, "BK": 64, "GROUP_M": 8, "FLATTEN": flat}, num_stages=s, num_warps=w)
    for bm, bn, s, w, flat in [(128, 256, 3, 8, False), (128, 256, 3, 8, True),
                               (128, 128, 4, 8, False), (128, 128, 4, 8, True), (128, 128, 5, 4, False),
                               (64, 128, 5, 4, False), (64, 64, 6, 4, False)]
]
matmul_autotuned = triton.autotune(CONFIGS, key=["M", "N", "K", "B_KMAJOR"])(matmul_persistent)
# Each shape's pick, once tuned. Later calls launch the kernel with it directly, skipping
# the autotuner's per-call dispatch: host time is what an eager caller of a 185 us kernel
# was waiting on (see the module docstring).
_TUNED: dict[tuple, dict] = {}


def matmul(a: torch.Tensor, b: torch.Tensor, *, b_layout: str = "kn", config: dict | None = None) -> torch.Tensor:
    """C = a @ b ("kn": b is K x N) or a @ b.T ("nk": b is N x K), 2-byte floats, fp32 accumulation.

    a and b row-major and contiguous. `config` (BM, BN, BK, GROUP_M, FLATTEN, num_stages,
    num_warps) skips the autotuner: the CPU tests run one small config under the Triton
    interpreter.
    """
    if not (a.is_contiguous() and b.is_contiguous()):
        raise ValueError("triton_matmul: a and b must be contiguous (row-major); call .contiguous() first")
    m, k = a.shape
    n = b.shape[1] if b_layout == "kn" else b.shape[0]
    c = torch.empty((m, n), dtype=a.dtype, device=a.device)
    programs = _programs(a.device)
    kmajor = int(b_layout == "nk")
    shape = (m, n, k, kmajor, a.dtype)
    if config is None and shape in _TUNED:  # the autotuner's pick, without its per-call dispatch
        config = _TUNED[shape]
    if config is None:
        matmul_autotuned[(programs,)](a, b, c, m, n, k, NUM_PROGRAMS=programs, B_KMAJOR=kmajor)
        if a.is_cuda:
            best = matmul_autotuned.best_config
            _TUNED[shape] = dict(best.kwargs, num_stages=best.num_stages, num_warps=best.num_warps)
    else:
        blocks = {key: config[key] for key in ("BM", "BN", "BK", "GROUP_M")}
        blocks["FLATTEN"] = config.get("FLATTEN", False)
        grid = min(programs, triton.cdiv(m, blocks["BM"]) * triton.cdiv(n, blocks["BN"]))
        matmul_persistent[(grid,)](a, b, c, m, n, k, NUM_PROGRAMS=grid, B_KMAJOR=kmajor, **blocks,
                                   num_stages=config.get("num_stages", 3), num_warps=config.get("num_warps", 4))
    return c


def _programs(device: torch.device) -> int:
    """One program per SM (4 under the interpreter)."""
    return sm_count(device) if device.type == "cuda" else 4

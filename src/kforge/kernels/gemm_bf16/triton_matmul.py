"""The same GEMM one rung up the abstraction ladder: Triton, persistent, TMA descriptors.

What the CUDA rungs spell out by hand, Triton derives: `tl.dot` on sm_90 becomes wgmma,
descriptor loads become TMA copies into swizzled shared memory, and `num_stages` is the
depth of the mbarrier ring. What is left to write is the schedule: one program per SM
walking the output tiles in grouped order (as rung 4 does), and the tile shapes, which
the autotuner picks per problem shape. C = A @ B, or A @ B^T when `b_layout == "nk"`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def _tile_coords(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    # GROUP_M rows of tiles at a time, column by column inside a group: the tiles in
    # flight share panels of A and B in L2.
    per_group = GROUP_M * tiles_n
    first = (tile // per_group) * GROUP_M
    rows = tl.minimum(tiles_m - first, GROUP_M)
    return first + (tile % per_group) % rows, (tile % per_group) // rows


@triton.jit
def matmul_persistent(a_desc, b_desc, c_desc, M, N, K, NUM_PROGRAMS: tl.constexpr, BM: tl.constexpr,
                      BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, B_KMAJOR: tl.constexpr,
                      FLATTEN: tl.constexpr):
    tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    # FLATTEN: Triton pipelines the tile loop and the k loop as one, so the next tile's
    # first loads are in flight during this tile's epilogue (the store of C).
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, NUM_PROGRAMS, flatten=FLATTEN):
        tm, tn = _tile_coords(tile, tiles_m, tiles_n, GROUP_M)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, K, BK):  # out-of-bounds parts of a box load as zeros
            a = a_desc.load([tm * BM, k])
            if B_KMAJOR:
                b = b_desc.load([tn * BN, k]).T
            else:
                b = b_desc.load([k, tn * BN])
            acc = tl.dot(a, b, acc)
        c_desc.store([tm * BM, tn * BN], acc.to(c_desc.dtype))  # clipped at the edges


def _set_block_shapes(nargs):  # the autotuner's pre-hook: the descriptors' boxes follow the config
    bm, bn, bk = nargs["BM"], nargs["BN"], nargs["BK"]
    nargs["a_desc"].block_shape = [bm, bk]
    nargs["b_desc"].block_shape = [bn, bk] if nargs["B_KMAJOR"] else [bk, bn]
    nargs["c_desc"].block_shape = [bm, bn]


# Every config must fit the 227 KB a block may use (the stages, plus C's tile for the TMA
# store): 128 x 256 with 4 stages needs 262 KB and was dropped (the autotuner had been
# skipping it silently). tests/kernels/test_gemm_bf16.py compiles each for sm_90 to check.
CONFIGS = [
    triton.Config({"BM": bm, "BN": bn, "BK": 64, "GROUP_M": 8, "FLATTEN": flat}, num_stages=s, num_warps=w,
                  pre_hook=_set_block_shapes)
    for bm, bn, s, w, flat in [(128, 256, 3, 8, False), (128, 256, 3, 8, True),
                               (128, 128, 4, 8, False), (128, 128, 4, 8, True), (128, 128, 5, 4, False),
                               (64, 128, 5, 4, False), (64, 64, 6, 4, False)]
]
matmul_autotuned = triton.autotune(CONFIGS, key=["M", "N", "K", "B_KMAJOR"])(matmul_persistent)
# Each shape's pick, once tuned. Later calls launch the kernel with it directly: the
# autotuner's dispatch (key, lookup, pre-hook) costs host time on every call, and at
# 4096^3 the Python launch was the longer half of a call (210 us of host for 185 us of
# device, 2026-11-21), which the harness counts.
_TUNED: dict[tuple, dict] = {}


def matmul(a: torch.Tensor, b: torch.Tensor, *, b_layout: str = "kn", config: dict | None = None) -> torch.Tensor:
    """C = a @ b ("kn": b is K x N) or a @ b.T ("nk": b is N x K), 2-byte floats, fp32 accumulation.

    `config` (BM, BN, BK, GROUP_M, FLATTEN, num_stages, num_warps) skips the autotuner: the
    CPU tests run one small config under the Triton interpreter.
    """
    m, k = a.shape
    n = b.shape[1] if b_layout == "kn" else b.shape[0]
    c = torch.empty((m, n), dtype=a.dtype, device=a.device)
    dummy = [1, 1]  # the pre-hook (or the explicit config below) sets the real boxes
    a_desc = TensorDescriptor.from_tensor(a, dummy)
    b_desc = TensorDescriptor.from_tensor(b, dummy)
    c_desc = TensorDescriptor.from_tensor(c, dummy)
    programs = torch.cuda.get_device_properties(a.device).multi_processor_count if a.is_cuda else 4
    kmajor = int(b_layout == "nk")
    shape = (m, n, k, kmajor, a.dtype)
    if config is None and shape in _TUNED:  # the autotuner's pick, without its per-call dispatch
        config = _TUNED[shape]
    if config is None:
        matmul_autotuned[(programs,)](a_desc, b_desc, c_desc, m, n, k, NUM_PROGRAMS=programs, B_KMAJOR=kmajor)
        if a.is_cuda:
            best = matmul_autotuned.best_config
            _TUNED[shape] = dict(best.kwargs, num_stages=best.num_stages, num_warps=best.num_warps)
    else:
        blocks = {key: config[key] for key in ("BM", "BN", "BK", "GROUP_M")}
        blocks["FLATTEN"] = config.get("FLATTEN", False)
        _set_block_shapes({"a_desc": a_desc, "b_desc": b_desc, "c_desc": c_desc, "B_KMAJOR": kmajor, **blocks})
        tiles = triton.cdiv(m, blocks["BM"]) * triton.cdiv(n, blocks["BN"])
        grid = min(programs, tiles)
        matmul_persistent[(grid,)](a_desc, b_desc, c_desc, m, n, k, NUM_PROGRAMS=grid, B_KMAJOR=kmajor, **blocks,
                                   num_stages=config.get("num_stages", 3), num_warps=config.get("num_warps", 4))
    return c

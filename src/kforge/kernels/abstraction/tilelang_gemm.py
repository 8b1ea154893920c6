"""The bf16 GEMM in TileLang: tiles in shared memory and registers, copies and a gemm between them.

C (M x N) = A (M x K) @ B (K x N), bf16 in and out, fp32 accumulation. The kernel names the
buffers (A's and B's tiles in shared memory, C's accumulator as a register fragment), the
copies between them and `T.gemm`; `T.Pipelined` asks for a STAGES-deep ring over the k-loop.
From that TileLang's passes write the Hopper kernel a CUDA rung spells out: the copies into
shared memory become TMA loads issued by a producer warpgroup, each stage guarded by
mbarriers, the consumer warpgroups run `wgmma` (`T.gemm` on sm_90a), and the producer gives
up registers to them (setmaxnreg): warp specialization, inferred rather than written.

Tile 128 x 256 x 64 with 3 stages (3 x 48 KB of ring and C's 64 KB staging tile for the
coalesced store), 256 consumer threads: two warpgroups of 64 rows each, as at the other
levels. `T.use_swizzle` launches the tiles in panels of 8 rows, sharing A and B in L2.
TileLang compiles for one shape (M, N, K are constants of the kernel), cached per shape.
"""

from __future__ import annotations

from functools import cache

import tilelang
import tilelang.language as T
import torch

TILE = dict(BM=128, BN=256, BK=64, STAGES=3)
THREADS = 256  # the consumer warpgroups; TileLang adds the producer's
TARGET = {"kind": "cuda", "arch": "sm_90a"}


def gemm_program(m: int, n: int, k: int, BM: int, BN: int, BK: int, STAGES: int):
    """The TileLang program for one shape (a TIR PrimFunc): what `tilelang.compile` lowers."""

    @T.prim_func
    def gemm_kernel(A: T.Tensor((m, k), "bfloat16"), B: T.Tensor((k, n), "bfloat16"),
                    C: T.Tensor((m, n), "bfloat16")):
        with T.Kernel(T.ceildiv(n, BN), T.ceildiv(m, BM), threads=THREADS) as (tile_n, tile_m):
            a_tile = T.alloc_shared((BM, BK), "bfloat16")
            b_tile = T.alloc_shared((BK, BN), "bfloat16")
            acc = T.alloc_fragment((BM, BN), "float32")
            c_tile = T.alloc_shared((BM, BN), "bfloat16")
            T.use_swizzle(panel_size=8)
            T.clear(acc)
            for k_tile in T.Pipelined(T.ceildiv(k, BK), num_stages=STAGES):
                T.copy(A[tile_m * BM, k_tile * BK], a_tile)
                T.copy(B[k_tile * BK, tile_n * BN], b_tile)
                T.gemm(a_tile, b_tile, acc)
            T.copy(acc, c_tile)  # round to bf16 through shared memory, then one coalesced store
            T.copy(c_tile, C[tile_m * BM, tile_n * BN])

    return gemm_kernel


@cache
def compiled(m: int, n: int, k: int):
    """The kernel for one shape, compiled for sm_90a (TileLang runs nvcc); C is its output."""
    return tilelang.compile(gemm_program(m, n, k, **TILE), out_idx=[2], target=TARGET)


def gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """C = a @ b for bf16 a (M x K) and b (K x N), both contiguous, on a Hopper GPU."""
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16 or a.dim() != 2 or b.dim() != 2 \
            or a.shape[1] != b.shape[0] or not (a.is_contiguous() and b.is_contiguous()):
        raise ValueError(f"tilelang_gemm: needs contiguous 2-D bf16 a (M x K) and b (K x N), got {a.dtype} "
                         f"{tuple(a.shape)} @ {b.dtype} {tuple(b.shape)}")
    return compiled(a.shape[0], b.shape[1], a.shape[1])(a, b)

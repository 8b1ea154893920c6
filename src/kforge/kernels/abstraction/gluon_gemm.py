"""The bf16 GEMM in Gluon: Triton's layout-explicit dialect, one level below `tl.dot`.

C (M x N) = A (M x K) @ B (K x N), bf16 in and out, fp32 accumulation. Where Triton derives
the shared-memory ring, the barriers and the MMA's register layout from `tl.dot` and
`num_stages`, Gluon has the kernel say them:

- the accumulator's register layout: an NVMMADistributedLayout (wgmma, "MMA v3") whose
  instruction shape is m16 n256 k16 and whose 8 warps stack along M, so each warpgroup of
  4 warps owns 64 rows of the 128-row tile (128 fp32 registers a thread for 128 x 256);
- shared memory: a ring of STAGES (A, B) tile pairs, in the 128-byte swizzled layout that
  both the TMA engine writes and wgmma reads without bank conflicts;
- the copies: TMA loads into the ring, each stage's completion counted by its own mbarrier
  (expect-tx bytes; the wait flips a parity bit once per lap of the ring);
- the overlap: wgmma is asynchronous; waiting until at most one is in flight proves the
  previous k-tile's MMA has read its stage, which is then refilled STAGES - 1 tiles ahead.

At 128 x 256 x 64 with 4 stages: 4 x (16 + 32) KB of ring, 192 KB of the 227 KB a CTA may
use; the 64 KB C tile of the TMA store reuses the ring's memory (Gluon allocates shared
memory by liveness, and the ring is dead by then). Tiles are visited GROUP_M rows of tiles at a
time so that CTAs in flight share panels of A and B in L2 (as the CUDA and Triton levels do).
TMA reads zeros past A's and B's edges and clips C's store: any M; K and N multiples of 8.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

# Importing it installs Triton's allocator: the scratch the device-built TMA descriptors live in.
from kforge.kernels.gemm_bf16 import triton_matmul  # noqa: F401

TILE = dict(BM=128, BN=256, BK=64, STAGES=4, GROUP_M=8)
NUM_WARPS = 8  # two warpgroups, 64 rows of the tile each


@gluon.jit
def _grouped_tile(tile, tiles_m, tiles_n, GROUP_M: gl.constexpr):
    # GROUP_M rows of tiles, walked column by column: consecutive CTAs reuse B's column panel.
    per_group = GROUP_M * tiles_n
    first_m = (tile // per_group) * GROUP_M
    rows = gl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % rows, (tile % per_group) // rows


@gluon.jit
def _load_k_tile(a_desc, b_desc, a_ring, b_ring, ready, k_tile, k_tiles, off_m, off_n,
                 BK: gl.constexpr, STAGES: gl.constexpr):
    # One TMA copy each of A's and B's k-tile into ring stage k_tile % STAGES; the stage's
    # barrier completes when both boxes' bytes have landed. Past the last k-tile: nothing.
    stage = k_tile % STAGES
    wanted = k_tile < k_tiles
    mbarrier.expect(ready.index(stage), a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=wanted)
    tma.async_copy_global_to_shared(a_desc, [off_m, k_tile * BK], ready.index(stage), a_ring.index(stage), pred=wanted)
    tma.async_copy_global_to_shared(b_desc, [k_tile * BK, off_n], ready.index(stage), b_ring.index(stage), pred=wanted)


@gluon.jit
def gemm_kernel(a_ptr, b_ptr, c_ptr, M, N, K, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                STAGES: gl.constexpr, GROUP_M: gl.constexpr, num_warps: gl.constexpr):
    # 128-byte swizzle: each 64-element bf16 row of a box spans the 8 x 16-byte bank groups.
    swizzled: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    a_desc = tma.make_tensor_descriptor(a_ptr, [M, K], [K, 1], [BM, BK], swizzled)
    b_desc = tma.make_tensor_descriptor(b_ptr, [K, N], [N, 1], [BK, BN], swizzled)
    c_desc = tma.make_tensor_descriptor(c_ptr, [M, N], [N, 1], [BM, BN], swizzled)

    tile_m, tile_n = _grouped_tile(gl.program_id(0), gl.cdiv(M, BM), gl.cdiv(N, BN), GROUP_M)
    off_m = tile_m * BM
    off_n = tile_n * BN

    a_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BK], swizzled)
    b_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BK, BN], swizzled)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for slot in gl.static_range(STAGES):
        mbarrier.init(ready.index(slot), count=1)

    k_tiles = gl.cdiv(K, BK)
    for first in gl.static_range(STAGES - 1):  # the prologue: STAGES - 1 k-tiles in flight
        _load_k_tile(a_desc, b_desc, a_ring, b_ring, ready, first, k_tiles, off_m, off_n, BK, STAGES)

    # wgmma m64nNk16 per warpgroup; warps_per_cta [8, 1] puts the two warpgroups on rows 0-63 and 64-127.
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BN, 16])
    acc = gl.zeros([BM, BN], gl.float32, acc_layout)
    for k_tile in range(k_tiles):
        stage = k_tile % STAGES
        mbarrier.wait(ready.index(stage), phase=(k_tile // STAGES) & 1)
        acc = warpgroup_mma(a_ring.index(stage), b_ring.index(stage), acc, is_async=True)
        # At most this k-tile's wgmma still runs: the previous one has read its stage, so
        # that stage takes the k-tile STAGES - 1 ahead while this MMA computes.
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        _load_k_tile(a_desc, b_desc, a_ring, b_ring, ready, k_tile + STAGES - 1, k_tiles, off_m, off_n, BK, STAGES)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    for slot in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(slot))

    # Epilogue: round once to bf16, registers -> swizzled shared memory -> one TMA store.
    c_tile = gl.allocate_shared_memory(gl.bfloat16, [BM, BN], swizzled)
    c_tile.store(acc.to(gl.bfloat16))
    fence_async_shared()  # the generic-proxy writes above, before the async proxy (TMA) reads them
    tma.async_copy_shared_to_global(c_desc, [off_m, off_n], c_tile)
    tma.store_wait(pendings=0)


def gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """C = a @ b for bf16 a (M x K) and b (K x N), both contiguous, on a Hopper GPU."""
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16 or a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"gluon_gemm: a and b must be 2-D bf16, got {a.dtype} {tuple(a.shape)} and "
                         f"{b.dtype} {tuple(b.shape)}")
    (m, k), (k2, n) = a.shape, b.shape
    if k != k2 or k % 8 or n % 8 or not (a.is_contiguous() and b.is_contiguous()):
        raise ValueError(f"gluon_gemm: needs contiguous a (M x K) and b (K x N) with K, N multiples of 8 "
                         f"(TMA's 16-byte strides), got {tuple(a.shape)} @ {tuple(b.shape)}")
    c = torch.empty((m, n), dtype=torch.bfloat16, device=a.device)
    tiles = triton.cdiv(m, TILE["BM"]) * triton.cdiv(n, TILE["BN"])
    gemm_kernel[(tiles,)](a, b, c, m, n, k, **TILE, num_warps=NUM_WARPS)
    return c

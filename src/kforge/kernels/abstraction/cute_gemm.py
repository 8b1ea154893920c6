"""The bf16 GEMM in CuTe DSL: layouts, copy and MMA atoms, and the pipeline between them.

C (M x N) = A (M x K) @ B (K x N), bf16 in and out, fp32 accumulation. In CuTe's terms the
operands are A (M, K), K-major, and B seen as (N, K), N-major (B's rows are contiguous in N),
and C (M, N), N-major: wgmma reads both majors of 16-bit operands from shared memory, so B
needs no transpose.

What the kernel writer states, and CuTe turns into instructions:
- the MMA: a tiled wgmma (`MmaF16BF16Op`, m64 n256 k16) repeated over 2 warpgroups along M,
  so a CTA owns a 128 x 256 tile of C, each consumer warpgroup 64 x 256 of it (128 fp32
  accumulators a thread);
- the shared-memory layouts: 128-byte-swizzled atoms tiled to a 4-stage ring of A's 128 x 64
  and B's 256 x 64 tiles (48 KB a stage), what both TMA and wgmma's descriptors read;
- the copies: TMA atoms built on the host from the global tensors (the descriptors), one
  128 x 64 and one 256 x 64 box a k-tile; stmatrix and a TMA store in the epilogue;
- the roles (warp specialization): warpgroup 0 is the producer, its first warp issues the
  TMA loads into the ring (`PipelineTmaAsync`: a full and an empty mbarrier a stage, the
  full one completed by the copies' transaction bytes); warpgroups 1 and 2 are consumers,
  wait on full, issue 4 wgmma a k-tile (k16 each) asynchronously, keep one k-tile in
  flight and release the stage the one before read. The producer gives its registers up
  (setmaxnreg 40) so the consumers can hold their accumulators (setmaxnreg 232);
- the schedule: persistent, one CTA an SM walking the tiles of C (M fastest, so the CTAs of a
  wave share B's column tiles in L2), so the producer loads the next tile's k-tiles while the
  consumers store this one;
- the epilogue: accumulators rounded to bf16, written by stmatrix into a 4-deep ring of
  128 x 32 staging tiles (32 KB), each sent by one TMA store while the next is written.

Shared memory: 4 x 48 KB ring + 32 KB staging + the barriers = 225 KB of the H100's 227 KB.
Like NVIDIA's Hopper example `dense_gemm_persistent.py`, which this level follows, written
for one case: bf16, row-major A, B and C, no clusters.

CuTe DSL compiles the host function (TMA descriptors, grid) and the kernel together for one
shape; `compiled` does it without a GPU (fake tensors), `gemm` on a GPU from the tensors.
"""

from __future__ import annotations

import tempfile

import cuda.bindings.driver as cuda
import cutlass
import cutlass.utils.hopper_helpers as sm90
import torch
from cutlass import cute, pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cute.runtime import from_dlpack, make_fake_compact_tensor, make_fake_stream
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from kforge.device import sm_count

TILE_M, TILE_N, TILE_K = 128, 256, 64  # a CTA's tile of C, and the k-depth of one ring stage
STAGES = 4  # (227 KB - 32 KB staging - 1 KB barriers) // 48 KB a stage
EPILOGUE_TILE = (TILE_M, 32)  # one TMA store; a C tile is 8 of them
EPILOGUE_STAGES = 4  # a whole number of laps a tile (8 / 4), so a tile's first store reuses buffer 0
CONSUMER_WARPGROUPS = 2  # along M: each runs 64 x 256 wgmma
THREADS = 128 * (1 + CONSUMER_WARPGROUPS)  # the producer warpgroup, then the consumers
PRODUCER_REGISTERS, CONSUMER_REGISTERS = 40, 232  # setmaxnreg: 128 x (40 + 2 x 232) <= 64K
STORE_WARP = 4  # the first consumer warp issues the epilogue's TMA stores
H100_SMS = 132  # the persistent grid when compiling without a GPU

A_MAJOR = LayoutEnum.ROW_MAJOR  # A (M, K): K contiguous
B_MAJOR = LayoutEnum.COL_MAJOR  # B as (N, K): N contiguous
C_MAJOR = LayoutEnum.ROW_MAJOR  # C (M, N): N contiguous


class PersistentGemm:
    """The host function (`__call__`: layouts, TMA descriptors, grid, launch) and the kernel."""

    def __init__(self, sm_count: int):
        self.sm_count = sm_count
        self.shared_storage = None  # the kernel's shared-memory struct, made by __call__

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, stream: cuda.CUstream):
        tile_mnk = (TILE_M, TILE_N, TILE_K)
        tiled_mma = sm90.make_trivial_tiled_mma(
            cutlass.BFloat16, cutlass.BFloat16, A_MAJOR.sm90_mma_major_mode(), B_MAJOR.sm90_mma_major_mode(),
            cutlass.Float32, (CONSUMER_WARPGROUPS, 1, 1), tiler_mn=(64, TILE_N))
        # swizzled layouts, (rows, k, stage): what TMA writes and wgmma's descriptors read
        a_ring = sm90.make_smem_layout_a(A_MAJOR, tile_mnk, cutlass.BFloat16, STAGES)
        b_ring = sm90.make_smem_layout_b(B_MAJOR, tile_mnk, cutlass.BFloat16, STAGES)
        c_staging = sm90.make_smem_layout_epi(cutlass.BFloat16, C_MAJOR, EPILOGUE_TILE, EPILOGUE_STAGES)
        # the TMA descriptors, one box a copy, and the tensors of coordinates they are indexed with
        tma_a, a_coords = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), a, cute.slice_(a_ring, (None, None, 0)), (TILE_M, TILE_K))
        tma_b, b_coords = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), b, cute.slice_(b_ring, (None, None, 0)), (TILE_N, TILE_K))
        tma_c, c_coords = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), c, cute.slice_(c_staging, (None, None, 0)), EPILOGUE_TILE)

        grid = (min(cute.size(cute.ceil_div(c.shape, (TILE_M, TILE_N))), self.sm_count), 1, 1)  # persistent

        @cute.struct
        class SharedStorage:
            ring_barriers: cute.struct.MemRange[cutlass.Int64, 2 * STAGES]  # full and empty, a stage
            a_tiles: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(a_ring)], 1024]
            b_tiles: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(b_ring)], 1024]
            c_tiles: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(c_staging)], 1024]

        self.shared_storage = SharedStorage
        self.kernel(tma_a, a_coords, tma_b, b_coords, tma_c, c_coords, tiled_mma, a_ring, b_ring, c_staging).launch(
            grid=grid, block=[THREADS, 1, 1], min_blocks_per_mp=1, stream=stream)

    @cute.kernel
    def kernel(self, tma_a: cute.CopyAtom, a_coords: cute.Tensor, tma_b: cute.CopyAtom, b_coords: cute.Tensor,
               tma_c: cute.CopyAtom, c_coords: cute.Tensor, tiled_mma: cute.TiledMma,
               a_ring: cute.ComposedLayout, b_ring: cute.ComposedLayout, c_staging: cute.ComposedLayout):
        thread, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        role = cute.arch.make_warp_uniform(thread // 128)  # 0: producer warpgroup; 1, 2: consumers
        if warp == 0:
            for tma in (tma_a, tma_b, tma_c):
                cpasync.prefetch_descriptor(tma)

        storage = SmemAllocator().allocate(self.shared_storage)
        stage_bytes = cute.size_in_bytes(cutlass.BFloat16, cute.slice_(a_ring, (None, None, 0))) + \
            cute.size_in_bytes(cutlass.BFloat16, cute.slice_(b_ring, (None, None, 0)))
        ring = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.ring_barriers.data_ptr(), num_stages=STAGES, tx_count=stage_bytes,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),  # one thread arms "full"
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4 * CONSUMER_WARPGROUPS),  # a warp
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)), defer_sync=True)
        pipeline.pipeline_init_arrive()  # fence the mbarriers' init (made visible by pipeline_init_wait's sync)

        a_tiles = storage.a_tiles.get_tensor(a_ring.outer, swizzle=a_ring.inner)  # (128, 64, stage)
        b_tiles = storage.b_tiles.get_tensor(b_ring.outer, swizzle=b_ring.inner)  # (256, 64, stage)
        c_tiles = storage.c_tiles.get_tensor(c_staging.outer, swizzle=c_staging.inner)  # (128, 32, stage)
        # the global tensors cut into tiles: (rows, cols, row tile, col tile)
        a_global = cute.local_tile(a_coords, (TILE_M, TILE_K), (None, None))
        b_global = cute.local_tile(b_coords, (TILE_N, TILE_K), (None, None))
        c_global = cute.local_tile(c_coords, (TILE_M, TILE_N), (None, None))
        k_tiles = cute.size(a_global, mode=[3])
        tiles_m = cute.size(c_global, mode=[2])
        tiles = tiles_m * cute.size(c_global, mode=[3])
        first_tile, _, _ = cute.arch.block_idx()
        ctas, _, _ = cute.arch.grid_dim()  # each role walks tiles first_tile, first_tile + ctas, ...
        # TMA's view of each side: (box, stage) in shared memory, (box, row tile, k tile) in global
        a_boxes, a_global_boxes = cpasync.tma_partition(tma_a, 0, cute.make_layout(1), cute.group_modes(a_tiles, 0, 2),
                                                        cute.group_modes(a_global, 0, 2))
        b_boxes, b_global_boxes = cpasync.tma_partition(tma_b, 0, cute.make_layout(1), cute.group_modes(b_tiles, 0, 2),
                                                        cute.group_modes(b_global, 0, 2))
        pipeline.pipeline_init_wait()  # no cluster: a CTA-wide barrier

        if role == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGISTERS)
            if warp == 0:  # one warp issues every load; the others only give their registers away
                fill = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, STAGES)
                for tile in cutlass.range(first_tile, tiles, ctas, unroll=1):
                    tile_m, tile_n = tile % tiles_m, tile // tiles_m
                    for k_tile in cutlass.range(k_tiles, unroll=1):
                        ring.producer_acquire(fill)  # the stage is empty; arm "full" with its bytes
                        full = ring.producer_get_barrier(fill)
                        cute.copy(tma_a, a_global_boxes[(None, tile_m, k_tile)], a_boxes[(None, fill.index)],
                                  tma_bar_ptr=full)
                        cute.copy(tma_b, b_global_boxes[(None, tile_n, k_tile)], b_boxes[(None, fill.index)],
                                  tma_bar_ptr=full)
                        ring.producer_commit(fill)
                        fill.advance()
                ring.producer_tail(fill)  # wait until the consumers released every stage before exiting

        if role > 0:
            cute.arch.setmaxregister_increase(CONSUMER_REGISTERS)
            consumer_thread = thread - 128
            # this warpgroup's share of the MMA: wgmma descriptors into the ring, fp32 accumulators
            mma = tiled_mma.get_slice((role - 1) * 128)
            a_operand = tiled_mma.make_fragment_A(mma.partition_A(a_tiles))  # (MMA, M, k16 block, stage)
            b_operand = tiled_mma.make_fragment_B(mma.partition_B(b_tiles))
            accumulators = cute.make_rmem_tensor(mma.partition_C(c_global).shape[:3], cutlass.Float32)
            k_blocks = cute.size(a_operand, mode=[2])  # 4 wgmma (k16) a 64-deep k-tile

            # the epilogue: registers -> stmatrix -> staging tile -> TMA store, 128 x 32 at a time
            stmatrix = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), cutlass.BFloat16)
            to_staging = cute.make_tiled_copy_S(stmatrix, cute.make_tiled_copy_C_atom(stmatrix, tiled_mma))
            my_staging = to_staging.get_slice(consumer_thread)
            staging_slots = my_staging.partition_D(c_tiles)  # (copy, M, N, stage)
            accumulators_by_store = to_staging.retile(accumulators)  # the same registers in store order
            one_store = cute.shape(my_staging.partition_S(c_tiles))[:3]
            values_fp32 = cute.make_rmem_tensor(one_store, cutlass.Float32)
            values_bf16 = cute.make_rmem_tensor(one_store, cutlass.BFloat16)
            consumers_sync = pipeline.NamedBarrier(barrier_id=1, num_threads=128 * CONSUMER_WARPGROUPS)
            stores = pipeline.PipelineTmaStore.create(
                num_stages=EPILOGUE_STAGES,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 128 * CONSUMER_WARPGROUPS))

            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)  # D += A @ B on zeroed accumulators
            read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
            release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
            for tile in cutlass.range(first_tile, tiles, ctas, unroll=1):
                tile_m, tile_n = tile % tiles_m, tile // tiles_m
                # mainloop: C_tile += A[:, k-tile] @ B[k-tile, :], one k-tile of wgmma kept in flight
                accumulators.fill(0.0)
                for k_tile in cutlass.range(k_tiles, unroll=1):
                    ring.consumer_wait(read)  # TMA's bytes for this stage have landed
                    warpgroup.fence()
                    for k_block in cutlass.range_constexpr(k_blocks):
                        block = (None, None, k_block, read.index)
                        cute.gemm(tiled_mma, accumulators, a_operand[block], b_operand[block], accumulators)
                    warpgroup.commit_group()
                    warpgroup.wait_group(1)  # the previous k-tile's wgmma are done: its stage may be refilled
                    if k_tile > 0:
                        ring.consumer_release(release)
                        release.advance()
                    read.advance()
                warpgroup.wait_group(0)
                ring.consumer_release(release)  # the last k-tile's stage
                release.advance()

                # epilogue: 8 stores of 128 x 32, each through one of 4 staging buffers
                c_subtiles = cute.zipped_divide(c_global[(None, None, tile_m, tile_n)], EPILOGUE_TILE)
                staging_boxes, c_boxes = cpasync.tma_partition(tma_c, 0, cute.make_layout(1),
                                                               cute.group_modes(c_tiles, 0, 2), c_subtiles)
                per_store = cute.size(values_fp32)
                for subtile in cutlass.range_constexpr(cute.size(c_subtiles, mode=[1])):
                    for i in cutlass.range_constexpr(per_store):
                        values_fp32[i] = accumulators_by_store[subtile * per_store + i]
                    values_bf16.store(values_fp32.load().to(cutlass.BFloat16))  # round once, to nearest even
                    buffer = subtile % EPILOGUE_STAGES
                    cute.copy(to_staging, values_bf16, staging_slots[(None, None, None, buffer)])
                    cute.arch.fence_proxy("async.shared", space="cta")  # stmatrix's writes, visible to TMA
                    consumers_sync.arrive_and_wait()
                    if warp == STORE_WARP:
                        cute.copy(tma_c, staging_boxes[(None, buffer)], c_boxes[(None, subtile)])
                        stores.producer_commit()
                        stores.producer_acquire()  # the buffer the next store writes has been read
                    consumers_sync.arrive_and_wait()
            if warp == STORE_WARP:
                stores.producer_tail()  # every store has read its staging buffer before the CTA exits


def _compile(sm_count: int, a, b, c, stream, options: str = ""):
    """`PersistentGemm` for the layouts of a (M, K), b (N, K) and c (M, N), for sm_90a (wgmma and
    setmaxnreg exist nowhere else): host function and kernel, with no GPU needed."""
    return cute.compile(PersistentGemm(sm_count), a, b, c, stream, options=f"--gpu-arch=sm_90a {options}")


def _fake(rows: int, cols: int, contiguous_dim: int):
    """A bf16 (rows, cols) tensor for compiling: no memory, 16-byte-aligned like a torch allocation."""
    order = (1, 0) if contiguous_dim == 1 else (0, 1)
    return make_fake_compact_tensor(cutlass.BFloat16, (rows, cols), stride_order=order, assumed_align=16)


def compiled(m: int, n: int, k: int):
    """The kernel for one shape on the H100, from fake tensors; `--keep-cubin` hands its cubin back
    in `.artifacts.CUBIN` (written, on the way, to a scratch folder)."""
    with tempfile.TemporaryDirectory(prefix="kforge-cute-") as scratch:
        return _compile(H100_SMS, _fake(m, k, 1), _fake(n, k, 0), _fake(m, n, 1), make_fake_stream(),
                        f"--keep-cubin --dump-dir={scratch}")


def operands(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> list[cute.Tensor]:
    """The torch tensors as CuTe tensors (static layouts): a (M, K), b.t() as B (N, K), N-major, c (M, N)."""
    return [from_dlpack(t, assumed_align=16) for t in (a, b.t(), c)]


def compiled_for(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, sm_count: int, stream: cuda.CUstream):
    """The kernel for these tensors, as `gemm` compiles it (their layouts only: no memory is read)."""
    return _compile(sm_count, *operands(a, b, c), stream)


_ON_DEVICE: dict[tuple[int, int, int], object] = {}


def gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """C = a @ b for bf16 a (M x K) and b (K x N), both contiguous, K and N multiples of 8 (TMA's
    16-byte strides), on a Hopper GPU. Compiled on first use of each shape."""
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16 or a.dim() != 2 or b.dim() != 2 \
            or a.shape[1] != b.shape[0] or not (a.is_contiguous() and b.is_contiguous()) \
            or a.shape[1] % 8 or b.shape[1] % 8:
        raise ValueError(f"cute_gemm: needs contiguous 2-D bf16 a (M x K) and b (K x N), K and N multiples of 8, "
                         f"got {a.dtype} {tuple(a.shape)} @ {b.dtype} {tuple(b.shape)}")
    if torch.cuda.get_device_capability(a.device) != (9, 0):
        raise ValueError(f"cute_gemm: wgmma needs a Hopper GPU (sm_90), got {torch.cuda.get_device_name(a.device)}")
    (m, k), n = a.shape, b.shape[1]
    c = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    if k == 0:
        return c.zero_()
    if c.numel():
        stream = cuda.CUstream(torch.cuda.current_stream(a.device).cuda_stream)
        if (m, n, k) not in _ON_DEVICE:
            _ON_DEVICE[(m, n, k)] = compiled_for(a, b, c, sm_count(a.device), stream)
        _ON_DEVICE[(m, n, k)](*operands(a, b, c), stream)
    return c

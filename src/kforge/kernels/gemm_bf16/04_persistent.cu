// Rung 4: a persistent kernel with a tile scheduler, and the epilogue through shared
// memory and a TMA store.
// What changed: one CTA per SM for the whole GEMM (grid = SMs), each walking the output
// tiles job = blockIdx.x, + gridDim.x, ... in grouped order (GROUP_M rows of tiles at a
// time, so the tiles in flight share panels of A and B in L2). The producer runs ahead
// into the next tile while the consumers finish this one: the ring's stage and phase
// counters carry on across tiles, so there is no prologue bubble per tile. Results go
// registers -> swizzled shared memory (conflict-free) -> one bulk tensor store per
// 64 x 64 box, replacing rung 3's scattered 4-byte global stores. The tile leaves in
// EPI_COLS-wide slices through one small buffer, which leaves room for a 4th stage. With
// EPI_BUFFERS 2 the slices alternate between two buffers, so a slice waits only for the
// store two slices back, not for the one just issued (same shared memory at half the width).
// Also here, compiled out at CLUSTER_M 1: rung 5's thread-block clusters (see 05_clusters.cu).
// Split-K, for shapes with fewer tiles than SMs (skinny M, or 1024^3: 32 tiles on 132 SMs):
// compiled in with SPLIT_K 1 (its registers do not fit beside a 128 x 256 tile's
// accumulators: use it with BN 128), then with `splits` > 1 a job is one K range of one tile. Each split leaves its fp32 partial in
// a global workspace (only rows inside C), counts itself in on a per-tile counter, and the
// last to arrive adds the others' partials in split order (the same sum whoever is last),
// resets the counter for the next launch and stores the tile. No split ever waits.
// A fused epilogue (EPI_BIAS, EPI_ACT, EPI_RESIDUAL) applies a bias, an activation and a
// residual add to the fp32 accumulator slice by slice, just before it is rounded: what eager
// PyTorch does in further passes over C costs here ALU time and the residual's read.
// WG_ROWS 128 (with BM 256, BN 128) gives each consumer a 128 x 128 slab as two 64 x 128
// accumulators, the same B slice multiplied by both halves of its A rows: cuBLAS's tile
// shape at 4096^3 (ncu, 2026-11-22). Measured the same as 128 x 256 (0.974x against 0.976x
// cuBLAS at 4096^3, 1.010x against 1.008x at 8192^3; scripts/gemm_bf16_variants.py tiles),
// so the shape is not what cuBLAS's last 2% comes from.
// Why: rung 3 paid a launch-sized pipeline fill and a global-store epilogue per tile,
// and its last wave left most SMs idle.
// Predicted: parity with cuBLAS at 4096^3 and above.
#include "hopper.cuh"

#ifndef BM
#define BM 128  // 64 rows per consumer warpgroup
#endif
#ifndef BN
#define BN 256
#endif
#ifndef BK
#define BK 64
#endif
#ifndef STAGES
#define STAGES 4
#endif
#ifndef EPI_COLS
#define EPI_COLS 128  // the epilogue stores the tile in slices this wide (less shared memory, more stages)
#endif
#ifndef EPI_BUFFERS
#define EPI_BUFFERS 1  // epilogue slice buffers per consumer: 2 lets one slice fill while the last is stored
#endif
#ifndef GROUP_M
#define GROUP_M 8
#endif
#ifndef CLUSTER_M
#define CLUSTER_M 1  // CTAs per cluster, on consecutive row tiles sharing one column of B
#endif
#ifndef SPLIT_K
#define SPLIT_K 0  // 1: compile the split-K path in (see above); 0: `split_count` is ignored
#endif
#ifndef B_KMAJOR
#define B_KMAJOR 0  // 1: B is given as N x K (C = A @ B^T); 0: B is K x N
#endif
#ifndef EPI_BIAS
#define EPI_BIAS 0  // 1: C = act(A B + bias), a bf16 bias per column, added in fp32 before the rounding
#endif
#ifndef EPI_ACT
#define EPI_ACT 0  // the activation after the bias: 0 none, 1 GELU (erf), 2 GELU (tanh), 3 SiLU
#endif
#ifndef EPI_RESIDUAL
#define EPI_RESIDUAL 0  // 1: then + residual, a bf16 M x N tensor (a transformer's residual stream)
#endif

#ifndef WG_ROWS
#define WG_ROWS 64  // rows a consumer warpgroup owns: 64 (one m64 wgmma a k-step) or 128 (two: 256 x 128 tiles)
#endif
#define CONSUMERS (BM / WG_ROWS)
#define NUM_THREADS (128 * (CONSUMERS + 1))
#define A_TILE (BM * BK)
#define B_TILE (BN * BK)
#define C_TILE (64 * EPI_COLS * EPI_BUFFERS)  // one consumer's epilogue buffers: slices of its 64 x BN share
#define STAGE_BYTES ((A_TILE + B_TILE) * 2)
#define SHARED_BYTES (STAGES * STAGE_BYTES + CONSUMERS * C_TILE * 2 + 1024 + 2 * STAGES * 8)
#define B_CHUNKS (BN / 64)  // 64-column boxes of an N-major B tile
static_assert(BK == 64, "the swizzle atom is one 64-value row");
static_assert(SHARED_BYTES <= 227 * 1024, "fits one block's shared memory");
static_assert(CONSUMERS == 2, "the register split below is for one producer and two consumers");
static_assert(WG_ROWS == 64 || (WG_ROWS == 128 && BN == 128 && !SPLIT_K),
              "128 rows a warpgroup: two 64 x 128 accumulators, the registers of one 64 x 256");
static_assert(BN % EPI_COLS == 0 && EPI_COLS % 64 == 0, "the epilogue slices the tile into 64-column boxes");
static_assert(EPI_BUFFERS == 1 || EPI_BUFFERS == 2, "one epilogue buffer, or two in turn");
static_assert(B_CHUNKS % CLUSTER_M == 0, "each CTA of a cluster loads an equal share of B");

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
gemm(const __grid_constant__ TensorMap a_map, const __grid_constant__ TensorMap b_map,
     const __grid_constant__ TensorMap c_map, int M, int N, int K, int split_count, float4* __restrict__ partials,
     int* __restrict__ arrivals, const bf16_bits* __restrict__ bias, const bf16_bits* __restrict__ residual) {
    const int splits = SPLIT_K ? split_count : 1;
    check_launch(NUM_THREADS, SHARED_BYTES);
    extern __shared__ __align__(16) unsigned char smem_raw[];  // aligned to 1024 by hand below
#if SPLIT_K
    __shared__ int last_split[CONSUMERS];  // whether this warpgroup's split arrived last
#endif
    bf16_bits* tiles = reinterpret_cast<bf16_bits*>((reinterpret_cast<size_t>(smem_raw) + 1023) & ~size_t(1023));
    bf16_bits* c_tiles = tiles + STAGES * (A_TILE + B_TILE);
    u64* full = reinterpret_cast<u64*>(c_tiles + CONSUMERS * C_TILE);
    u64* empty = full + STAGES;
    auto a_tile = [&](int s) { return tiles + s * (A_TILE + B_TILE); };
    auto b_tile = [&](int s) { return tiles + s * (A_TILE + B_TILE) + A_TILE; };

    const int tiles_m = CEIL_DIV(M, BM), tiles_n = CEIL_DIV(N, BN), k_tiles = CEIL_DIV(K, BK);
    // A job is one tile per CTA of a cluster: CLUSTER_M consecutive row tiles, one column.
    const int jobs = CEIL_DIV(tiles_m, CLUSTER_M) * tiles_n * splits;
    const int first_job = blockIdx.x / CLUSTER_M, job_stride = gridDim.x / CLUSTER_M;
    const u32 rank = CLUSTER_M > 1 ? cluster_rank() : 0;
    const int wg = threadIdx.x / 128, lane = threadIdx.x % 32;

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], CONSUMERS * 4 * CLUSTER_M);  // every consumer warp of the cluster
        }
        fence_barrier_init();
    }
    if (CLUSTER_M > 1) cluster_sync();  // no CTA may signal a peer's barriers before they exist
    else __syncthreads();

    if (wg == 0) {  // producer
        setmaxnreg_dec<40>();
        if (threadIdx.x == 0) {
            int it = 0;  // k-tiles loaded so far, across jobs: the ring position
            for (int job = first_job; job < jobs; job += job_stride) {
                int cm, tn;
                tile_coords(job / splits, CEIL_DIV(tiles_m, CLUSTER_M), tiles_n, GROUP_M, cm, tn);
                const int row0 = (cm * CLUSTER_M + rank) * BM, col0 = tn * BN, split = job % splits;
                for (int kt = split * k_tiles / splits; kt < (split + 1) * k_tiles / splits; ++kt, ++it) {
                    const int s = it % STAGES;
                    mbar_wait(&empty[s], ((it / STAGES) & 1) ^ 1);
                    mbar_arrive_expect_tx(&full[s], STAGE_BYTES);  // all of B arrives, our share and the peers'
                    tma_load_2d(a_tile(s), a_map, &full[s], kt * BK, row0);
                    if (CLUSTER_M == 1) {
                        if (B_KMAJOR) tma_load_2d(b_tile(s), b_map, &full[s], kt * BK, col0);
                        else
                            for (int c = 0; c < B_CHUNKS; ++c)
                                tma_load_2d(b_tile(s) + c * BK * 64, b_map, &full[s], col0 + 64 * c, kt * BK);
                    } else {  // rung 5: this CTA's share of B, written into every CTA of the cluster
                        const unsigned short everyone = (1u << CLUSTER_M) - 1;
                        if (B_KMAJOR) {
                            const int rows = BN / CLUSTER_M;
                            tma_load_2d_multicast(b_tile(s) + rank * rows * BK, b_map, &full[s], kt * BK,
                                                  col0 + rank * rows, everyone);
                        } else {
                            for (int c = rank * (B_CHUNKS / CLUSTER_M); c < (rank + 1) * (B_CHUNKS / CLUSTER_M); ++c)
                                tma_load_2d_multicast(b_tile(s) + c * BK * 64, b_map, &full[s], col0 + 64 * c,
                                                      kt * BK, everyone);
                        }
                    }
                }
            }
        }
    } else {  // consumers
        setmaxnreg_inc<232>();
        const int consumer = wg - 1, thread = threadIdx.x % 128;
        bf16_bits* c_tile = c_tiles + consumer * C_TILE;
        auto release = [&](int s) {  // this warp is done reading stage s, in every CTA it was loaded for
            if (lane != 0) return;
            if (CLUSTER_M == 1) mbar_arrive(&empty[s]);
            else
                for (int r = 0; r < CLUSTER_M; ++r) mbar_arrive_cluster(&empty[s], r);
        };
        float acc[BN / 2], acc_lower[BN / 2];  // acc_lower: rows 64-127 of the warpgroup's slab (WG_ROWS 128)
        int it = 0;
        for (int job = first_job; job < jobs; job += job_stride) {
            int cm, tn;
            tile_coords(job / splits, CEIL_DIV(tiles_m, CLUSTER_M), tiles_n, GROUP_M, cm, tn);
            const int row0 = (cm * CLUSTER_M + rank) * BM, col0 = tn * BN, split = job % splits;
            const int kt_begin = split * k_tiles / splits, kt_end = (split + 1) * k_tiles / splits;
            for (int kt = kt_begin; kt < kt_end; ++kt, ++it) {
                const int s = it % STAGES;
                mbar_wait(&full[s], (it / STAGES) & 1);
                wgmma_fence();
#pragma unroll
                for (int ks = 0; ks < BK / 16; ++ks) {
                    const u64 a = kmajor_desc(a_tile(s) + consumer * WG_ROWS * BK, ks);
                    const u64 b = B_KMAJOR ? kmajor_desc(b_tile(s), ks) : nmajor_desc<BK>(b_tile(s), ks);
                    wgmma_m64k16<BN, !B_KMAJOR>(acc, a, b, kt > kt_begin || ks > 0);
                    if constexpr (WG_ROWS == 128) {  // the same B slice against the slab's lower 64 rows
                        const u64 a_lower = kmajor_desc(a_tile(s) + (consumer * WG_ROWS + 64) * BK, ks);
                        wgmma_m64k16<BN, !B_KMAJOR>(acc_lower, a_lower, b, kt > kt_begin || ks > 0);
                    }
                }
                wgmma_commit();
                wgmma_wait<1>();
                if (kt > kt_begin) release((it - 1) % STAGES);
            }
            wgmma_wait<0>();
#if SPLIT_K
            if (kt_end > kt_begin) release((it - 1) % STAGES);
            else
#pragma unroll
                for (int i = 0; i < BN / 2; ++i) acc[i] = 0.0f;  // an empty K range (more splits than k-tiles)
#else
            release((it - 1) % STAGES);  // (K > 0: the host returns zeros itself for K = 0)
#endif

#if SPLIT_K
            if (splits > 1) {
                const int first_row = row0 + consumer * 64;  // of this warpgroup's 64 x BN slice
                if (first_row >= M) continue;  // entirely outside C: nothing to add up or store
                // This warp's 16 rows as 32 lanes x BN/2 registers, lane-fastest: coalesced 16-byte accesses.
                const int warp = (thread / 32), slice = ((cm * CLUSTER_M + rank) * tiles_n + tn) * CONSUMERS + consumer;
                const bool rows_in_c = first_row + 16 * warp < M;
                auto part = [&](int sp) { return partials + ((size_t(slice) * splits + sp) * 4 + warp) * (BN / 8) * 32; };
                if (rows_in_c)
#pragma unroll
                    for (int q = 0; q < BN / 8; ++q)
                        part(split)[q * 32 + lane] = make_float4(acc[4 * q], acc[4 * q + 1], acc[4 * q + 2], acc[4 * q + 3]);
                __threadfence();  // our partial is visible before we count ourselves in
                named_barrier(1 + consumer, 128);
                if (thread == 0) last_split[consumer] = atomicAdd(&arrivals[slice], 1) == splits - 1;
                named_barrier(1 + consumer, 128);
                if (!last_split[consumer]) continue;
                __threadfence();
                // Every partial (our own too) read back in split order: the same sum whoever is last.
                // A split's BN/8 loads are independent and in flight together; a loop over splits
                // inside the loop over registers would wait out one load latency per register group.
                if (rows_in_c) {
#pragma unroll
                    for (int q = 0; q < BN / 8; ++q) {
                        const float4 x = __ldcg(part(0) + q * 32 + lane);
                        acc[4 * q] = x.x, acc[4 * q + 1] = x.y, acc[4 * q + 2] = x.z, acc[4 * q + 3] = x.w;
                    }
                    for (int sp = 1; sp < splits; ++sp)
#pragma unroll
                        for (int q = 0; q < BN / 8; ++q) {
                            const float4 x = __ldcg(part(sp) + q * 32 + lane);
                            acc[4 * q] += x.x, acc[4 * q + 1] += x.y, acc[4 * q + 2] += x.z, acc[4 * q + 3] += x.w;
                        }
                }
                if (thread == 0) arrivals[slice] = 0;  // every split has arrived: ready for the next launch
            }
#endif

            // Epilogue, slice by slice: wait until the buffer's previous store has read it, fill it, store it.
            // Stores complete in order, so with two buffers "all but the latest group" is this buffer's.
            auto store_rows = [&](const float (&d)[BN / 2], int first_row) {  // one 64-row accumulator
#pragma unroll
                for (int first = 0; first < BN; first += EPI_COLS) {
                    bf16_bits* slice = c_tile + (first / EPI_COLS) % EPI_BUFFERS * 64 * EPI_COLS;
                    if (thread == 0) bulk_wait_read<EPI_BUFFERS - 1>();
                    named_barrier(1 + consumer, 128);
                    store_cols_swizzled<BN, EPI_COLS, EPI_BIAS, EPI_ACT, EPI_RESIDUAL>(
                        d, slice, first, first_row, col0, M, N, bias, residual);
                    fence_proxy_async();
                    named_barrier(1 + consumer, 128);
                    if (thread == 0) {
                        for (int c = 0; c < EPI_COLS / 64; ++c)
                            tma_store_2d(c_map, slice + c * 64 * 64, col0 + first + 64 * c, first_row);
                        bulk_commit();
                    }
                }
            };
            store_rows(acc, row0 + consumer * WG_ROWS);
            if constexpr (WG_ROWS == 128) store_rows(acc_lower, row0 + consumer * WG_ROWS + 64);
        }
        if (thread == 0) bulk_wait_read();  // the CTA's shared memory must outlive the last store's reads
    }
    if (CLUSTER_M > 1) cluster_sync();  // peers may still arrive on our barriers until they finish
}

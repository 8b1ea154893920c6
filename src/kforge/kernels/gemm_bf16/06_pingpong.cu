// Rung 6: ping-pong consumers: each consumer warpgroup owns a whole tile, and the two take
// turns at the tensor cores, one's epilogue running under the other's mainloop.
// What changed from rung 4: there, both consumers computed halves of one 128 x 256 tile,
// so both reached the epilogue together and the tensor cores idled while the tile went
// out through shared memory (an ncu profile showed consumers waiting at barriers where
// cuBLAS's wait on wgmma). Here a CTA's jobs alternate between the consumers (its 0th,
// 2nd, ... job to consumer 0, its 1st, 3rd, ... to consumer 1), each a BM x BN tile with
// two 64-row accumulators (two m64 wgmmas per k-slice). The producer loads the jobs' k-tiles
// into the ring in job order, so a consumer finds its tile's stages at ring position
// job * k_tiles. An ordered pair of mbarriers passes the mainloop from one consumer to the
// other: a consumer starts its k-loop only once the other has passed all of its own waits,
// which also keeps every ring barrier within one phase of what its waiter expects (the
// parity wait cannot tell phase p from p + 2). The epilogue is rung 4's: registers ->
// swizzled shared memory -> TMA stores, per consumer, EPI_COLS columns at a time.
// Why: at 4096^3 the 128 x 256 cooperative tile pays its epilogue ~64 times per SM with
// the tensor cores idle; a fused epilogue (bias, an activation) only adds to that pause.
// Predicted: the epilogue hidden; the cost is 128 x 128 tiles' arithmetic intensity (a third
// more shared-memory and L2 traffic per FLOP than 128 x 256).
// Measured (H100, device time against cuBLAS, scripts/gemm_bf16_variants.py): the epilogue is
// not what holds rung 4 back at 4096^3 (0.92x cuBLAS here, rung 4 0.99x; 6 stages of 128 x 128
// hold 1.75 us of tensor-core work, rung 4's 4 stages of 128 x 256 hold 2.3 us). Its 128 x 128
// tiles fill a ragged last wave better: 8192 x 768 x 3072 (1.45 waves of 128 x 256) at 0.95x
// cuBLAS against rung 4's 0.80x, so `best_kernel` takes it where rung 4's last wave would be
// under 3/4 full.
// History: docs/worklogs/gemm-bf16.md.
#include "hopper.cuh"

#ifndef BM
#define BM 128  // rows of one consumer's tile: two 64-row wgmma accumulators
#endif
#ifndef BN
#define BN 128
#endif
#ifndef BK
#define BK 64
#endif
#ifndef STAGES
#define STAGES 6
#endif
#ifndef EPI_COLS
#define EPI_COLS 64  // the epilogue stores a 64-row half in slices this wide
#endif
#ifndef GROUP_M
#define GROUP_M 8
#endif
#ifndef B_KMAJOR
#define B_KMAJOR 0  // 1: B is given as N x K (C = A @ B^T); 0: B is K x N
#endif

#ifndef EPI_BIAS
#define EPI_BIAS 0  // as rung 4: a bf16 bias per column
#endif
#ifndef EPI_ACT
#define EPI_ACT 0  // as rung 4: 0 none, 1 GELU (erf), 2 GELU (tanh), 3 SiLU
#endif
#ifndef EPI_RESIDUAL
#define EPI_RESIDUAL 0  // as rung 4: + a bf16 M x N residual
#endif

#define CONSUMERS 2
#define NUM_THREADS (128 * (CONSUMERS + 1))
#define A_TILE (BM * BK)
#define B_TILE (BN * BK)
#define C_TILE (64 * EPI_COLS)  // one consumer's epilogue buffer
#define STAGE_BYTES ((A_TILE + B_TILE) * 2)
#define SHARED_BYTES (STAGES * STAGE_BYTES + CONSUMERS * C_TILE * 2 + 1024 + 2 * STAGES * 8 + CONSUMERS * 8)
#define B_CHUNKS (BN / 64)  // 64-column boxes of an N-major B tile
static_assert(BK == 64, "the swizzle atom is one 64-value row");
static_assert(BM == 128, "a consumer's tile is two 64-row accumulators");
static_assert(BN == 128, "two 64 x BN fp32 accumulators: 128 registers a thread at BN 128");
static_assert(SHARED_BYTES <= 227 * 1024, "fits one block's shared memory");
static_assert(BN % EPI_COLS == 0 && EPI_COLS % 64 == 0, "the epilogue slices the tile into 64-column boxes");

// One 64-row half of a consumer's tile, out through its buffer: wait until the buffer's
// previous store has read it, fill it (swizzled), store it, EPI_COLS columns at a time.
__device__ __forceinline__ void store_half(const float (&acc)[BN / 2], bf16_bits* c_tile, const TensorMap& c_map, int row,
                                           int col0, int M, int N, const bf16_bits* __restrict__ bias,
                                           const bf16_bits* __restrict__ residual, int consumer, int thread) {
#pragma unroll
    for (int first = 0; first < BN; first += EPI_COLS) {
        if (thread == 0) bulk_wait_read();
        named_barrier(1 + consumer, 128);
        store_cols_swizzled<BN, EPI_COLS, EPI_BIAS, EPI_ACT, EPI_RESIDUAL>(acc, c_tile, first, row, col0, M, N, bias,
                                                                           residual);
        fence_proxy_async();
        named_barrier(1 + consumer, 128);
        if (thread == 0) {
            for (int c = 0; c < EPI_COLS / 64; ++c) tma_store_2d(c_map, c_tile + c * 64 * 64, col0 + first + 64 * c, row);
            bulk_commit();
        }
    }
}

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
gemm(const __grid_constant__ TensorMap a_map, const __grid_constant__ TensorMap b_map,
     const __grid_constant__ TensorMap c_map, int M, int N, int K, int split_count, float4* __restrict__ partials,
     int* __restrict__ arrivals, const bf16_bits* __restrict__ bias, const bf16_bits* __restrict__ residual,
     const bf16_bits* __restrict__ norm_gamma, float norm_eps) {  // (the norm: rung 4 only)
    (void)split_count, (void)partials, (void)arrivals;  // the persistent rungs' signature; no split-K here
    check_launch(NUM_THREADS, SHARED_BYTES);
    extern __shared__ __align__(16) unsigned char smem_raw[];  // aligned to 1024 by hand below
    bf16_bits* tiles = reinterpret_cast<bf16_bits*>((reinterpret_cast<size_t>(smem_raw) + 1023) & ~size_t(1023));
    bf16_bits* c_tiles = tiles + STAGES * (A_TILE + B_TILE);
    u64* full = reinterpret_cast<u64*>(c_tiles + CONSUMERS * C_TILE);
    u64* empty = full + STAGES;
    u64* turn = empty + STAGES;  // turn[c]: the other consumer has finished its waits; c may start its k-loop
    auto a_tile = [&](int s) { return tiles + s * (A_TILE + B_TILE); };
    auto b_tile = [&](int s) { return tiles + s * (A_TILE + B_TILE) + A_TILE; };

    const int tiles_m = CEIL_DIV(M, BM), tiles_n = CEIL_DIV(N, BN), k_tiles = CEIL_DIV(K, BK);
    const int jobs = tiles_m * tiles_n;
    const int wg = threadIdx.x / 128, lane = threadIdx.x % 32;

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], 4);  // the warps of the one consumer that reads the stage
        }
        for (int c = 0; c < CONSUMERS; ++c) mbar_init(&turn[c], 1);
        fence_barrier_init();
    }
    __syncthreads();

    if (wg == 0) {  // producer: every job's k-tiles, in job order
        setmaxnreg_dec<40>();
        if (threadIdx.x == 0) {
            int it = 0;
            for (int job = blockIdx.x; job < jobs; job += gridDim.x) {
                int tm, tn;
                tile_coords(job, tiles_m, tiles_n, GROUP_M, tm, tn);
                for (int kt = 0; kt < k_tiles; ++kt, ++it) {
                    const int s = it % STAGES;
                    mbar_wait(&empty[s], ((it / STAGES) & 1) ^ 1);
                    mbar_arrive_expect_tx(&full[s], STAGE_BYTES);
                    tma_load_2d(a_tile(s), a_map, &full[s], kt * BK, tm * BM);
                    if (B_KMAJOR) tma_load_2d(b_tile(s), b_map, &full[s], kt * BK, tn * BN);
                    else
                        for (int c = 0; c < B_CHUNKS; ++c)
                            tma_load_2d(b_tile(s) + c * BK * 64, b_map, &full[s], tn * BN + 64 * c, kt * BK);
                }
            }
        }
    } else {  // consumers: jobs consumer, consumer + 2, ... of this CTA's sequence
        setmaxnreg_inc<232>();
        const int consumer = wg - 1, thread = threadIdx.x % 128;
        bf16_bits* c_tile = c_tiles + consumer * C_TILE;
        float acc0[BN / 2], acc1[BN / 2];  // rows 0-63 and 64-127 of the tile
        int turns = 0;  // k-loops this consumer has run
        for (int local = consumer, job = blockIdx.x + consumer * gridDim.x; job < jobs;
             local += CONSUMERS, job += CONSUMERS * gridDim.x, ++turns) {
            int tm, tn;
            tile_coords(job, tiles_m, tiles_n, GROUP_M, tm, tn);
            // Consumer 0's first turn is free; every other turn follows the other consumer's previous one.
            if (consumer == 1) mbar_wait(&turn[1], turns & 1);
            else if (turns > 0) mbar_wait(&turn[0], (turns - 1) & 1);
            const int it0 = local * k_tiles;
            for (int kt = 0; kt < k_tiles; ++kt) {
                const int it = it0 + kt, s = it % STAGES;
                mbar_wait(&full[s], (it / STAGES) & 1);
                wgmma_fence();
#pragma unroll
                for (int ks = 0; ks < BK / 16; ++ks) {
                    const u64 b = B_KMAJOR ? kmajor_desc(b_tile(s), ks) : nmajor_desc<BK>(b_tile(s), ks);
                    wgmma_m64k16<BN, !B_KMAJOR>(acc0, kmajor_desc(a_tile(s), ks), b, kt > 0 || ks > 0);
                    wgmma_m64k16<BN, !B_KMAJOR>(acc1, kmajor_desc(a_tile(s) + 64 * BK, ks), b, kt > 0 || ks > 0);
                }
                wgmma_commit();
                wgmma_wait<1>();
                if (kt > 0 && lane == 0) mbar_arrive(&empty[(it - 1) % STAGES]);
            }
            // Every wait of this tile has passed: the other consumer may start its k-loop.
            if (thread == 0) mbar_arrive(&turn[1 - consumer]);
            wgmma_wait<0>();
            if (lane == 0) mbar_arrive(&empty[(it0 + k_tiles - 1) % STAGES]);  // (K > 0: the host handles K = 0)
            store_half(acc0, c_tile, c_map, tm * BM, tn * BN, M, N, bias, residual, consumer, thread);
            store_half(acc1, c_tile, c_map, tm * BM + 64, tn * BN, M, N, bias, residual, consumer, thread);
        }
        if (thread == 0) bulk_wait_read();  // the CTA's shared memory must outlive the last store's reads
    }
}

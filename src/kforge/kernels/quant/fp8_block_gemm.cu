// Block-scaled FP8 GEMM on Hopper, as DeepGEMM scales it: C = sum_j (sa_j * sb_j) (A_j @ B_j^T)
// over the 128-wide K blocks j, A [M, K] and B [N, K] e4m3 (both K-major), sa [M, K/128] (one
// scale per row of A per block: 1 x 128 tiles), sb [ceil(N/128), K/128] (128 x 128 blocks of
// B), C [M, N] bf16. The schedule is rung 4's (gemm_bf16/04_persistent.cu): persistent, one
// producer warp feeding TMA boxes into a ring of STAGES, two consumer warpgroups of 64 rows,
// grouped tile order, the epilogue through swizzled shared memory and TMA stores.
//
// What block scales change. A scale is constant only within one 128-K block, so each block
// is its own wgmma chain (four m64n128k32 into a fresh `partial`) that the CUDA cores then
// scale and add into the running fp32 sum: acc += partial * (sa[row] * sb) (the promotion;
// it is also what keeps a long K sum exact, since the tensor cores' own fp8 accumulation
// keeps ~14 bits). The Triton kernel (fp8_gemm.py) keeps both warpgroups in step with a CTA
// barrier after every promotion, so the tensor cores idle while both promote (0.63x
// torch._scaled_mm rowwise, 886 TFLOP/s at 4096 x 7168 x 16384). Here the two consumer
// warpgroups run free of each other: while one promotes, the other's chain runs.
// A second partial (block j+1's chain issued before block j is promoted) fits the registers only
// at BN 128, and measured slower there than one partial.
//
// Where the scales come from. The producer warpgroup's three idle warps load each K block's
// sa for the tile's 128 rows and its sb, and store the products sa[row] * sb into the stage's
// scale slot before arriving on the stage's barrier (which counts the TMA thread and 32 loader
// lanes); a consumer reads its two rows' factors from shared memory. Before, each consumer
// thread loaded its scales from global memory every K block: the loads' address arithmetic
// and their latency sat in the consumers' path between chains.
//
// Tile 128 x BN x 128 bytes. BN = 128: a stage is 16 + 16 KB (+ 512 B of scales), 6 stages;
// registers 64 (acc) + 64 (partial). BN = 256: the two 128-column halves (one sb block
// each) take turns in the one partial, acc is 2 x 64; a stage is 16 + 32 KB (+ 1 KB), 4
// stages: A is read once per 256 columns. The epilogue goes out in 64 x 64 quarters through
// one 8 KB buffer a consumer. Registers: the producer warpgroup 56 (the loaders), the
// consumers 224.
//
// The promotion's scheduling bits are rewritten in the cubin (runtime/sass_control.py, as
// fp8_block_gemm.py loads it): ptxas yields at every other FFMA and re-reads the factor after
// each yield; yielding at every 8th FFMA of a run, with the factor kept in the operand-reuse
// cache between, is 2.5-2.9% faster.
//
// Measured on the H100 at 4096 x 7168 x 16384, BN 256 with clusters of two (kforge bench quant,
// benchmarks/results/nvidia-h100-80gb-hbm3/bench-quant.jsonl): 1,388-1,404 TFLOP/s, 93% of the
// measured fp8 matmul rate, 0.98-0.99x torch._scaled_mm rowwise and 1.60x bf16 cuBLAS on the same
// numbers. A timing-only build whose promotion multiplies by a constant (PROMOTE_TIMING) runs at
// 0.99-1.00x: the exact per-row factor still costs ~1.5%. Run back to back both kernels hold the
// board at its 700 W cap, and there ours is 1.02-1.04x rowwise. Versions, and the designs that
// lost (two partials, three consumers, consumers taking turns, a slice-ring epilogue, a K-split
// tail): docs/worklogs/quant.md.
// GROUPED 1 builds DeepGEMM's contiguous grouped GEMM (MoE prefill) on the same schedule: B is the
// experts' weights stacked [E * N, K] with sb [E, ceil(N/128), K/128], and m_indices [M] names each row's
// expert (-1 on padding rows); every expert's run of rows starts at a multiple of 128, so a 128-row tile
// belongs to the expert of its first row. Each role reads that entry and skips a padding tile (-1) the
// same way, so the ring's positions stay in step; B's tile comes from row expert * N + tile column, the
// scales from the expert's block. Rows of a tile whose entry is not the tile's expert (the run's padding)
// are not written: a 64-row slab holding any stores from registers, row by row; the others by TMA, as the
// plain build does (register stores for every slab cost 14%: 1.77 against 1.55 ms ungrouped). No clusters: two
// row tiles of a cluster may belong to two experts, so they share no B. GPU tests:
// tests/kernels/test_moe_grouped_gemm.py.
// Built from the Hopper parts (../hopper/): TMA loads and stores, mbarriers, wgmma (fp8_desc, the e4m3
// m64n128k32), the grouped tile order, the swizzled epilogue.
#include "../hopper/tma.cuh"
#include "../hopper/pipeline.cuh"
#include "../hopper/wgmma.cuh"
#include "../hopper/scheduler.cuh"
#include "../hopper/epilogue.cuh"

#ifndef STAGES
#define STAGES 4
#endif
#ifndef GROUP_M
#define GROUP_M 8
#endif
#ifndef CLUSTER_M
#define CLUSTER_M 1  // CTAs per cluster, on consecutive row tiles sharing one column of B (rung 5's multicast)
#endif

#ifndef GROUPED
#define GROUPED 0  // 1: the contiguous grouped GEMM of MoE (the header's last paragraph)
#endif
static_assert(!GROUPED || CLUSTER_M == 1, "a cluster's row tiles may belong to different experts: no shared B");

#ifndef BN
#define BN 256  // 128 or 256 columns: one or two 128-column blocks of sb (HALVES), promoted one at a time
#endif

#define BK 128  // one scale block; 128 bytes of e4m3, the 128-byte swizzle row
#define HALVES (BN / 128)
#define CONSUMERS 2  // warpgroups of 64 rows
#define BM (64 * CONSUMERS)
#define NUM_THREADS (128 * (CONSUMERS + 1))
#define STAGE_BYTES ((BM + BN) * BK)
#define C_TILE_BYTES (64 * 64 * 2)  // one consumer's epilogue buffer: a 64 x 64 quarter of its slab
#define SCALE_BYTES (HALVES * BM * 4)  // a stage's scales: sa[row] * sb[half] for the tile's rows and halves
// The producer warpgroup's idle warps that load scales, taking ring positions in turn: a divisor of STAGES,
// so each loader owns fixed slots and waits on each one's every phase in order (a loader that came back to a
// slot only every few laps could pass a parity wait meant for a later lap, and overwrite scales in use).
#define SCALE_LOADERS (STAGES % 3 == 0 ? 3 : STAGES % 2 == 0 ? 2 : 1)
#define SHARED_BYTES (STAGES * (STAGE_BYTES + SCALE_BYTES) + CONSUMERS * C_TILE_BYTES + 1024 + 2 * STAGES * 8)
static_assert(SHARED_BYTES <= 227 * 1024, "fits one block's shared memory");
static_assert(BN == 128 || BN == 256, "one or two 128-column halves");
#ifndef PROMOTE_TIMING
#define PROMOTE_TIMING 0  // TIMING ONLY, WRONG RESULTS (scripts/fp8_block_variants.py): the promotion
#endif                    // as 1: acc += p (FADD), 3: acc += p * constant

static_assert(BN % (8 * CLUSTER_M) == 0, "each CTA of a cluster loads an equal share of B's rows");

// The promotion of one 128-column half: acc += partial * (sa[row] * sb), the factor lo for this
// thread's upper row and hi for the row 8 below (register 4i + 2r + e: row 16 warp + lane/4 + 8r).
__device__ __forceinline__ void promote(float (&acc)[64], const float (&partial)[64], float lo, float hi) {
#if PROMOTE_TIMING == 0
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        acc[4 * i] = fmaf(partial[4 * i], lo, acc[4 * i]);
        acc[4 * i + 1] = fmaf(partial[4 * i + 1], lo, acc[4 * i + 1]);
        acc[4 * i + 2] = fmaf(partial[4 * i + 2], hi, acc[4 * i + 2]);
        acc[4 * i + 3] = fmaf(partial[4 * i + 3], hi, acc[4 * i + 3]);
    }
#elif PROMOTE_TIMING == 1
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] += partial[i];
#elif PROMOTE_TIMING == 3
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = fmaf(partial[i], 1.0009765625f, acc[i]);
#endif
}

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
fp8_block_gemm(const __grid_constant__ TensorMap a_map, const __grid_constant__ TensorMap b_map,
               const __grid_constant__ TensorMap c_map, int M, int N, int K, const float* __restrict__ a_scale,
               int sa_row_stride, int sa_block_stride, const float* __restrict__ b_scale, int sb_row_stride,
               int sb_block_stride
#if GROUPED
               , const int* __restrict__ m_indices, int sb_expert_stride, bf16_bits* __restrict__ C
#endif
               ) {
    check_launch(NUM_THREADS, SHARED_BYTES);
    extern __shared__ __align__(16) unsigned char smem_raw[];
    unsigned char* tiles =
        reinterpret_cast<unsigned char*>((reinterpret_cast<size_t>(smem_raw) + 1023) & ~size_t(1023));
    bf16_bits* c_tiles = reinterpret_cast<bf16_bits*>(tiles + STAGES * STAGE_BYTES);
    float* scale_ring = reinterpret_cast<float*>(tiles + STAGES * STAGE_BYTES + CONSUMERS * C_TILE_BYTES);
    u64* full = reinterpret_cast<u64*>(scale_ring + STAGES * SCALE_BYTES / 4);
    u64* empty = full + STAGES;
    auto a_tile = [&](int s) { return tiles + s * STAGE_BYTES; };
    auto b_tile = [&](int s) { return tiles + s * STAGE_BYTES + BM * BK; };

    const int tiles_m = CEIL_DIV(M, BM), tiles_n = CEIL_DIV(N, BN), k_blocks = K / BK;
    // A job is one tile per CTA of a cluster: CLUSTER_M consecutive row tiles, one column.
    const int cluster_rows = CEIL_DIV(tiles_m, CLUSTER_M), jobs = cluster_rows * tiles_n;
    const int first_job = blockIdx.x / CLUSTER_M, job_stride = gridDim.x / CLUSTER_M;
    const u32 rank = CLUSTER_M > 1 ? cluster_rank() : 0;
    const int wg = threadIdx.x / 128, lane = threadIdx.x % 32;
    // the expert of row tile tm: every role asks, and all skip a padding tile (-1) alike
#if GROUPED
    auto expert_of = [&](int tm) { return __ldg(m_indices + tm * BM); };
#else
    auto expert_of = [](int) { return 0; };
#endif

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(&full[s], 1 + 32);  // the TMA thread's and a scale loader's 32 lanes' arrivals
            mbar_init(&empty[s], CONSUMERS * 4 * CLUSTER_M);  // every consumer warp of the cluster
        }
        fence_barrier_init();
    }
    if (CLUSTER_M > 1) cluster_sync();  // no CTA may signal a peer's barriers before they exist
    else __syncthreads();

    if (wg == 0) {  // producer
        setmaxnreg_dec<56>();
        if (threadIdx.x == 0) {
            int it = 0;  // K blocks loaded so far, across tiles: the ring position
            for (int job = first_job; job < jobs; job += job_stride) {
                int cm, tn;
                tile_coords(job, cluster_rows, tiles_n, GROUP_M, cm, tn);
                const int tm = cm * CLUSTER_M + rank, expert = expert_of(tm);
                if (expert < 0) continue;
                for (int kb = 0; kb < k_blocks; ++kb, ++it) {
                    const int s = it % STAGES;
                    mbar_wait(&empty[s], ((it / STAGES) & 1) ^ 1);
                    mbar_arrive_expect_tx(&full[s], STAGE_BYTES);  // all of B arrives, our share and the peers'
                    tma_load_2d(a_tile(s), a_map, &full[s], kb * BK, tm * BM);
                    if (CLUSTER_M == 1) {
                        tma_load_2d(b_tile(s), b_map, &full[s], kb * BK, expert * N + tn * BN);
                    } else {  // this CTA's share of B's rows, written into every CTA of the cluster
                        constexpr int rows = BN / CLUSTER_M;
                        tma_load_2d_multicast(b_tile(s) + rank * rows * BK, b_map, &full[s], kb * BK,
                                              tn * BN + rank * rows, (1u << CLUSTER_M) - 1);
                    }
                }
            }
        } else if (threadIdx.x >= 32 && threadIdx.x < 32 * (1 + SCALE_LOADERS)) {
            // scale loaders: warp 1 + w takes the ring positions w, w + SCALE_LOADERS, ...
            const int loader = threadIdx.x / 32 - 1;
            int it = 0;
            for (int job = first_job; job < jobs; job += job_stride) {
                int cm, tn;
                tile_coords(job, cluster_rows, tiles_n, GROUP_M, cm, tn);
                const int expert = expert_of(cm * CLUSTER_M + rank);
                if (expert < 0) continue;
                // (offsets fit 32 bits: the wrapper checks the scales' largest)
                const int row = (cm * CLUSTER_M + rank) * BM + lane;  // and + 32, + 64, + 96 (past M: clamped)
                int sb_row = min(tn * HALVES + lane, CEIL_DIV(N, 128) - 1) * sb_row_stride;
#if GROUPED
                sb_row += expert * sb_expert_stride;
#endif
                for (int kb = (loader - it % SCALE_LOADERS + SCALE_LOADERS) % SCALE_LOADERS; kb < k_blocks;
                     kb += SCALE_LOADERS) {
                    float a[BM / 32], b = lane < HALVES ? __ldg(b_scale + sb_row + kb * sb_block_stride) : 0.0f;
#pragma unroll
                    for (int j = 0; j < BM / 32; ++j)
                        a[j] = __ldg(a_scale + min(row + 32 * j, M - 1) * sa_row_stride + kb * sa_block_stride);
                    const int s = (it + kb) % STAGES;
                    mbar_wait(&empty[s], (((it + kb) / STAGES) & 1) ^ 1);
#pragma unroll
                    for (int h = 0; h < HALVES; ++h) {
                        const float bh = __shfl_sync(0xffffffffu, b, h);
#pragma unroll
                        for (int j = 0; j < BM / 32; ++j) sts_f32(&scale_ring[(s * HALVES + h) * BM + lane + 32 * j], a[j] * bh);
                    }
                    mbar_arrive(&full[s]);  // (release: the stores above are seen by whoever waits on the phase)
                }
                it += k_blocks;
            }
        }
    } else {  // consumers
        setmaxnreg_inc<224>();
        // warp-uniform by construction (a shuffle from lane 0), so what derives from it (the
        // descriptors) can live in uniform registers
        const int consumer = __shfl_sync(0xffffffffu, wg - 1, 0), thread = threadIdx.x % 128, warp = thread / 32;
        bf16_bits* c_tile = c_tiles + consumer * (C_TILE_BYTES / 2);
        float acc[HALVES][64];
        int it = 0;
        // Stage 0's descriptors at k-slice 0: another stage, k-slice or half only adds a constant to the
        // start-address field (address / 16), so the chain issues no descriptor arithmetic (rung 4's
        // lean k-loop, 04_persistent.cu).
        const u64 a_desc0 = fp8_desc(a_tile(0) + consumer * 64 * BK, 0), b_desc0 = fp8_desc(b_tile(0), 0);
        constexpr u32 STAGE_STEP = STAGE_BYTES / 16, K_STEP = 32 / 16;
        // The same as 32-bit sums: the low word holds the start address (14 bits, < 256 KB / 16, so an
        // offset never carries out of it); the high word (SBO, swizzle) is the same for A and B.
        const u32 a_lo = u32(a_desc0), b_lo = u32(b_desc0), desc_hi = u32(a_desc0 >> 32);
        auto desc_of = [&](u32 lo) { return (u64(desc_hi) << 32) | lo; };
        // this thread's two accumulator rows (16 warp + lane / 4 of its 64, and 8 below): their places in
        // a stage's scale slot
        const int lo_row = consumer * 64 + 16 * warp + lane / 4, hi_row = lo_row + 8;
        auto release = [&](int s) {  // this warp has read stage s: free it in every CTA it was loaded for
            if (lane != 0) return;
            if (CLUSTER_M == 1) mbar_arrive(&empty[s]);
            else
                for (int r = 0; r < CLUSTER_M; ++r) mbar_arrive_cluster(&empty[s], r);
        };
        for (int job = first_job; job < jobs; job += job_stride) {
            int cm, tn;
            tile_coords(job, cluster_rows, tiles_n, GROUP_M, cm, tn);
            const int expert = expert_of(cm * CLUSTER_M + rank);
            if (expert < 0) continue;
            const int row0 = (cm * CLUSTER_M + rank) * BM + consumer * 64;
#pragma unroll
            for (int h = 0; h < HALVES; ++h)
#pragma unroll
                for (int i = 0; i < 64; ++i) acc[h][i] = 0.0f;
            float partial[64];
            for (int kb = 0; kb < k_blocks; ++kb) {
                const int s = (it + kb) % STAGES;
                mbar_wait(&full[s], ((it + kb) / STAGES) & 1);
                const u32 a = a_lo + s * STAGE_STEP, b = b_lo + s * STAGE_STEP;
                // The block's scales, read before its chains are issued: 0.7-1.0% faster at BN 256 than reading
                // them under the first chain (our guess: there they wait behind the chain's shared-memory
                // reads), 1.3% slower at BN 128 (not the default).
                float lo[HALVES], hi[HALVES];
#pragma unroll
                for (int g = 0; g < HALVES; ++g)
                    lo[g] = lds_f32(&scale_ring[(s * HALVES + g) * BM + lo_row]),
                    hi[g] = lds_f32(&scale_ring[(s * HALVES + g) * BM + hi_row]);
#pragma unroll
                for (int h = 0; h < HALVES; ++h) {  // one 128-column half (one block of sb) at a time
                    wgmma_fence();
#pragma unroll
                    for (int ks = 0; ks < BK / 32; ++ks)
                        wgmma_m64n128k32_e4m3(partial, desc_of(a + ks * K_STEP),
                                              desc_of(b + h * (128 * BK / 16) + ks * K_STEP), ks > 0);
                    wgmma_commit();
                    wgmma_wait<0>();
                    if (h == HALVES - 1) release(s);
                    promote(acc[h], partial, lo[h], hi[h]);
                }
            }
            it += k_blocks;

#if GROUPED
            // A slab whose 64 rows are all the expert's (every one but a run's last, where its padding is)
            // takes the TMA epilogue below. Each warp asks of all 64 rows, two a lane, so the answer is the
            // same in all four warps of the consumer and its named barriers see every thread.
            const bool whole = __all_sync(0xffffffffu, row0 + 32 + lane < M && __ldg(m_indices + row0 + lane) == expert
                                                           && __ldg(m_indices + row0 + 32 + lane) == expert);
            if (!whole) {
            // This thread's two rows (lo_row and 8 below), each written only if it is the tile's expert's:
            // bf16 pairs from the registers (register 4i + 2r + e: row + 8r, column 8i + 2 (lane % 4) + e)
            const int r_lo = row0 + 16 * warp + lane / 4, r_hi = r_lo + 8;
            const bool lo_ok = r_lo < M && __ldg(m_indices + r_lo) == expert;
            const bool hi_ok = r_hi < M && __ldg(m_indices + r_hi) == expert;
#pragma unroll
            for (int h = 0; h < HALVES; ++h)
#pragma unroll
                for (int i = 0; i < 16; ++i) {
                    const int col = tn * BN + 128 * h + 8 * i + 2 * (lane % 4);  // even, and N % 8 == 0
                    if (col >= N) continue;
                    if (lo_ok)
                        *reinterpret_cast<u32*>(C + size_t(r_lo) * N + col) = pack_bf16x2(acc[h][4 * i], acc[h][4 * i + 1]);
                    if (hi_ok)
                        *reinterpret_cast<u32*>(C + size_t(r_hi) * N + col) =
                            pack_bf16x2(acc[h][4 * i + 2], acc[h][4 * i + 3]);
                }
            continue;
            }
#endif
            // Epilogue, 64 columns at a time: wait until the buffer's last store has read it, fill it, store it.
#pragma unroll
            for (int h = 0; h < HALVES; ++h)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    if (thread == 0) bulk_wait_read();
                    named_barrier(1 + consumer, 128);
                    store_cols_swizzled<128, 64>(acc[h], c_tile, 64 * c);
                    fence_proxy_async();
                    named_barrier(1 + consumer, 128);
                    if (thread == 0) {
                        tma_store_2d(c_map, c_tile, tn * BN + 128 * h + 64 * c, row0);
                        bulk_commit();
                    }
                }
        }
        if (thread == 0) bulk_wait_read();  // the CTA's shared memory must outlive the last store's reads
    }
    if (CLUSTER_M > 1) cluster_sync();  // peers may still arrive on our barriers until they finish
}

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
// Why one partial and a wait before each promotion: keeping two partials and issuing block
// j+1 before promoting block j made ptxas serialize every wgmma (C7514: accumulator registers
// read while a wgmma group may still write them; it cannot tell that the group read from
// was waited for), a wait after each of the four instructions.
//
// Tile 128 x BN x 128 bytes. BN = 128: a stage is 16 + 16 KB, 6 stages; registers 64 (acc)
// + 64 (partial). BN = 256: the two 128-column halves (one sb block each) take turns in the
// one partial, acc is 2 x 64; a stage is 16 + 32 KB, 4 stages: A is read once per 256
// columns, a quarter less TMA traffic into shared memory per FLOP. The epilogue goes out in
// 64 x 128 halves through one 16 KB buffer a consumer. The scales come through plain loads
// (L2: 2 MB of sa at the shape above), one K block ahead of the promotion that uses them.
//
// Measured on the H100 (2026-11-22, scripts/fp8_block_variants.py, device time at 4096 x 7168
// x 16384): BN 256 with clusters of two, 1185-1209 TFLOP/s (0.85x torch._scaled_mm rowwise,
// which promotes too); BN 256 alone 1149-1199; BN 128 990-1014; the Triton kernel 835-852.
// Loading the scales a K block ahead rather than beside their chain changed nothing
// measurable (kept). Tried and dropped: a third consumer warpgroup (192 x 128 tiles at 160
// registers: 942-1054; a 10-wave grid at this shape). ncu of BN 256 (no cluster): tensor pipe 68% of elapsed cycles,
// SMs active 93% of them (896 tiles are 6.8 waves); cuBLAS's rowwise kernel, 128 x 128 x 128
// with 6 stages: tensor pipe 92%.
// Session 13 (2026-11-26, benchmarks/notes/2026-11-26-session13): the chain's descriptors are now
// stage 0's plus constants (no descriptor arithmetic between QGMMAs): 1227 TFLOP/s against
// _scaled_mm rowwise's 1449 in that run, still 0.85x. Not the bottleneck, measured: the scale
// loads (loading them once a tile instead of every K block: 1164 against 1204, no faster) and
// the order in which the two consumers issue their chains (taking turns through named
// barriers: 1145 against 1181 at BN 256, 1015 against 977 at BN 128).
#include "../gemm_bf16/hopper.cuh"

#ifndef STAGES
#define STAGES 4
#endif
#ifndef GROUP_M
#define GROUP_M 8
#endif
#ifndef CLUSTER_M
#define CLUSTER_M 1  // CTAs per cluster, on consecutive row tiles sharing one column of B (rung 5's multicast)
#endif

#ifndef BN
#define BN 256  // 128 or 256 columns: one or two 128-column blocks of sb (HALVES), promoted one at a time
#endif

#define BK 128  // one scale block; 128 bytes of e4m3, the 128-byte swizzle row
#define HALVES (BN / 128)
#define CONSUMERS 2  // warpgroups of 64 rows
#define BM (64 * CONSUMERS)
#define NUM_THREADS (128 * (CONSUMERS + 1))
#define STAGE_BYTES ((BM + BN) * BK)
#define C_TILE_BYTES (64 * 128 * 2)  // one consumer's epilogue buffer: a 64 x 128 half of its slab
#define SHARED_BYTES (STAGES * STAGE_BYTES + CONSUMERS * C_TILE_BYTES + 1024 + 2 * STAGES * 8)
static_assert(SHARED_BYTES <= 227 * 1024, "fits one block's shared memory");
static_assert(BN == 128 || BN == 256, "one or two 128-column halves");

static_assert(BN % (8 * CLUSTER_M) == 0, "each CTA of a cluster loads an equal share of B's rows");

// A 128-byte-swizzled K-major tile of e4m3 (rows of 128 values); the k-th 32-wide slice starts 32 bytes in.
__device__ __forceinline__ u64 fp8_desc(const unsigned char* tile, int kslice) {
    return smem_desc(tile + 32 * kslice, 16, 1024);
}

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
fp8_block_gemm(const __grid_constant__ TensorMap a_map, const __grid_constant__ TensorMap b_map,
               const __grid_constant__ TensorMap c_map, int M, int N, int K, const float* __restrict__ a_scale,
               int sa_row_stride, int sa_block_stride, const float* __restrict__ b_scale, int sb_row_stride,
               int sb_block_stride) {
    check_launch(NUM_THREADS, SHARED_BYTES);
    extern __shared__ __align__(16) unsigned char smem_raw[];
    unsigned char* tiles =
        reinterpret_cast<unsigned char*>((reinterpret_cast<size_t>(smem_raw) + 1023) & ~size_t(1023));
    bf16_bits* c_tiles = reinterpret_cast<bf16_bits*>(tiles + STAGES * STAGE_BYTES);
    u64* full = reinterpret_cast<u64*>(tiles + STAGES * STAGE_BYTES + CONSUMERS * C_TILE_BYTES);
    u64* empty = full + STAGES;
    auto a_tile = [&](int s) { return tiles + s * STAGE_BYTES; };
    auto b_tile = [&](int s) { return tiles + s * STAGE_BYTES + BM * BK; };

    const int tiles_m = CEIL_DIV(M, BM), tiles_n = CEIL_DIV(N, BN), k_blocks = K / BK;
    // A job is one tile per CTA of a cluster: CLUSTER_M consecutive row tiles, one column.
    const int cluster_rows = CEIL_DIV(tiles_m, CLUSTER_M), jobs = cluster_rows * tiles_n;
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
            int it = 0;  // K blocks loaded so far, across tiles: the ring position
            for (int job = first_job; job < jobs; job += job_stride) {
                int cm, tn;
                tile_coords(job, cluster_rows, tiles_n, GROUP_M, cm, tn);
                const int tm = cm * CLUSTER_M + rank;
                for (int kb = 0; kb < k_blocks; ++kb, ++it) {
                    const int s = it % STAGES;
                    mbar_wait(&empty[s], ((it / STAGES) & 1) ^ 1);
                    mbar_arrive_expect_tx(&full[s], STAGE_BYTES);  // all of B arrives, our share and the peers'
                    tma_load_2d(a_tile(s), a_map, &full[s], kb * BK, tm * BM);
                    if (CLUSTER_M == 1) {
                        tma_load_2d(b_tile(s), b_map, &full[s], kb * BK, tn * BN);
                    } else {  // this CTA's share of B's rows, written into every CTA of the cluster
                        constexpr int rows = BN / CLUSTER_M;
                        tma_load_2d_multicast(b_tile(s) + rank * rows * BK, b_map, &full[s], kb * BK,
                                              tn * BN + rank * rows, (1u << CLUSTER_M) - 1);
                    }
                }
            }
        }
    } else {  // consumers
        setmaxnreg_inc<232>();
        const int consumer = wg - 1, thread = threadIdx.x % 128, warp = thread / 32;
        bf16_bits* c_tile = c_tiles + consumer * (C_TILE_BYTES / 2);
        const int sb_rows = CEIL_DIV(N, 128);
        float acc[HALVES][64], partial[64];
        int it = 0;
        // Stage 0's descriptors at k-slice 0: another stage, k-slice or half only adds a constant to the
        // start-address field (address / 16), so the chain issues no descriptor arithmetic (rung 4's
        // lean k-loop, 04_persistent.cu).
        const u64 a_desc0 = fp8_desc(a_tile(0) + consumer * 64 * BK, 0), b_desc0 = fp8_desc(b_tile(0), 0);
        constexpr u32 STAGE_STEP = STAGE_BYTES / 16, K_STEP = 32 / 16, HALF_STEP = 128 * BK / 16;
        for (int job = first_job; job < jobs; job += job_stride) {
            int cm, tn;
            tile_coords(job, cluster_rows, tiles_n, GROUP_M, cm, tn);
            const int row0 = (cm * CLUSTER_M + rank) * BM + consumer * 64;
            // this thread's two accumulator rows (16 warp + lane / 4, and 8 below), clamped into A for the scales
            const float* sa_lo = a_scale + size_t(min(row0 + 16 * warp + lane / 4, M - 1)) * sa_row_stride;
            const float* sa_hi = a_scale + size_t(min(row0 + 16 * warp + lane / 4 + 8, M - 1)) * sa_row_stride;
#pragma unroll
            for (int h = 0; h < HALVES; ++h)
#pragma unroll
                for (int i = 0; i < 64; ++i) acc[h][i] = 0.0f;
            // The scales of block kb + 1 are loaded during block kb: an L2 hit under this load takes
            // longer than one chain, and loaded just before their promotion they stalled it (ncu:
            // long-scoreboard waits the largest stall reason, the tensor pipe 68% busy).
            float a_lo, a_hi, b[HALVES];
            auto load_scales = [&](int kb) {
                a_lo = __ldg(sa_lo + size_t(kb) * sa_block_stride);
                a_hi = __ldg(sa_hi + size_t(kb) * sa_block_stride);
#pragma unroll
                for (int h = 0; h < HALVES; ++h)
                    b[h] = __ldg(b_scale + size_t(min(tn * HALVES + h, sb_rows - 1)) * sb_row_stride +
                                 size_t(kb) * sb_block_stride);
            };
            load_scales(0);
            for (int kb = 0; kb < k_blocks; ++kb) {
                float lo[HALVES], hi[HALVES];
#pragma unroll
                for (int h = 0; h < HALVES; ++h) lo[h] = a_lo * b[h], hi[h] = a_hi * b[h];
                if (kb + 1 < k_blocks) load_scales(kb + 1);
                const int s = (it + kb) % STAGES;
                mbar_wait(&full[s], ((it + kb) / STAGES) & 1);
#pragma unroll
                for (int h = 0; h < HALVES; ++h) {  // one 128-column half (one block of sb) at a time
                    wgmma_fence();
#pragma unroll
                    for (int ks = 0; ks < BK / 32; ++ks)
                        wgmma_m64n128k32_e4m3(partial, a_desc0 + s * STAGE_STEP + ks * K_STEP,
                                              b_desc0 + s * STAGE_STEP + h * HALF_STEP + ks * K_STEP, ks > 0);
                    wgmma_commit();
                    wgmma_wait<0>();
                    if (h == HALVES - 1 && lane == 0) {  // the stage is read: free it in every CTA it was loaded for
                        if (CLUSTER_M == 1) mbar_arrive(&empty[s]);
                        else
                            for (int r = 0; r < CLUSTER_M; ++r) mbar_arrive_cluster(&empty[s], r);
                    }
#pragma unroll
                    for (int i = 0; i < 16; ++i) {  // the promotion; register 4i + 2r + e: row 16 warp + lane/4 + 8r
                        acc[h][4 * i] = fmaf(partial[4 * i], lo[h], acc[h][4 * i]);
                        acc[h][4 * i + 1] = fmaf(partial[4 * i + 1], lo[h], acc[h][4 * i + 1]);
                        acc[h][4 * i + 2] = fmaf(partial[4 * i + 2], hi[h], acc[h][4 * i + 2]);
                        acc[h][4 * i + 3] = fmaf(partial[4 * i + 3], hi[h], acc[h][4 * i + 3]);
                    }
                }
            }
            it += k_blocks;

            // Epilogue, half by half: wait until the buffer's last store has read it, fill it, store it.
#pragma unroll
            for (int h = 0; h < HALVES; ++h) {
                if (thread == 0) bulk_wait_read();
                named_barrier(1 + consumer, 128);
                store_cols_swizzled<128, 128>(acc[h], c_tile, 0);
                fence_proxy_async();
                named_barrier(1 + consumer, 128);
                if (thread == 0) {
                    for (int c = 0; c < 2; ++c)
                        tma_store_2d(c_map, c_tile + c * 64 * 64, tn * BN + 128 * h + 64 * c, row0);
                    bulk_commit();
                }
            }
        }
        if (thread == 0) bulk_wait_read();  // the CTA's shared memory must outlive the last store's reads
    }
    if (CLUSTER_M > 1) cluster_sync();  // peers may still arrive on our barriers until they finish
}

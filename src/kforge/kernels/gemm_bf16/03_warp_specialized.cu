// Rung 3: producer/consumer warp specialization.
// What changed: the block splits into roles. Warpgroup 0 is the producer: one of its
// threads keeps the STAGES-deep ring of tiles full through TMA, waiting on an "empty"
// barrier per stage; warpgroups 1..CONSUMERS are consumers: they wait on the stage's
// "full" barrier, issue wgmma, and free a stage as soon as the wgmmas that read it are
// done, keeping one k-tile of wgmma in flight (wait<1>) instead of draining (wait<0>).
// setmaxnreg moves registers from the producer (which needs ~40) to the consumers
// (whose 64 x 256 fp32 accumulators alone take 128 per thread).
// Why: in rung 2 the copy engine and the tensor cores took turns, gated by __syncthreads;
// here neither waits for the other except when the ring is truly empty or full.
// Predicted: most of the way to cuBLAS (~90%); what is left is per-tile overhead
// (prologue, epilogue through registers to global, one wave's tail), for rung 4.
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
#ifndef B_KMAJOR
#define B_KMAJOR 0  // 1: B is given as N x K (C = A @ B^T); 0: B is K x N
#endif

#define CONSUMERS (BM / 64)
#define NUM_THREADS (128 * (CONSUMERS + 1))
#define A_TILE (BM * BK)
#define B_TILE (BN * BK)
#define STAGE_BYTES ((A_TILE + B_TILE) * 2)
#define SHARED_BYTES (STAGES * STAGE_BYTES + 1024 + 2 * STAGES * 8)
static_assert(BK == 64, "the swizzle atom is one 64-value row");
static_assert(SHARED_BYTES <= 227 * 1024, "fits one block's shared memory");
static_assert(CONSUMERS == 2, "the register split below is for one producer and two consumers");

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
gemm(const __grid_constant__ TensorMap a_map, const __grid_constant__ TensorMap b_map, bf16_bits* C, int M, int N,
     int K) {
    check_launch(NUM_THREADS, SHARED_BYTES);
    extern __shared__ __align__(16) unsigned char smem_raw[];  // aligned to 1024 by hand below
    bf16_bits* tiles = reinterpret_cast<bf16_bits*>((reinterpret_cast<size_t>(smem_raw) + 1023) & ~size_t(1023));
    u64* full = reinterpret_cast<u64*>(tiles + STAGES * (A_TILE + B_TILE));
    u64* empty = full + STAGES;
    auto a_tile = [&](int s) { return tiles + s * (A_TILE + B_TILE); };
    auto b_tile = [&](int s) { return tiles + s * (A_TILE + B_TILE) + A_TILE; };

    const int row0 = blockIdx.y * BM, col0 = blockIdx.x * BN, k_tiles = CEIL_DIV(K, BK);
    const int wg = threadIdx.x / 128, lane = threadIdx.x % 32;

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(&full[s], 1);                  // the producer's arrive (+ the bytes)
            mbar_init(&empty[s], CONSUMERS * 4);     // one arrive per consumer warp
        }
        fence_barrier_init();
    }
    __syncthreads();

    if (wg == 0) {  // producer
        setmaxnreg_dec<40>();
        if (threadIdx.x == 0) {
            for (int kt = 0; kt < k_tiles; ++kt) {
                const int s = kt % STAGES;
                mbar_wait(&empty[s], ((kt / STAGES) & 1) ^ 1);  // the first pass finds every stage free
                mbar_arrive_expect_tx(&full[s], STAGE_BYTES);
                tma_load_2d(a_tile(s), a_map, &full[s], kt * BK, row0);
                if (B_KMAJOR) {
                    tma_load_2d(b_tile(s), b_map, &full[s], kt * BK, col0);
                } else {
#pragma unroll
                    for (int c = 0; c < BN / 64; ++c)
                        tma_load_2d(b_tile(s) + c * BK * 64, b_map, &full[s], col0 + 64 * c, kt * BK);
                }
            }
        }
    } else {  // consumers
        setmaxnreg_inc<232>();
        const int consumer = wg - 1;
        float acc[BN / 2];
        for (int kt = 0; kt < k_tiles; ++kt) {
            const int s = kt % STAGES;
            mbar_wait(&full[s], (kt / STAGES) & 1);
            wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < BK / 16; ++ks) {
                const u64 a = kmajor_desc(a_tile(s) + consumer * 64 * BK, ks);
                const u64 b = B_KMAJOR ? kmajor_desc(b_tile(s), ks) : nmajor_desc<BK>(b_tile(s), ks);
                wgmma_m64k16<BN, !B_KMAJOR>(acc, a, b, kt > 0 || ks > 0);
            }
            wgmma_commit();
            wgmma_wait<1>();  // the previous k-tile's wgmmas are done: free its stage
            if (kt > 0 && lane == 0) mbar_arrive(&empty[(kt - 1) % STAGES]);
        }
        wgmma_wait<0>();
        store_tile_global<BN>(acc, C, M, N, row0 + consumer * 64, col0);
    }
}

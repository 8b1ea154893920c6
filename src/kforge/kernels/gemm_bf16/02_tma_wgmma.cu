// Rung 2: Hopper's two engines, TMA and wgmma, in the plainest arrangement.
// What changed (from rung 1's mma.sync): tiles come in through the copy engine (one
// thread issues a bulk tensor copy per tile; the bytes land swizzled and signal an
// mbarrier), and the multiply is wgmma: a warpgroup of 128 threads issues a 64 x BN x 16
// product that reads both operands straight from shared memory, asynchronously. No
// ldmatrix, no address arithmetic per thread, no registers spent on staging.
// Every thread computes; thread 0 also refills the stage the block has just finished
// (STAGES-1 tiles stay in flight), and the block waits for its wgmmas before each refill.
// Why: Ampere-style mma.sync tops out near 2/3 of the H100's tensor peak because every
// operand passes through registers; wgmma is the only path to the rest.
// Predicted: ~1.5x rung 1; still well short of cuBLAS because each k-tile's wgmmas are
// waited on before the next are issued, and all threads stall on the same barrier.
#include "hopper.cuh"

#ifndef BM
#define BM 128  // 64 rows per warpgroup
#endif
#ifndef BN
#define BN 256  // the wgmma's N
#endif
#ifndef BK
#define BK 64  // one 128-byte swizzle row of bf16
#endif
#ifndef STAGES
#define STAGES 4
#endif
#ifndef B_KMAJOR
#define B_KMAJOR 0  // 1: B is given as N x K (C = A @ B^T); 0: B is K x N
#endif

#define WARPGROUPS (BM / 64)
#define NUM_THREADS (128 * WARPGROUPS)
#define A_TILE (BM * BK)  // elements
#define B_TILE (BN * BK)
#define STAGE_BYTES ((A_TILE + B_TILE) * 2)
#define SHARED_BYTES (STAGES * STAGE_BYTES + 1024 + STAGES * 8)  // + alignment slack + barriers
static_assert(BK == 64, "the swizzle atom is one 64-value row");
static_assert(SHARED_BYTES <= 227 * 1024, "fits one block's shared memory");

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
gemm(const __grid_constant__ TensorMap a_map, const __grid_constant__ TensorMap b_map, bf16_bits* C, int M, int N,
     int K) {
    check_launch(NUM_THREADS, SHARED_BYTES);
    extern __shared__ __align__(16) unsigned char smem_raw[];  // aligned to 1024 by hand below
    bf16_bits* tiles = reinterpret_cast<bf16_bits*>((reinterpret_cast<size_t>(smem_raw) + 1023) & ~size_t(1023));
    u64* full = reinterpret_cast<u64*>(tiles + STAGES * (A_TILE + B_TILE));
    auto a_tile = [&](int s) { return tiles + s * (A_TILE + B_TILE); };
    auto b_tile = [&](int s) { return tiles + s * (A_TILE + B_TILE) + A_TILE; };

    const int row0 = blockIdx.y * BM, col0 = blockIdx.x * BN, k_tiles = CEIL_DIV(K, BK);
    const int wg = threadIdx.x / 128;

    auto load = [&](int kt) {  // one thread: tile kt of A and B into stage kt % STAGES
        const int s = kt % STAGES;
        mbar_arrive_expect_tx(&full[s], STAGE_BYTES);
        tma_load_2d(a_tile(s), a_map, &full[s], kt * BK, row0);
        if (B_KMAJOR) {
            tma_load_2d(b_tile(s), b_map, &full[s], kt * BK, col0);
        } else {  // N-major: BN / 64 boxes of BK rows x 64 columns
#pragma unroll
            for (int c = 0; c < BN / 64; ++c) tma_load_2d(b_tile(s) + c * BK * 64, b_map, &full[s], col0 + 64 * c, kt * BK);
        }
    };

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) mbar_init(&full[s], 1);
        fence_barrier_init();
    }
    __syncthreads();
    if (threadIdx.x == 0)
        for (int kt = 0; kt < min(STAGES, k_tiles); ++kt) load(kt);

    float acc[BN / 2];
    for (int kt = 0; kt < k_tiles; ++kt) {
        const int s = kt % STAGES;
        mbar_wait(&full[s], (kt / STAGES) & 1);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < BK / 16; ++ks) {
            const u64 a = kmajor_desc(a_tile(s) + wg * 64 * BK, ks);
            const u64 b = B_KMAJOR ? kmajor_desc(b_tile(s), ks) : nmajor_desc<BK>(b_tile(s), ks);
            wgmma_m64k16<BN, !B_KMAJOR>(acc, a, b, kt > 0 || ks > 0);  // the first product overwrites
        }
        wgmma_commit();
        wgmma_wait<0>();
        __syncthreads();  // every warpgroup is done reading stage s
        if (threadIdx.x == 0 && kt + STAGES < k_tiles) load(kt + STAGES);
    }
    store_tile_global<BN>(acc, C, M, N, row0 + wg * 64, col0);
}

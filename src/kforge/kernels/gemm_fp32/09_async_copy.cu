// Rung 9: asynchronous copies. Rung 8's warptiled inner loop, fed by cp.async (Ampere's
// global -> shared copies that bypass the registers) through a STAGES-deep ring of tiles.
// What changed: rung 8 staged each next tile in registers (12 per thread at its best
// shape) and could only prefetch one tile ahead. Here each thread issues its share of a
// tile as cp.async and moves on; the copies land while the math runs, STAGES - 1 tiles
// ahead, and a wait on the oldest group plus one barrier per tile publishes them. A is
// still stored transposed, so its copies are 4 bytes each (a copy can land anywhere,
// which is what makes the transposition free); B's are 16 bytes. Tiles wholly inside the
// matrices take a fast path: fixed per-thread pointers advanced by one tile, no checks.
// Only edge tiles check each element (out-of-bounds ones are copied with a source size
// of 0, which zero-fills them).
// Why: it frees the staging registers (the 512-thread shape spilled 12 bytes at its
// 128-register cap) and deepens the prefetch. The fast path came from a profile (ncu,
// H100, 4096^3): rung 8 issues 2.53 G warp instructions where cuBLAS issues 2.43 G for
// the same 2.15 G FFMAs; its checked loads cost ~120 instructions per warp per tile and
// 14 branches, and a first version of this rung, checking every copy, issued 2.66 G and
// ran 7% slower than rung 8.
// Predicted: a few % over rung 8 at its best shape, from fewer instructions.
#include "common.cuh"

#ifndef BM
#define BM 128
#endif
#ifndef BN
#define BN 256
#endif
#ifndef BK
#define BK 16
#endif
#ifndef WM
#define WM 64
#endif
#ifndef WN
#define WN 32
#endif
#ifndef WNITER
#define WNITER 2
#endif
#ifndef TM
#define TM 4
#endif
#ifndef TN
#define TN 4
#endif
#ifndef NUM_THREADS
#define NUM_THREADS 512
#endif
#ifndef STAGES
#define STAGES 3
#endif
#ifndef APAD
#define APAD 4
#endif
#ifndef BPAD
#define BPAD 0
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 1
#endif
#ifndef GROUP_M
#define GROUP_M 1
#endif

#define WARPS (NUM_THREADS / 32)
#define WMITER ((WM * WN) / (32 * TM * TN * WNITER))
#define WSUBM (WM / WMITER)
#define WSUBN (WN / WNITER)
#define A_STRIDE (BM + APAD)
#define B_STRIDE (BN + BPAD)
#define STAGE_FLOATS (BK * (A_STRIDE + B_STRIDE))
#define SHARED_BYTES (STAGES * STAGE_FLOATS * 4)  // kforge.kernels.gemm_fp32 computes the same
#define A_COPIES (BM * BK / NUM_THREADS)      // 4-byte copies per thread per tile
#define B_COPIES (BK * BN / 4 / NUM_THREADS)  // 16-byte copies per thread per tile
static_assert(SHARED_BYTES <= 227 * 1024, "the ring fits one block's shared memory on Hopper");
static_assert(STAGES >= 2, "one tile in use and at least one in flight");
static_assert((BM / WM) * (BN / WN) == WARPS, "the warps tile the block exactly");
static_assert(WMITER >= 1 && WMITER * WSUBM == WM && WNITER * WSUBN == WN, "warp tile splits evenly");
static_assert((WSUBM / TM) * (WSUBN / TN) == 32, "a warp's 32 lanes tile one sub-tile");
static_assert(TM % 4 == 0 && TN % 4 == 0 && A_STRIDE % 4 == 0 && B_STRIDE % 4 == 0, "fragments load as float4s");
static_assert(A_COPIES * NUM_THREADS == BM * BK && B_COPIES * NUM_THREADS * 4 == BK * BN,
              "tiles copy in whole rounds");
static_assert(NUM_THREADS % BK == 0 && NUM_THREADS % (BN / 4) == 0,
              "each thread copies the same column of every round: its pointers advance by fixed steps");

// cp.async: copy `bytes` from global to shared, of which the first `valid` come from
// `src` and the rest are zeros (valid = 0 reads nothing). .ca for 4 bytes (the only size
// .cg lacks), .cg (L2 only: each element is read once per block) for 16.
__device__ __forceinline__ void copy4(float* dst, const float* src) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(src));
}
__device__ __forceinline__ void copy4_or_zero(float* dst, const float* src, bool valid) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(src), "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void copy16(float* dst, const float* src) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(src));
}
__device__ __forceinline__ void commit_copies() { asm volatile("cp.async.commit_group;\n" ::); }
template <int PENDING>
__device__ __forceinline__ void wait_copies() { asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING)); }

extern "C" __global__ void __launch_bounds__(NUM_THREADS, MIN_BLOCKS)
sgemm(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C, int M, int N, int K) {
    extern __shared__ __align__(16) float smem[];  // STAGES x [A^T tile (BK x A_STRIDE), B tile (BK x B_STRIDE)]

    int bm = blockIdx.y, bn = blockIdx.x;
    if (GROUP_M > 1) {  // as rung 8: GROUP_M row-blocks of C run together
        const int grid_m = gridDim.y, grid_n = gridDim.x, pid = blockIdx.y * grid_n + blockIdx.x;
        const int group = pid / (GROUP_M * grid_n), first_m = group * GROUP_M;
        const int rows = min(grid_m - first_m, GROUP_M), in_group = pid % (GROUP_M * grid_n);
        bm = first_m + in_group % rows;
        bn = in_group / rows;
    }
    const int row0 = bm * BM, col0 = bn * BN;

    const int t = threadIdx.x, warp = t / 32, lane = t % 32;
    const int wrow = (warp / (BN / WN)) * WM, wcol = (warp % (BN / WN)) * WN;
    const int lrow = (lane / (WSUBN / TN)) * TM, lcol = (lane % (WSUBN / TN)) * TN;
    const bool b_aligned = N % 4 == 0 && reinterpret_cast<size_t>(B) % 16 == 0;
    const bool c_aligned = N % 4 == 0 && reinterpret_cast<size_t>(C) % 16 == 0;

    auto a_tile = [&](int stage) { return smem + stage * STAGE_FLOATS; };              // [k][m]
    auto b_tile = [&](int stage) { return smem + stage * STAGE_FLOATS + BK * A_STRIDE; };  // [k][n]

    // Issue the copies of tile kt into its stage, as one commit group. An empty group past
    // the last tile keeps the count of groups in flight uniform. Tiles are issued in order,
    // so the fast path's pointers simply advance one tile per call.
    const int tiles = CEIL_DIV(K, BK);
    const bool interior = row0 + BM <= M && col0 + BN <= N && b_aligned;  // every k-tile but a K tail
    constexpr int A_ROWS_PER_ROUND = NUM_THREADS / BK, B_ROWS_PER_ROUND = NUM_THREADS / (BN / 4);
    const int a_r = t / BK, a_c = t % BK;                  // this thread's first A element of a tile
    const int b_r = t / (BN / 4), b_c = (t % (BN / 4)) * 4;  // and first B float4
    const float* a_next = A + (size_t)(row0 + a_r) * K + a_c;
    const float* b_next = B + (size_t)b_r * N + col0 + b_c;
    const size_t a_round = (size_t)A_ROWS_PER_ROUND * K, b_round = (size_t)B_ROWS_PER_ROUND * N;
    auto copy_tile = [&](int kt) {
        if (kt < tiles) {
            const int k0 = kt * BK;
            float* as = a_tile(kt % STAGES);
            float* bs = b_tile(kt % STAGES);
            if (interior && k0 + BK <= K) {
#pragma unroll
                for (int i = 0; i < A_COPIES; ++i)
                    copy4(&as[a_c * A_STRIDE + a_r + i * A_ROWS_PER_ROUND], a_next + i * a_round);
#pragma unroll
                for (int i = 0; i < B_COPIES; ++i)
                    copy16(&bs[(b_r + i * B_ROWS_PER_ROUND) * B_STRIDE + b_c], b_next + i * b_round);
            } else {
#pragma unroll
                for (int i = 0; i < A_COPIES; ++i) {
                    const int r = a_r + i * A_ROWS_PER_ROUND;
                    const bool inside = row0 + r < M && k0 + a_c < K;
                    copy4_or_zero(&as[a_c * A_STRIDE + r], inside ? A + (size_t)(row0 + r) * K + k0 + a_c : A, inside);
                }
#pragma unroll
                for (int i = 0; i < B_COPIES; ++i) {
                    const int r = b_r + i * B_ROWS_PER_ROUND, gr = k0 + r, gc = col0 + b_c;
                    float* dst = &bs[r * B_STRIDE + b_c];
                    if (b_aligned && gr < K && gc + 3 < N) {
                        copy16(dst, B + (size_t)gr * N + gc);
                    } else {  // a tail or a misaligned B: element by element
#pragma unroll
                        for (int j = 0; j < 4; ++j) {
                            const bool inside = gr < K && gc + j < N;
                            copy4_or_zero(dst + j, inside ? B + (size_t)gr * N + gc + j : B, inside);
                        }
                    }
                }
            }
            a_next += BK;
            b_next += (size_t)BK * N;
        }
        commit_copies();
    };

    float acc[WMITER * TM][WNITER * TN] = {{0.f}};
    float a[2][WMITER * TM], b[2][WNITER * TN];
    auto load_fragments = [&](int stage, int k, int slot) {
        const float* as = a_tile(stage) + k * A_STRIDE;
        const float* bs = b_tile(stage) + k * B_STRIDE;
#pragma unroll
        for (int wm = 0; wm < WMITER; ++wm)
#pragma unroll
            for (int i = 0; i < TM; i += 4) {
                const float4 v = lds4(&as[wrow + wm * WSUBM + lrow + i]);
                float* dst = &a[slot][wm * TM + i];
                dst[0] = v.x; dst[1] = v.y; dst[2] = v.z; dst[3] = v.w;
            }
#pragma unroll
        for (int wn = 0; wn < WNITER; ++wn)
#pragma unroll
            for (int j = 0; j < TN; j += 4) {
                const float4 v = lds4(&bs[wcol + wn * WSUBN + lcol + j]);
                float* dst = &b[slot][wn * TN + j];
                dst[0] = v.x; dst[1] = v.y; dst[2] = v.z; dst[3] = v.w;
            }
    };

    // Prologue: STAGES - 1 tiles in flight, wait for the first.
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) copy_tile(s);
    wait_copies<STAGES - 2>();
    __syncthreads();
    load_fragments(0, 0, 0);
    for (int kt = 0; kt < tiles; ++kt) {
        const int stage = kt % STAGES;
        // The slot this refills held tile kt - 1, whose last shared reads were before the
        // previous tile's barrier (its last k-step runs from registers).
        copy_tile(kt + STAGES - 1);
#pragma unroll
        for (int k = 0; k < BK; ++k) {
            if (k < BK - 1) {
                load_fragments(stage, k + 1, (k + 1) & 1);
            } else {
                // As rung 8, the barrier sits before the tile's last k-step: tile kt + 1
                // must have landed (all but the newest STAGES - 2 groups done) and be
                // visible to every thread; its first fragments load beneath the math.
                wait_copies<STAGES - 2>();
                __syncthreads();
                if (kt + 1 < tiles) load_fragments((kt + 1) % STAGES, 0, (k + 1) & 1);
            }
#pragma unroll
            for (int i = 0; i < WMITER * TM; ++i)
#pragma unroll
                for (int j = 0; j < WNITER * TN; ++j) acc[i][j] += a[k & 1][i] * b[k & 1][j];
        }
    }
    wait_copies<0>();  // nothing real is left in flight, but leave no copy behind
#pragma unroll
    for (int wm = 0; wm < WMITER; ++wm)
#pragma unroll
        for (int i = 0; i < TM; ++i) {
            const int r = row0 + wrow + wm * WSUBM + lrow + i;
#pragma unroll
            for (int wn = 0; wn < WNITER; ++wn)
#pragma unroll
                for (int j = 0; j < TN; j += 4) {
                    const float* v = &acc[wm * TM + i][wn * TN + j];
                    store4(C, make_float4(v[0], v[1], v[2], v[3]), r, col0 + wcol + wn * WSUBN + lcol + j, M, N, N,
                           c_aligned);
                }
        }
}

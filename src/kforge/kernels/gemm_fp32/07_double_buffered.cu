// Rung 7: bank-conflict-free and double-buffered shared memory.
// What changed, three things:
//  1. A thread's 8 x 8 patch of C is now four 4 x 4 pieces, half a tile apart (rows r and
//     r + BM/2, columns c and c + BN/2), so the 16 threads of a row read 16 consecutive
//     float4s of B: no bank conflicts. In rung 6 they read float4s 32 bytes apart, and
//     threads 0 and 4 of every quarter-warp hit the same bank.
//  2. The transposed A tile's rows are padded by 4 floats, so the 4 scalar stores of the
//     transpose land in distinct banks.
//  3. Two buffers of each tile: while the block computes on one, the next tile's global
//     loads are in flight (held in registers) and then stored into the other, so global
//     latency hides behind math and a tile costs one __syncthreads, not two.
// Predicted: 1.2-1.5x over rung 6; about 70% of cuBLAS.
#include "common.cuh"

#ifndef BM
#define BM 128
#endif
#ifndef BN
#define BN 128
#endif
#ifndef BK
#define BK 8
#endif
#ifndef APAD
#define APAD 4
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 2  // blocks per SM the register budget must allow (2 x 256 threads: <= 128 registers)
#endif
#define TM 8
#define TN 8
#define NUM_THREADS (BM * BN / (TM * TN))
#define A_ROUNDS (BM * BK / 4 / NUM_THREADS)
#define B_ROUNDS (BK * BN / 4 / NUM_THREADS)
static_assert(A_ROUNDS * NUM_THREADS * 4 == BM * BK && B_ROUNDS * NUM_THREADS * 4 == BK * BN,
              "tiles load in whole rounds of float4s");

extern "C" __global__ void __launch_bounds__(NUM_THREADS, MIN_BLOCKS)
sgemm(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C, int M, int N, int K) {
    __shared__ __align__(16) float As[2][BK][BM + APAD];  // transposed, padded
    __shared__ __align__(16) float Bs[2][BK][BN];
    const int t = threadIdx.x;
    const int row0 = blockIdx.y * BM, col0 = blockIdx.x * BN;
    // This thread's pieces: rows trow + {0, BM/2} (+0..3), columns tcol + {0, BN/2} (+0..3).
    const int trow = (t / (BN / TN)) * 4, tcol = (t % (BN / TN)) * 4;
    const bool a_aligned = K % 4 == 0 && reinterpret_cast<size_t>(A) % 16 == 0;
    const bool b_aligned = N % 4 == 0 && reinterpret_cast<size_t>(B) % 16 == 0;
    const bool c_aligned = N % 4 == 0 && reinterpret_cast<size_t>(C) % 16 == 0;

    float4 a_stage[A_ROUNDS], b_stage[B_ROUNDS];
    auto load_tiles = [&](int k0) {  // global -> registers
#pragma unroll
        for (int i = 0; i < A_ROUNDS; ++i) {
            const int e = t + i * NUM_THREADS, r = e / (BK / 4), c = (e % (BK / 4)) * 4;
            a_stage[i] = load4(A, row0 + r, k0 + c, M, K, K, a_aligned);
        }
#pragma unroll
        for (int i = 0; i < B_ROUNDS; ++i) {
            const int e = t + i * NUM_THREADS, r = e / (BN / 4), c = (e % (BN / 4)) * 4;
            b_stage[i] = load4(B, k0 + r, col0 + c, K, N, N, b_aligned);
        }
    };
    auto store_tiles = [&](int buf) {  // registers -> shared, A transposed
#pragma unroll
        for (int i = 0; i < A_ROUNDS; ++i) {
            const int e = t + i * NUM_THREADS, r = e / (BK / 4), c = (e % (BK / 4)) * 4;
            As[buf][c + 0][r] = a_stage[i].x; As[buf][c + 1][r] = a_stage[i].y;
            As[buf][c + 2][r] = a_stage[i].z; As[buf][c + 3][r] = a_stage[i].w;
        }
#pragma unroll
        for (int i = 0; i < B_ROUNDS; ++i) {
            const int e = t + i * NUM_THREADS, r = e / (BN / 4), c = (e % (BN / 4)) * 4;
            *reinterpret_cast<float4*>(&Bs[buf][r][c]) = b_stage[i];
        }
    };

    float acc[TM][TN] = {{0.f}};
    const int tiles = CEIL_DIV(K, BK);
    load_tiles(0);
    store_tiles(0);
    __syncthreads();
    for (int kt = 0; kt < tiles; ++kt) {
        const int buf = kt & 1;
        if (kt + 1 < tiles) load_tiles((kt + 1) * BK);  // in flight during the math below
#pragma unroll
        for (int k = 0; k < BK; ++k) {
            const float4 a0 = lds4(&As[buf][k][trow]), a1 = lds4(&As[buf][k][trow + BM / 2]);
            const float4 b0 = lds4(&Bs[buf][k][tcol]), b1 = lds4(&Bs[buf][k][tcol + BN / 2]);
            const float a[TM] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
            const float b[TN] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
            for (int i = 0; i < TM; ++i)
#pragma unroll
                for (int j = 0; j < TN; ++j) acc[i][j] += a[i] * b[j];
        }
        // The other buffer was last read before the previous barrier: safe to overwrite.
        if (kt + 1 < tiles) store_tiles(buf ^ 1);
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < TM; ++i) {
        const int r = row0 + trow + (i % 4) + (i / 4) * (BM / 2);
#pragma unroll
        for (int j = 0; j < TN; j += 4) {
            const int c = col0 + tcol + (j / 4) * (BN / 2);
            store4(C, make_float4(acc[i][j], acc[i][j + 1], acc[i][j + 2], acc[i][j + 3]), r, c, M, N, N, c_aligned);
        }
    }
}

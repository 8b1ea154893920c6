// Rung 5: 2D blocktiling. Each thread computes a TM x TN patch of C.
// What changed: per k, a thread loads TM values of A and TN of B into registers and does
// TM * TN FMAs with them (an outer product), so 16 shared loads feed 64 FMAs at 8 x 8.
// Why: rung 4 still spent ~1 shared load per FMA; the outer product cuts it to 1/4, and
// a 128 x 128 block tile halves global traffic per FMA again.
// Predicted: about 2x over rung 4; the limit moves to global-load latency and issue slots.
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
#ifndef TM
#define TM 8
#endif
#ifndef TN
#define TN 8
#endif
#define NUM_THREADS (BM * BN / (TM * TN))
static_assert((BM * BK) % NUM_THREADS == 0 && (BN * BK) % NUM_THREADS == 0, "tiles load in whole rounds");

extern "C" __global__ void __launch_bounds__(NUM_THREADS)
sgemm(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C, int M, int N, int K) {
    __shared__ float As[BM][BK];
    __shared__ float Bs[BK][BN];
    const int t = threadIdx.x;
    const int row0 = blockIdx.y * BM, col0 = blockIdx.x * BN;
    const int trow = (t / (BN / TN)) * TM, tcol = (t % (BN / TN)) * TN;

    float acc[TM][TN] = {{0.f}};
    float a[TM], b[TN];
    for (int k0 = 0; k0 < K; k0 += BK) {
        // NUM_THREADS threads load the BM x BK and BK x BN tiles in several strided rounds.
        for (int i = t; i < BM * BK; i += NUM_THREADS) {
            const int r = i / BK, c = i % BK;
            As[r][c] = (row0 + r < M && k0 + c < K) ? A[(size_t)(row0 + r) * K + k0 + c] : 0.f;
        }
        for (int i = t; i < BK * BN; i += NUM_THREADS) {
            const int r = i / BN, c = i % BN;
            Bs[r][c] = (k0 + r < K && col0 + c < N) ? B[(size_t)(k0 + r) * N + col0 + c] : 0.f;
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < BK; ++k) {
#pragma unroll
            for (int i = 0; i < TM; ++i) a[i] = As[trow + i][k];
#pragma unroll
            for (int j = 0; j < TN; ++j) b[j] = Bs[k][tcol + j];
#pragma unroll
            for (int i = 0; i < TM; ++i)
#pragma unroll
                for (int j = 0; j < TN; ++j) acc[i][j] += a[i] * b[j];
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) {
            const int r = row0 + trow + i, c = col0 + tcol + j;
            if (r < M && c < N) C[(size_t)r * N + c] = acc[i][j];
        }
}

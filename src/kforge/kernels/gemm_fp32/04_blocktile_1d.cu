// Rung 4: 1D blocktiling. Each thread computes TM results in a column of C, not one.
// What changed: the block tile is BM x BN with a thin BK slab of K; a thread keeps TM
// accumulators in registers and, per k, loads one B value and reuses it TM times.
// Why: rung 3 needed 2 shared loads per FMA; here it is TM + 1 loads per TM FMAs (1.125
// per FMA at TM = 8), and every thread of a warp reads the same A address (a broadcast).
// Predicted: roughly 2-3x over rung 3, as FMAs start to outnumber shared-memory loads.
#include "common.cuh"

#ifndef BM
#define BM 64
#endif
#ifndef BN
#define BN 64
#endif
#ifndef BK
#define BK 8
#endif
#ifndef TM
#define TM 8
#endif
#define NUM_THREADS (BM * BN / TM)
static_assert(NUM_THREADS == BM * BK && NUM_THREADS == BN * BK,
              "one thread loads one element of each tile (BM == BN, BK == BM / TM)");

extern "C" __global__ void __launch_bounds__(NUM_THREADS)
sgemm(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C, int M, int N, int K) {
    __shared__ float As[BM][BK];
    __shared__ float Bs[BK][BN];
    const int t = threadIdx.x;
    const int row0 = blockIdx.y * BM, col0 = blockIdx.x * BN;
    const int tcol = t % BN, trow = (t / BN) * TM;  // this thread's TM x 1 sliver of the tile
    const int a_r = t / BK, a_c = t % BK;           // the element of A this thread loads
    const int b_r = t / BN, b_c = t % BN;           // and of B: consecutive threads, consecutive columns

    float acc[TM] = {0.f};
    for (int k0 = 0; k0 < K; k0 += BK) {
        As[a_r][a_c] = (row0 + a_r < M && k0 + a_c < K) ? A[(size_t)(row0 + a_r) * K + k0 + a_c] : 0.f;
        Bs[b_r][b_c] = (k0 + b_r < K && col0 + b_c < N) ? B[(size_t)(k0 + b_r) * N + col0 + b_c] : 0.f;
        __syncthreads();
#pragma unroll
        for (int k = 0; k < BK; ++k) {
            const float b = Bs[k][tcol];  // loaded once, used TM times
#pragma unroll
            for (int i = 0; i < TM; ++i) acc[i] += As[trow + i][k] * b;
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < TM; ++i) {
        const int r = row0 + trow + i, c = col0 + tcol;
        if (r < M && c < N) C[(size_t)r * N + c] = acc[i];
    }
}

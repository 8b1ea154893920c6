// Rung 1: naive. One thread per element of C, each walking a row of A and a column of B.
// What changed: nothing yet; this is the baseline every later rung is measured against.
// Why it is slow: threadIdx.x picks the ROW, so the 32 threads of a warp read 32 different
// rows of A (32 separate memory transactions per load) and write C with a stride of N.
// Every operand comes from global memory: 2 loads per multiply-add, no reuse on chip.
// Predicted: a few hundred GFLOP/s, about 1% of cuBLAS.
#include "common.cuh"

#ifndef TILE
#define TILE 32
#endif

extern "C" __global__ void __launch_bounds__(TILE * TILE)
sgemm(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C, int M, int N, int K) {
    const int row = blockIdx.x * TILE + threadIdx.x;  // consecutive threads: consecutive rows (the flaw)
    const int col = blockIdx.y * TILE + threadIdx.y;
    if (row >= M || col >= N) return;
    float acc = 0.f;
    for (int k = 0; k < K; ++k) acc += A[(size_t)row * K + k] * B[(size_t)k * N + col];
    C[(size_t)row * N + col] = acc;
}

// Rung 3: shared-memory tiling.
// What changed: a block stages a TILE x TILE tile of A and of B in shared memory, then
// every thread runs TILE multiply-adds out of it before the next tile is loaded.
// Why: each element loaded from global memory is now used TILE times (32x less global
// traffic than rung 2); shared memory answers in ~30 cycles instead of hundreds.
// Predicted: faster again, but now each FMA needs two shared-memory loads, and the
// shared-memory pipe, not the FMA units, becomes the limit (about 1/4 of the FMA rate).
#include "common.cuh"

#ifndef TILE
#define TILE 32
#endif

extern "C" __global__ void __launch_bounds__(TILE * TILE)
sgemm(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C, int M, int N, int K) {
    __shared__ float As[TILE][TILE];
    __shared__ float Bs[TILE][TILE];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int col = blockIdx.x * TILE + tx;
    const int row = blockIdx.y * TILE + ty;
    float acc = 0.f;
    for (int k0 = 0; k0 < K; k0 += TILE) {
        // Zeros outside the matrices: a tail tile then adds nothing.
        As[ty][tx] = (row < M && k0 + tx < K) ? A[(size_t)row * K + k0 + tx] : 0.f;
        Bs[ty][tx] = (k0 + ty < K && col < N) ? B[(size_t)(k0 + ty) * N + col] : 0.f;
        __syncthreads();
#pragma unroll
        for (int k = 0; k < TILE; ++k) acc += As[ty][k] * Bs[k][tx];  // As: broadcast; Bs: one row, no conflicts
        __syncthreads();  // nobody overwrites the tiles while another thread still reads them
    }
    if (row < M && col < N) C[(size_t)row * N + col] = acc;
}

// Rung 2: coalesced global access.
// What changed: threadIdx.x now picks the COLUMN. A warp's 32 threads read 32 consecutive
// floats of a row of B (one 128-byte transaction) and all read the same element of A
// (a broadcast), and they write 128 contiguous bytes of C.
// Why: DRAM and L2 move whole 32-byte sectors; rung 1 used 4 bytes of each one it fetched.
// Predicted: several times faster; still one global load per multiply-add, now mostly L1 hits.
#include "common.cuh"

#ifndef TILE
#define TILE 32
#endif

extern "C" __global__ void __launch_bounds__(TILE * TILE)
sgemm(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C, int M, int N, int K) {
    const int col = blockIdx.x * TILE + threadIdx.x;  // consecutive threads: consecutive columns
    const int row = blockIdx.y * TILE + threadIdx.y;
    if (row >= M || col >= N) return;
    float acc = 0.f;
    for (int k = 0; k < K; ++k) acc += A[(size_t)row * K + k] * B[(size_t)k * N + col];
    C[(size_t)row * N + col] = acc;
}

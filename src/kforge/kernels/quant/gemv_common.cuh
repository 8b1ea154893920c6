// What the 4-bit GEMV kernels (nvfp4_gemv.cu, w4a16_gemv.cu) share: the streaming loads and the
// end of a warp's row sums.

#pragma once

typedef unsigned int u32;
typedef unsigned short u16;

// Bytes read once: no L1 allocation (x and b, read by every warp, go through __ldg and stay in L1).
__device__ __forceinline__ uint4 load_once(const uint4* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

__device__ __forceinline__ u16 load_once(const u16* p) {
    u16 v;
    asm("ld.global.nc.L1::no_allocate.u16 %0, [%1];" : "=h"(v) : "l"(p));
    return v;
}

// A warp's sums of its ROWS rows, each completed across the lanes in a butterfly of shuffles.
// True on lane r < ROWS, with row r's sum in *sum.
template <int ROWS_>
__device__ __forceinline__ bool warp_row_sums(float (&acc)[ROWS_], float* sum) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int r = 0; r < ROWS_; ++r) {
#pragma unroll
        for (int offset = 16; offset > 0; offset /= 2) acc[r] += __shfl_xor_sync(0xFFFFFFFFu, acc[r], offset);
    }
    float mine = acc[0];
#pragma unroll
    for (int r = 1; r < ROWS_; ++r) mine = lane == r ? acc[r] : mine;
    *sum = mine;
    return lane < ROWS_;
}

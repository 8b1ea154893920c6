// What the weight-only GEMV kernels (nvfp4_gemv.cu, w4a16_gemv.cu, w4a16_mma.cu, fp8_gemv.cu) share: the
// streaming loads, the bf16 store (with the residual add), the end of a warp's row sums.

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

// `sum` rounded to bf16 (its bits), and with RESIDUAL the residual's bf16 `r` added as the unfused pair
// adds it: the rounded product and r summed in fp32 (torch's bf16 add), rounded once more.
__device__ __forceinline__ u16 round_bf16(float sum) {
    u16 rounded;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(rounded) : "f"(sum));
    return rounded;
}

__device__ __forceinline__ u16 add_residual_bf16(u16 r, u16 rounded) {
    return round_bf16(__fadd_rn(__uint_as_float(static_cast<u32>(r) << 16),
                                __uint_as_float(static_cast<u32>(rounded) << 16)));
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

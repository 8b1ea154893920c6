// Shared by the fp32 GEMM rungs: C = A @ B, all row-major, A is M x K, B is K x N.
// Only the tail handling lives here; each rung's idea stays in its own file.
#pragma once

#define CEIL_DIV(a, b) (((a) + (b) - 1) / (b))

// Four consecutive floats of row `row` starting at column `col` of a rows x cols matrix
// (leading dimension ld), zeros outside it. One 16-byte load when all four are inside
// and 16-byte aligned (`aligned`: the base pointer and ld are multiples of 4 floats),
// else up to four checked scalar loads: the tails of sizes that are not multiples of 4.
__device__ __forceinline__ float4 load4(const float* __restrict__ p, int row, int col,
                                        int rows, int cols, int ld, bool aligned) {
    if (row >= rows) return make_float4(0.f, 0.f, 0.f, 0.f);
    const float* q = p + (size_t)row * ld + col;
    if (aligned && col + 3 < cols) return *reinterpret_cast<const float4*>(q);
    float4 v;
    v.x = col + 0 < cols ? q[0] : 0.f;
    v.y = col + 1 < cols ? q[1] : 0.f;
    v.z = col + 2 < cols ? q[2] : 0.f;
    v.w = col + 3 < cols ? q[3] : 0.f;
    return v;
}

// The store twin of load4: writes only the elements inside the matrix.
__device__ __forceinline__ void store4(float* __restrict__ p, float4 v, int row, int col,
                                       int rows, int cols, int ld, bool aligned) {
    if (row >= rows) return;
    float* q = p + (size_t)row * ld + col;
    if (aligned && col + 3 < cols) { *reinterpret_cast<float4*>(q) = v; return; }
    if (col + 0 < cols) q[0] = v.x;
    if (col + 1 < cols) q[1] = v.y;
    if (col + 2 < cols) q[2] = v.z;
    if (col + 3 < cols) q[3] = v.w;
}

// A float4 from shared memory (16-byte aligned address): one LDS.128.
__device__ __forceinline__ float4 lds4(const float* p) { return *reinterpret_cast<const float4*>(p); }

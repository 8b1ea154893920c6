// Row softmax in CUDA C++, the abstraction ladder's bottom level for the softmax:
// y = exp(x - max x) / sum exp(x - max x) per row, bf16 in and out, fp32 inside.
//
// The same algorithm as the Triton and Gluon levels, every mapping written by hand: one
// block of THREADS a row; a thread loads 16 bytes (8 bf16) at a time, the block a
// contiguous 8 x THREADS-element chunk. Pass 1 keeps a running max m and sum s of
// exp(x - m) per thread, one exp an element (e = exp(-|x - m|): s += e if x <= m, else
// s = s * e + 1, m = x); the threads' (m, s) pairs merge in a butterfly of shuffles inside
// each warp, then across the warps through shared memory. Pass 2 re-reads the row (from
// L2, mostly) and writes exp(x - M) / S, 16 bytes a store. The row crosses HBM twice.
// Columns must be a multiple of 8 and rows 16-byte aligned (the launcher checks).

#include <cuda_bf16.h>
#include <math_constants.h>

#ifndef THREADS
#define THREADS 512
#endif

#define LOG2E 1.4426950408889634f
#define WARPS (THREADS / 32)

struct RunningSum {
    float max;  // in base 2: log2(e) * x
    float sum;  // sum of exp2(x - max) over what this thread has seen
};

__device__ __forceinline__ RunningSum add(RunningSum r, float x) {
    if (x == -CUDART_INF_F) return r;  // contributes exp(-inf) = 0, even while r.max is -inf
    float e = exp2f(-fabsf(x - r.max));
    if (x > r.max) return {x, r.sum * e + 1.0f};
    return {r.max, r.sum + e};
}

__device__ __forceinline__ RunningSum merge(RunningSum a, RunningSum b) {
    float m = fmaxf(a.max, b.max);
    if (m == -CUDART_INF_F) return a;
    return {m, a.sum * exp2f(a.max - m) + b.sum * exp2f(b.max - m)};
}

// 8 bf16 packed in a uint4 as floats in base 2 (a bf16 is the top half of an fp32)
__device__ __forceinline__ void unpack(uint4 v, float out[8]) {
    const unsigned words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        out[2 * i] = __uint_as_float(words[i] << 16) * LOG2E;
        out[2 * i + 1] = __uint_as_float(words[i] & 0xFFFF0000u) * LOG2E;
    }
}

__device__ __forceinline__ unsigned pack_pair(float lo, float hi) {  // round to nearest even
    __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&pair);
}

extern "C" __global__ void __launch_bounds__(THREADS)
softmax_rows(const __nv_bfloat16* __restrict__ x, __nv_bfloat16* __restrict__ y, int n_cols) {
    __shared__ RunningSum per_warp[WARPS];
    const long long row = (long long)blockIdx.x * n_cols;
    const uint4* x_row = reinterpret_cast<const uint4*>(x + row);
    uint4* y_row = reinterpret_cast<uint4*>(y + row);
    const int vectors = n_cols / 8;

    RunningSum mine = {-CUDART_INF_F, 0.0f};
    for (int v = threadIdx.x; v < vectors; v += THREADS) {
        float values[8];
        unpack(x_row[v], values);
#pragma unroll
        for (int i = 0; i < 8; ++i) mine = add(mine, values[i]);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
        RunningSum other = {__shfl_xor_sync(0xffffffffu, mine.max, offset),
                            __shfl_xor_sync(0xffffffffu, mine.sum, offset)};
        mine = merge(mine, other);
    }
    if (threadIdx.x % 32 == 0) per_warp[threadIdx.x / 32] = mine;
    __syncthreads();
    RunningSum total = per_warp[0];
#pragma unroll
    for (int w = 1; w < WARPS; ++w) total = merge(total, per_warp[w]);  // every thread, same order
    const float inverse = 1.0f / total.sum;

    for (int v = threadIdx.x; v < vectors; v += THREADS) {
        float values[8];
        unpack(x_row[v], values);
        uint4 out;
        out.x = pack_pair(exp2f(values[0] - total.max) * inverse, exp2f(values[1] - total.max) * inverse);
        out.y = pack_pair(exp2f(values[2] - total.max) * inverse, exp2f(values[3] - total.max) * inverse);
        out.z = pack_pair(exp2f(values[4] - total.max) * inverse, exp2f(values[5] - total.max) * inverse);
        out.w = pack_pair(exp2f(values[6] - total.max) * inverse, exp2f(values[7] - total.max) * inverse);
        y_row[v] = out;
    }
}

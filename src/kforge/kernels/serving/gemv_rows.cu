// Decode GEMV for one token, bf16: y[n] = sum_k W[n, k] x[k], fp32 sums, one rounding.
//
// One warp per row of W. A lane reads 16 bytes (8 values) at a time, the warp 512
// contiguous bytes, CHUNK reads a step per lane. Every warp of the grid (4096 rows: 512
// blocks of 8 warps, one wave at ~4 blocks an SM) starts streaming at launch, as a copy
// kernel does. W is read once, so its loads skip L1 (no_allocate); x (at most 32 KB) is
// read by every warp of an SM and stays in L1. The partial sums, one per CHUNK slot
// (independent FMA chains), meet in a butterfly of shuffles at the end.
//
// Measured on the H100 (2026-11-22, scripts/gemv_sweep.py): 97-100% of a read-only stream
// of the same bytes (scripts/read_stream.cu) at every Llama-3-8B width. CHUNK = 4 was the
// best or within 1% of it at every width; 8 and 16 lost up to 9% where ptxas interleaved
// each load's FMAs before the next load. Staging W through shared memory with cp.async
// (4-8 stages) lost 5-25%: fewer warps an SM for the same bytes in flight.
// K must be a multiple of 8 and W's rows 16-byte aligned (the wrapper checks).

#ifndef CHUNK
#define CHUNK 4  // 16-byte loads per lane per step
#endif
#ifndef WARPS
#define WARPS 8  // rows per block
#endif

typedef unsigned int u32;

__device__ __forceinline__ uint4 load_once(const uint4* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// acc + the dot product of two bf16 pairs (a bf16 is the top half of an fp32)
__device__ __forceinline__ float fma_pair(u32 w, u32 x, float acc) {
    acc = fmaf(__uint_as_float(w << 16), __uint_as_float(x << 16), acc);
    return fmaf(__uint_as_float(w & 0xFFFF0000u), __uint_as_float(x & 0xFFFF0000u), acc);
}

__device__ __forceinline__ float fma_chunk(uint4 w, uint4 x, float acc) {
    return fma_pair(w.w, x.w, fma_pair(w.z, x.z, fma_pair(w.y, x.y, fma_pair(w.x, x.x, acc))));
}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
gemv_bf16(const uint4* __restrict__ W, const uint4* __restrict__ x, unsigned short* __restrict__ y, int N,
          int K8, int row_stride8) {
    const int lane = threadIdx.x % 32, row = blockIdx.x * WARPS + threadIdx.x / 32;
    if (row >= N) return;  // the whole warp: row is the warp's
    const uint4* w = W + static_cast<size_t>(row) * row_stride8;
    float part[CHUNK];
#pragma unroll
    for (int c = 0; c < CHUNK; ++c) part[c] = 0.0f;
    int base = lane;
    for (; base + 32 * (CHUNK - 1) < K8; base += 32 * CHUNK) {  // whole steps, unpredicated
        uint4 wv[CHUNK], xv[CHUNK];
#pragma unroll
        for (int c = 0; c < CHUNK; ++c) {  // every load first, then the FMAs
            wv[c] = load_once(w + base + 32 * c);
            xv[c] = __ldg(x + base + 32 * c);
        }
#pragma unroll
        for (int c = 0; c < CHUNK; ++c) part[c] = fma_chunk(wv[c], xv[c], part[c]);
    }
    if (base < K8) {  // the tail: fewer than CHUNK loads left per lane, issued together, predicated
        uint4 wv[CHUNK], xv[CHUNK];
#pragma unroll
        for (int c = 0; c < CHUNK; ++c) {
            const bool inside = base + 32 * c < K8;
            wv[c] = inside ? load_once(w + base + 32 * c) : make_uint4(0, 0, 0, 0);
            xv[c] = inside ? __ldg(x + base + 32 * c) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int c = 0; c < CHUNK; ++c) part[c] = fma_chunk(wv[c], xv[c], part[c]);
    }
    float sum = 0.0f;
#pragma unroll
    for (int c = 0; c < CHUNK; ++c) sum += part[c];
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, offset);
    if (lane == 0) {
        unsigned short rounded;
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(rounded) : "f"(sum));
        y[row] = rounded;
    }
}

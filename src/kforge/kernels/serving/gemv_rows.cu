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
//
// EPILOGUE fuses the op that follows the projection in a decode step, so it costs no launch:
// - EPI_RESIDUAL: y[n] = residual[n] + y[n], the MLP's residual add (the down projection).
// - EPI_SWIGLU: W is a fused gate/up weight (2N rows: gate rows first, then up) and
//   y[n] = silu(g) * u of g = W[n] . x and u = W[N + n] . x, one warp computing both.
// Each rounds as the unfused pair does (the product to bf16 first, then the Triton kernel's
// arithmetic: kernels/serving/swiglu.py, the add in fp32), so a fused step gives the same bits.

#ifndef CHUNK
#define CHUNK 4  // 16-byte loads per lane per step
#endif
#ifndef WARPS
#define WARPS 8  // rows per block
#endif
#define EPI_NONE 0
#define EPI_RESIDUAL 1
#define EPI_SWIGLU 2
#ifndef EPILOGUE
#define EPILOGUE EPI_NONE
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

// W[row] . x over K8 16-byte chunks, every lane holding the whole sum at the end
__device__ __forceinline__ float warp_dot(const uint4* __restrict__ w, const uint4* __restrict__ x, int K8,
                                         int lane) {
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
    return sum;
}

__device__ __forceinline__ unsigned short to_bf16(float v) {
    unsigned short rounded;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(rounded) : "f"(v));
    return rounded;
}

__device__ __forceinline__ float from_bf16(unsigned short v) { return __uint_as_float(static_cast<u32>(v) << 16); }

// silu(g) * u as Triton computes `g * tl.sigmoid(g) * u` for sm_90: 1 / (1 + 2^(-g log2 e)) with
// ex2.approx and div.full, then two products (read from swiglu_kernel's PTX), so the bits match
__device__ __forceinline__ float silu_times(float g, float u) {
    float sigmoid;
    asm("{\n\t.reg .f32 t;\n\t"
        "sub.f32 t, 0f00000000, %1;\n\t"
        "mul.f32 t, t, 0f3FB8AA3B;\n\t"
        "ex2.approx.f32 t, t;\n\t"
        "add.f32 t, t, 0f3F800000;\n\t"
        "div.full.f32 %0, 0f3F800000, t;\n\t}"
        : "=f"(sigmoid) : "f"(g));
    return __fmul_rn(__fmul_rn(sigmoid, g), u);
}

// y (N) = epilogue(W x); W's rows are row_stride8 16-byte chunks apart (2N of them with EPI_SWIGLU)
extern "C" __global__ void __launch_bounds__(WARPS * 32)
gemv_bf16(const uint4* __restrict__ W, const uint4* __restrict__ x, unsigned short* __restrict__ y, int N,
          int K8, int row_stride8, const unsigned short* __restrict__ residual) {
    const int lane = threadIdx.x % 32, row = blockIdx.x * WARPS + threadIdx.x / 32;
    if (row >= N) return;  // the whole warp: row is the warp's
    const float sum = warp_dot(W + static_cast<size_t>(row) * row_stride8, x, K8, lane);
#if EPILOGUE == EPI_SWIGLU
    const float up = warp_dot(W + static_cast<size_t>(N + row) * row_stride8, x, K8, lane);
#endif
    if (lane == 0) {
#if EPILOGUE == EPI_NONE
        y[row] = to_bf16(sum);
#elif EPILOGUE == EPI_RESIDUAL
        y[row] = to_bf16(__fadd_rn(from_bf16(residual[row]), from_bf16(to_bf16(sum))));
#elif EPILOGUE == EPI_SWIGLU
        y[row] = to_bf16(silu_times(from_bf16(to_bf16(sum)), from_bf16(to_bf16(up))));
#else
#error "EPILOGUE must be EPI_NONE, EPI_RESIDUAL or EPI_SWIGLU"
#endif
    }
}

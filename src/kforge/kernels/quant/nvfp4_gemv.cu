// Batched NVFP4 GEMV: c[l, m] = gs_a gs_b sum_k a[l, m, k] b[l, k], fp32 sums, c rounded once to fp16.
//
// a [L, M, K/2]: E2M1 codes two a byte (k = 2j the low nibble), one E4M3 scale a 16 k; b the
// same with one row a batch. Hopper has no FP4 arithmetic, so the codes are decoded on the
// CUDA cores, and the kernel must do it in fewer instructions than the bytes allow: at 3 TB/s
// an SM takes in ~23 codes a clock and issues 128 thread-instructions, about 5.5 a code.
//
// Decode, two codes an instruction pair, exact: an E2M1 code s|e1 e0 m with its magnitude
// bits at fp16 bits 9-11 (m the top mantissa bit, e1 e0 the low exponent bits) and s at bit
// 15 reads as its value times 2^-14, subnormals (e = 0) included. A nibble's sign sits 3 bits
// above its magnitude, the fp16 one 6 above, so one select per word first builds
// t = (w & 0x07070707) | ((w << 3) & ~0x07070707): codes 0, 2, 4, 6 with their signs moved.
// Then (t << 9) & 0x8E008E00 is codes (0, 4) as an fp16 pair, (t << 1) & 0x8E008E00 codes
// (2, 6); the same from w >> 4 gives (1, 5) and (3, 7).
//
// Multiply-add in fp16 pairs (HFMA2), exact too: b's values are decoded the same way times
// 2^14 (exact), so each product is a * b * 2^-14, a multiple of 2^-16 below 36 * 2^-14, and
// the 8 products a half of a pair sums over one 16-value scale block stay under 2^11 units
// of 2^-16: no rounding. The block's two halves go to fp32 and meet its scales there:
// acc += (h.lo + h.hi) * sa * sb * 2^14 (sa * sb is exact in fp32). About 3 instructions a
// code in all: the loop is memory-bound.
//
// Layout: a warp owns ROWS rows of one batch and a lane 16 bytes (32 codes, two scale blocks)
// of each at a time, the next step's loads issued before this step's decode (a double buffer
// in registers); b's 16 bytes are decoded once a step for all ROWS rows. a is read once
// (loads that skip L1); b and its scales are read by every warp and stay in L1. The ROWS
// partial sums meet in a butterfly of shuffles at the end. K must be a multiple of 32 and
// rows 16-byte aligned (the wrapper checks).
//
// Measured on the H100 (scripts/quant_gemv_sweep.py, kforge bench quant): 72-83% of the copy bandwidth
// on the problem set's long rows, 62% at K = 2048; 84-88% of a read-only stream of the same
// bytes. ROWS = 2 (K > 4096) or 4, WARPS = 4 were the fastest; splitting K across warps and
// capping registers for more blocks were not faster. ncu: issue slots ~60-70% busy, memory
// stalls first, math-pipe throttle second.
// An L2 prefetch-size hint (L2::128B, L2::256B) on a's loads was 1-3% slower on all three
// shapes (docs/worklogs/quant.md).

#ifndef ROWS
#define ROWS 2  // a's rows a warp
#endif
#ifndef WARPS
#define WARPS 4  // warps a block
#endif

#include "gemv_common.cuh"

__device__ __forceinline__ u32 hfma2(u32 a, u32 b, u32 c) {
    u32 d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

__device__ __forceinline__ u32 hmul2(u32 a, u32 b) {
    u32 d;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

// the sum of an fp16 pair, in fp32 (exact)
__device__ __forceinline__ float pair_sum(u32 h) {
    float lo, hi;
    asm("{.reg .f16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.f32.f16 %0, l;\n\tcvt.f32.f16 %1, h;}"
        : "=f"(lo), "=f"(hi) : "r"(h));
    return lo + hi;
}

// two E4M3 scales (the low byte first) as fp32
__device__ __forceinline__ float2 e4m3_pair(u16 s) {
    u32 h;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(s));
    float2 f;
    asm("{.reg .f16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.f32.f16 %0, l;\n\tcvt.f32.f16 %1, h;}"
        : "=f"(f.x), "=f"(f.y) : "r"(h));
    return f;
}

// the 8 codes of a word as fp16 pairs, each value * 2^-14: out = (c0, c4), (c2, c6), (c1, c5), (c3, c7)
__device__ __forceinline__ void e2m1x8(u32 w, u32* out) {
    const u32 low3 = 0x07070707u, fp16_fields = 0x8E008E00u;
    const u32 even = (w & low3) | ((w << 3) & ~low3);
    const u32 odd = ((w >> 4) & low3) | ((w >> 1) & ~low3);
    out[0] = (even << 9) & fp16_fields;
    out[1] = (even << 1) & fp16_fields;
    out[2] = (odd << 9) & fp16_fields;
    out[3] = (odd << 1) & fp16_fields;
}

__device__ __forceinline__ void e2m1x32(uint4 v, u32* out) {
    e2m1x8(v.x, out);
    e2m1x8(v.y, out + 4);
    e2m1x8(v.z, out + 8);
    e2m1x8(v.w, out + 12);
}

// One step of a lane: 16 bytes of each of its ROWS rows of a, their two scales, and b's 16 bytes and scales.
struct Step {
    uint4 a[ROWS];
    u16 a_scales[ROWS];
    uint4 b;
    u16 b_scales;
};

__device__ __forceinline__ void load_step(Step& step, const uint4* const* rows, const u16* const* row_scales,
                                          const uint4* b, const u16* sb, int u) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        step.a[r] = load_once(rows[r] + u);
        step.a_scales[r] = load_once(row_scales[r] + u);
    }
    step.b = __ldg(b + u);
    step.b_scales = __ldg(sb + u);
}

// Strides are in the pointers' units: uint4 for a and b, u16 (two scales) for the scales, fp16 for c.
extern "C" __global__ void __launch_bounds__(WARPS * 32)
nvfp4_gemv(const uint4* __restrict__ a, const u16* __restrict__ sa, const uint4* __restrict__ b,
           const u16* __restrict__ sb, const float* __restrict__ a_gs, const float* __restrict__ b_gs,
           u16* __restrict__ c, int m, int units, int a_batch, int a_row, int sa_batch, int sa_row, int b_batch,
           int sb_batch, int c_batch, int c_row) {
    const int lane = threadIdx.x % 32, first = (blockIdx.x * WARPS + threadIdx.x / 32) * ROWS;
    if (first >= m) return;  // the whole warp
    const size_t batch = blockIdx.y;
    const uint4* rows[ROWS];
    const u16* row_scales[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {  // rows past m re-read the last one and are not stored
        const size_t row = min(first + r, m - 1);
        rows[r] = a + batch * a_batch + row * a_row;
        row_scales[r] = sa + batch * sa_batch + row * sa_row;
    }
    b += batch * b_batch;
    sb += batch * sb_batch;
    const u32 two_14 = 0x74007400u;  // 2^14 in both halves
    float acc[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[r] = 0.0f;

    // A register double buffer: the next step's loads are in flight while this one is decoded.
    Step next;
    if (lane < units) load_step(next, rows, row_scales, b, sb, lane);
    for (int u = lane; u < units; u += 32) {
        const Step now = next;
        if (u + 32 < units) load_step(next, rows, row_scales, b, sb, u + 32);
        u32 bv[16];
        e2m1x32(now.b, bv);
#pragma unroll
        for (int i = 0; i < 16; ++i) bv[i] = hmul2(bv[i], two_14);  // b's values, exact
        const float2 b_scale = e4m3_pair(now.b_scales);
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            u32 code[16];
            e2m1x32(now.a[r], code);
            u32 first_block = 0, second_block = 0;
#pragma unroll
            for (int i = 0; i < 8; ++i) first_block = hfma2(code[i], bv[i], first_block);
#pragma unroll
            for (int i = 8; i < 16; ++i) second_block = hfma2(code[i], bv[i], second_block);
            const float2 a_scale = e4m3_pair(now.a_scales[r]);
            acc[r] = fmaf(pair_sum(first_block), a_scale.x * b_scale.x, acc[r]);
            acc[r] = fmaf(pair_sum(second_block), a_scale.y * b_scale.y, acc[r]);
        }
    }
    const float unit = 16384.0f * *a_gs * *b_gs;  // the 2^-14 the codes carry, and the global scales
    float sum;
    if (warp_row_sums<ROWS>(acc, &sum) && first + lane < m) {
        u16 rounded;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(rounded) : "f"(sum * unit));
        c[batch * c_batch + static_cast<size_t>(first + lane) * c_row] = rounded;
    }
}

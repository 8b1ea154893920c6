// W4A16 decode GEMV for one token: y[n] = sum_g s[n, g] sum_{k in g} q[n, k] x[k], fp32 sums, y bf16.
//
// W as `formats.quantize_int4` packs it: q [N, K/2] bytes, k = 2j in byte j's low nibble, a
// 4-bit two's complement; s [N, K/group] bf16. At 3 TB/s an SM takes in ~26 weights a clock
// (half a byte each) and issues 128 thread-instructions: under 5 a weight, for the unpacking,
// the multiply-add and the addressing together. An int -> float conversion alone would not fit.
//
// No conversion (as in the Triton kernel of w4a16.py): XOR with 0x88888888 turns each nibble
// into u = q + 8 in 0..15, and a word ANDed with 0xF << e, read as an fp32 bit pattern, is
// u * 2^(e - 149) exactly (a subnormal; for e = 20 bit 23 continues the scale into the first
// normal binade). Nibbles 0-5 are taken at e = 4i from the word, 6 and 7 at e = 16, 20 from
// the word >> 8. So a weight costs one LOP3 (the XOR folds into the AND) and one FFMA with
// x[k] * 2^(149 - E0 - e), prepared once a step for all ROWS rows: the products are
// u * x * 2^-E0. sum (u - 8) x = sum u x - 8 sum x: the second term starts each partial.
// Range (E0 = 72, as in w4a16.py): x is scaled by up to 2^77, so |x| < 2^51 (activations are
// many orders below); products are exact down to |x| ~ 2^-54.
//
// Layout: a warp owns ROWS rows; a lane reads 16 bytes (32 weights, a quarter of a group of
// 128) of each at a time, skipping L1 (read once), and the 64 bytes of x they meet (x is read
// by every warp and stays in L1), the next step's loads issued before this step's arithmetic
// (a double buffer in registers). The partial over the 32 weights is multiplied by its
// group's scale once. The ROWS sums meet in a butterfly of shuffles at the end. K must be a
// multiple of 32, the group a multiple of 32 (GROUP_UNITS loads), rows 16-byte aligned (the
// wrapper checks).
//
// Measured on the H100 (2026-11-25, scripts/quant_gemv_sweep.py): 34-70% of the copy bandwidth
// from 4096 x 4096 to 28672 x 4096, 80-83% of a read-only stream of the same bytes, 2.2-3.0x
// cuBLAS's bf16 GEMV. ROWS = 2 (N <= 4096) or 4, WARPS = 4. ncu at 28672 x 4096: 111
// registers, 21% occupancy, under one eligible warp a scheduler: latency-bound.

#ifndef ROWS
#define ROWS 4  // rows of W a warp
#endif
#ifndef WARPS
#define WARPS 4  // warps a block
#endif
#ifndef GROUP_UNITS
#define GROUP_UNITS 4  // 16-byte loads (32 weights) a group: 4 for group 128
#endif
#define E0 72  // the partials are in units of 2^-E0

#include "gemv_common.cuh"

// x's factor for nibble i of a word, 2^(149 - E0 - e): e = 4i for i < 6, 16 and 20 for 6 and 7 (from the word >> 8)
__device__ constexpr float NIBBLE_UNIT[8] = {0x1p77f, 0x1p73f, 0x1p69f, 0x1p65f, 0x1p61f, 0x1p57f, 0x1p61f, 0x1p57f};
constexpr float ACC_UNIT = 0x1p-72f, Y_UNIT = 0x1p72f;  // 2^-E0, 2^E0

// partial + sum over the word's 8 nibbles of u * x8[i] (x8 already scaled by NIBBLE_UNIT)
__device__ __forceinline__ float word_dot(u32 word, const float* x8, float partial) {
    const u32 v = word ^ 0x88888888u, high = v >> 8;
#pragma unroll
    for (int i = 0; i < 6; ++i) partial = fmaf(__uint_as_float(v & (0xFu << (4 * i))), x8[i], partial);
    partial = fmaf(__uint_as_float(high & 0xF0000u), x8[6], partial);
    return fmaf(__uint_as_float(high & 0xF00000u), x8[7], partial);
}

// One step of a lane: 16 bytes of each of its ROWS rows, their scales, and the 64 bytes of x they meet.
struct Step {
    uint4 q[ROWS];
    u16 scales[ROWS];
    uint4 x[4];
};

__device__ __forceinline__ void load_step(Step& step, const uint4* const* rows, const u16* const* row_scales,
                                          const uint4* x, int u) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        step.q[r] = load_once(rows[r] + u);
        step.scales[r] = load_once(row_scales[r] + u / GROUP_UNITS);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) step.x[j] = __ldg(x + 4 * u + j);
}

// Strides in the pointers' units: uint4 for W's rows, u16 for the scales' rows.
extern "C" __global__ void __launch_bounds__(WARPS * 32)
w4a16_gemv(const uint4* __restrict__ q, const u16* __restrict__ s, const uint4* __restrict__ x,
           u16* __restrict__ y, int n, int units, int q_row, int s_row) {
    const int lane = threadIdx.x % 32, first = (blockIdx.x * WARPS + threadIdx.x / 32) * ROWS;
    if (first >= n) return;  // the whole warp
    const uint4* rows[ROWS];
    const u16* row_scales[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {  // rows past n re-read the last one and are not stored
        const size_t row = min(first + r, n - 1);
        rows[r] = q + row * q_row;
        row_scales[r] = s + row * s_row;
    }
    float acc[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[r] = 0.0f;

    // A register double buffer: the next step's loads are in flight while this one is computed.
    Step next;
    if (lane < units) load_step(next, rows, row_scales, x, lane);
    for (int u = lane; u < units; u += 32) {
        const Step now = next;
        if (u + 32 < units) load_step(next, rows, row_scales, x, u + 32);
        // x's 32 values: each 16 bytes (8 bf16) meet one word of W's nibbles
        float xs[32], x_sum = 0.0f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const u32 pairs[4] = {now.x[j].x, now.x[j].y, now.x[j].z, now.x[j].w};
#pragma unroll
            for (int p = 0; p < 4; ++p) {
                const float lo = __uint_as_float(pairs[p] << 16), hi = __uint_as_float(pairs[p] & 0xFFFF0000u);
                x_sum += lo + hi;
                xs[8 * j + 2 * p] = lo * NIBBLE_UNIT[2 * p];
                xs[8 * j + 2 * p + 1] = hi * NIBBLE_UNIT[2 * p + 1];
            }
        }
        const float start = x_sum * (-8.0f * ACC_UNIT);  // -8 sum x, in the partials' units 2^-E0
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {  // two independent chains a row
            const float first_half = word_dot(now.q[r].y, xs + 8, word_dot(now.q[r].x, xs, start));
            const float second_half = word_dot(now.q[r].w, xs + 24, word_dot(now.q[r].z, xs + 16, 0.0f));
            acc[r] = fmaf(first_half + second_half, __uint_as_float(static_cast<u32>(now.scales[r]) << 16), acc[r]);
        }
    }
    float sum;
    if (warp_row_sums<ROWS>(acc, &sum) && first + lane < n) {
        u16 rounded;
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(rounded) : "f"(sum * Y_UNIT));
        y[first + lane] = rounded;
    }
}

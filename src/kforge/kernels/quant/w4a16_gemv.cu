// W4A16 decode GEMV for one token: y[n] = sum_g s[n, g] sum_{k in g} q[n, k] x[k], fp32 sums, y bf16.
//
// W as `formats.quantize_int4` packs it: q [N, K/2] bytes, k = 2j in byte j's low nibble, a
// 4-bit two's complement; s [N, K/group] bf16. At 3 TB/s an SM takes in ~26 weights a clock
// (half a byte each) and issues 128 thread-instructions: under 5 a weight, for the unpacking,
// the multiply-add and the addressing together. An int -> float conversion alone would not fit:
// w4a16_decode.cuh has the arithmetic that replaces it, one LOP3 and one FFMA a weight.
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
//
// RESIDUAL 1 adds `residual` (N) bf16 in the store, as the unfused pair rounds it: the product to
// bf16 first, then the add in fp32 (torch's bf16 add), rounded again; one launch less a layer.

#ifndef ROWS
#define ROWS 4  // rows of W a warp
#endif
#ifndef WARPS
#define WARPS 4  // warps a block
#endif
#ifndef GROUP_UNITS
#define GROUP_UNITS 4  // 16-byte loads (32 weights) a group: 4 for group 128
#endif
#ifndef RESIDUAL
#define RESIDUAL 0  // 1: y = residual + y, the residual add after the down projection
#endif

#include "w4a16_decode.cuh"

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
           u16* __restrict__ y, const u16* __restrict__ residual, int n, int units, int q_row, int s_row) {
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
        u16 rounded = round_bf16(sum * Y_UNIT);
#if RESIDUAL
        rounded = add_residual_bf16(residual[first + lane], rounded);
#endif
        y[first + lane] = rounded;
    }
}

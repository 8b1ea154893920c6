// The W4A16 GEMVs' arithmetic (w4a16_gemv.cu, w4a16_gemv_bulk.cu): a word of eight 4-bit weights
// against eight x values, with no int -> float conversion.
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

#pragma once

#include "gemv_common.cuh"

#define E0 72  // the partials are in units of 2^-E0

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

// Hopper parts: RMSNorm on the A operand, A through registers (rung 4's NORM_A). A k-tile of a warp's
// 16 A rows goes from swizzled shared memory into wgmma's register-A fragments with ldmatrix, is
// multiplied there by gamma (bf16x2), and its squares are summed per row in fp32 for the 1/rms that
// scales the accumulator rows at the tile's end. Why a part: it turns "normalize, then multiply" into
// one pass with no normalized copy of A; the wgmma that takes A from registers is wgmma.cuh's
// wgmma_m64k16_rs.
#pragma once
#include "common.cuh"

// Four 8 x 8 bf16 matrices from shared memory; lane l gives the 16-byte row address of row l % 8
// of matrix l / 8 and gets back, in register q, matrix q's pair at row l / 4, columns 2 (l % 4)
// + {0, 1}: with matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15,
// k 8-15) of a warp's 16 rows, exactly wgmma's register A fragment for a k16 slice.
__device__ __forceinline__ void ldmatrix_x4(const void* row, u32 (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(row)));
}
__device__ __forceinline__ u32 mul_bf16x2(u32 a, u32 b) {  // each half a * b rounded to nearest even
    u32 d;
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
// One k-tile (64 k) of this warp's 16 A rows from a swizzled K-major tile (`rows`: the warp's first
// row) as wgmma's register fragments: x[ks] holds k16 slice ks, (row lane / 4, k 2 (lane % 4) + {0, 1})
// in x[ks][0], row + 8 in [1], k + 8 in [2], both in [3] (wgmma's A fragment layout).
__device__ __forceinline__ void ldmatrix_a_ktile(const bf16_bits* rows, u32 (&x)[4][4]) {
    const int lane = threadIdx.x % 32, row = lane % 8 + 8 * ((lane / 8) % 2);
    const char* base = reinterpret_cast<const char*>(rows) + row * 128;
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) ldmatrix_x4(base + (((2 * ks + lane / 16) ^ (row % 8)) * 16), x[ks]);
}
// The squares of a k-tile of x (ldmatrix_a_ktile's layout) added to this thread's row sums in fp32:
// row lane / 4 in .x and .z, lane / 4 + 8 in .y and .w (four chains of FMAs, not two); a quad's 4 lanes
// split each row's k values between them.
__device__ __forceinline__ void add_squares(const u32 (&x)[4][4], float4& sums) {
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const float2 v = bf16x2_to_float2(x[ks][q]);
            float& sum = q == 0 ? sums.x : q == 1 ? sums.y : q == 2 ? sums.z : sums.w;
            sum = fmaf(v.x, v.x, fmaf(v.y, v.y, sum));
        }
}

// Hopper parts: epilogues, from a warpgroup's fp32 accumulator to C in bf16. The fused math (bias per
// column, an activation, a residual M x N, a per-row scale) applied pair by pair just before the one
// rounding; the stores: straight to global memory (store_tile_global), or through swizzled shared
// memory with stmatrix (store_cols_swizzled) and out by TMA, in 64-column slices through a small ring
// of buffers (EpilogueSlices); and the overlapped form, whose results wait as bf16 pairs in registers
// (pack_tile) and go out a slice at a time under the next tile's k-loop (store_packed_swizzled).
// Why a part: every GEMM here ends the same way; only when and how much of the tile goes out differs.
#pragma once
#include "common.cuh"
#include "tma.cuh"

// One warpgroup's 64 x TILE_N accumulator, rounded to bf16, straight to global memory: each
// lane stores 4-byte pairs (the simple epilogue of rungs 2 and 3; N is a multiple of 8).
template <int TILE_N>
__device__ __forceinline__ void store_tile_global(const float (&d)[TILE_N / 2], bf16_bits* C, int M, int N, int row0,
                                                  int col0) {
    const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
#pragma unroll
    for (int i = 0; i < TILE_N / 8; ++i)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = row0 + 16 * warp + lane / 4 + 8 * half, c = col0 + 8 * i + 2 * (lane % 4);
            if (r < M && c < N)
                *reinterpret_cast<u32*>(C + (size_t)r * N + c) = pack_bf16x2(d[4 * i + 2 * half], d[4 * i + 2 * half + 1]);
        }
}

// ---- fused epilogue: bias and activation on the fp32 accumulator, before the one rounding ----

// GELU with erf by Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7, branch-free: one reciprocal
// and one exp on the MUFU unit, eight FMAs), instead of libdevice's erff (two polynomial
// branches, ~25 instructions, both taken when a warp straddles |x| = 1).
__device__ __forceinline__ float gelu_erf(float x) {
    const float z = fabsf(x) * 0.70710678118654752f;
    const float t = __fdividef(1.0f, fmaf(0.3275911f, z, 1.0f));
    const float poly =
        t * fmaf(t, fmaf(t, fmaf(t, fmaf(t, 1.061405429f, -1.453152027f), 1.421413741f), -0.284496736f), 0.254829592f);
    const float erf_abs = 1.0f - poly * __expf(-z * z);
    return 0.5f * x * (1.0f + copysignf(erf_abs, x));
}
// GELU, tanh form: 0.5 x (1 + tanh(u)) = x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3).
__device__ __forceinline__ float gelu_tanh(float x) {
    return x * __fdividef(1.0f, 1.0f + __expf(-1.5957691216057308f * fmaf(0.044715f * x, x * x, x)));
}
__device__ __forceinline__ float silu(float x) { return x * __fdividef(1.0f, 1.0f + __expf(-x)); }

// ACT: 0 none, 1 GELU (erf), 2 GELU (tanh), 3 SiLU.
template <int ACT>
__device__ __forceinline__ float activation(float x) {
    if constexpr (ACT == 1) return gelu_erf(x);
    else if constexpr (ACT == 2) return gelu_tanh(x);
    else if constexpr (ACT == 3) return silu(x);
    else return x;
}

// Columns [first, first + COLS) of the same accumulator into shared memory laid out as
// TMA's 128-byte swizzle expects (COLS/64 chunks of 64 rows x 128 bytes), with stmatrix: one
// instruction stores four 8 x 8 matrices, whose 8 rows land in 8 different 16-byte units, so
// every matrix covers all 32 banks once. (4-byte stores through the generic address of the
// hand-aligned buffer, ptxas's ST.E, took 4x the instructions; at 4096^3 stmatrix cut the
// epilogue from ~2.3K to ~1.9K cycles a tile, measured with scripts/gemm_timeline.py.)
// `first` must be a compile-time constant after unrolling (it indexes registers). On the
// way, the fused epilogue: act(scale[row] value + bias[column]) + residual[row, column] in
// fp32 (ROW_SCALE, BIAS, ACT, RESIDUAL; row0 and col0 are the 64-row slab's first row and
// column, register 4i + 2h + e holds row 16 warp + lane / 4 + 8h and column
// 8i + 2 (lane % 4) + e), computed pair by pair into temporaries just before the rounding,
// so the accumulators stay as they are and the activation's temporaries stay few (writing
// the results back into the accumulator array spilled SiLU at the 168-register cap).
// Bias and residual are read as bf16 pairs (N is even: a pair inside N is whole), the
// residual (M x N, row-major) only inside C.
// Four 8 x 8 bf16 matrices to shared memory in one instruction: lane l supplies the 16-byte row
// address of row l % 8 of matrix l / 8, and holds in register q the pair of matrix q at row l / 4,
// columns 2 (l % 4) + {0, 1}: the accumulator's own layout, so no shuffles.
__device__ __forceinline__ void stmatrix_x4(void* row, u32 m0, u32 m1, u32 m2, u32 m3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(smem_u32(row)), "r"(m0),
                 "r"(m1), "r"(m2), "r"(m3)
                 : "memory");
}
// The fused epilogue on one accumulator pair (4i + 2h, 4i + 2h + 1), rounded to bf16: row
// 16 warp + lane / 4 + 8h of the slab, column 8i + 2 (lane % 4) of the tile; `b` is that
// column pair's bias (bias_pair).
template <int BIAS, int ACT, int RESIDUAL>
__device__ __forceinline__ u32 epilogue_pair(float v0, float v1, float2 b, int i, int half, int row0, int col0, int M,
                                             int N, const bf16_bits* __restrict__ residual) {
    const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
    const int r = 16 * warp + lane / 4 + 8 * half, col = col0 + 8 * i + 2 * (lane % 4);
    if (BIAS) v0 += b.x, v1 += b.y;  // (+0.0f would not be free: it turns -0 into +0)
    v0 = activation<ACT>(v0), v1 = activation<ACT>(v1);
    if (RESIDUAL && row0 + r < M && col < N) {
        const float2 add =
            bf16x2_to_float2(__ldg(reinterpret_cast<const unsigned int*>(residual + size_t(row0 + r) * N + col)));
        v0 += add.x, v1 += add.y;
    }
    return pack_bf16x2(v0, v1);
}
template <int BIAS>
__device__ __forceinline__ float2 bias_pair(int i, int col0, int N, const bf16_bits* __restrict__ bias) {
    const int col = col0 + 8 * i + 2 * (threadIdx.x % 4);
    return BIAS && col < N ? bf16x2_to_float2(__ldg(reinterpret_cast<const unsigned int*>(bias + col)))
                           : make_float2(0.0f, 0.0f);
}
// Where lane l's stmatrix row address points for column groups (j, j + 1) of a swizzled slice:
// matrices (group j, rows 0-7), (j, rows 8-15), (j + 1, 0-7), (j + 1, 8-15).
__device__ __forceinline__ char* stmatrix_row(bf16_bits* tile, int j) {
    const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
    const int q = lane / 8, r = 16 * warp + lane % 8 + 8 * (q % 2), jq = j + q / 2;
    return reinterpret_cast<char*>(tile) + (jq / 8) * 64 * 128 + r * 128 + ((jq % 8) ^ (r % 8)) * 16;
}
// ROW_SCALE: each accumulator row first times its factor, scale.x for this thread's row
// 16 warp + lane / 4, scale.y for the row 8 below (rung 4's RMSNorm, NORM_A).
template <int TILE_N, int COLS, int BIAS = 0, int ACT = 0, int RESIDUAL = 0, int ROW_SCALE = 0>
__device__ __forceinline__ void store_cols_swizzled(const float (&d)[TILE_N / 2], bf16_bits* tile, int first,
                                                    int row0 = 0, int col0 = 0, int M = 0, int N = 0,
                                                    const bf16_bits* __restrict__ bias = nullptr,
                                                    const bf16_bits* __restrict__ residual = nullptr,
                                                    float2 scale = make_float2(1.0f, 1.0f)) {
    auto pair = [&](int i, int half, float2 b) {
        const float s = half ? scale.y : scale.x;
        return epilogue_pair<BIAS, ACT, RESIDUAL>(ROW_SCALE ? d[4 * i + 2 * half] * s : d[4 * i + 2 * half],
                                                  ROW_SCALE ? d[4 * i + 2 * half + 1] * s : d[4 * i + 2 * half + 1],
                                                  b, i, half, row0, col0, M, N, residual);
    };
#pragma unroll
    for (int j = 0; j < COLS / 8; j += 2) {
        const int i = first / 8 + j;
        const float2 b0 = bias_pair<BIAS>(i, col0, N, bias);
        const u32 m0 = pair(i, 0, b0), m1 = pair(i, 1, b0);
        const float2 b1 = bias_pair<BIAS>(i + 1, col0, N, bias);
        stmatrix_x4(stmatrix_row(tile, j), m0, m1, pair(i + 1, 0, b1), pair(i + 1, 1, b1));
    }
}
// The same in two halves, for an epilogue that overlaps the next tile's k-loop: first the whole
// accumulator through the fused epilogue into bf16 pairs (pair 2i + h: group i, half h) ...
template <int TILE_N, int BIAS = 0, int ACT = 0, int RESIDUAL = 0, int ROW_SCALE = 0>
__device__ __forceinline__ void pack_tile(const float (&d)[TILE_N / 2], u32 (&packed)[TILE_N / 4], int row0, int col0,
                                          int M, int N, const bf16_bits* __restrict__ bias,
                                          const bf16_bits* __restrict__ residual, float2 scale) {
#pragma unroll
    for (int i = 0; i < TILE_N / 8; ++i) {
        const float2 b = bias_pair<BIAS>(i, col0, N, bias);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const float s = half ? scale.y : scale.x;
            packed[2 * i + half] = epilogue_pair<BIAS, ACT, RESIDUAL>(
                ROW_SCALE ? d[4 * i + 2 * half] * s : d[4 * i + 2 * half],
                ROW_SCALE ? d[4 * i + 2 * half + 1] * s : d[4 * i + 2 * half + 1], b, i, half, row0, col0, M, N,
                residual);
        }
    }
}
// ... then columns [first, first + COLS) of it into a swizzled slice, whenever there is time.
template <int TILE_N, int COLS>
__device__ __forceinline__ void store_packed_swizzled(const u32 (&packed)[TILE_N / 4], bf16_bits* tile, int first) {
#pragma unroll
    for (int j = 0; j < COLS / 8; j += 2) {
        const int i = first / 8 + j;
        stmatrix_x4(stmatrix_row(tile, j), packed[2 * i], packed[2 * i + 1], packed[2 * i + 2], packed[2 * i + 3]);
    }
}

// The TMA stores of one warpgroup's result, Cols columns of its 64 rows at a time, through Buffers
// slice buffers of 64 x Cols bf16 (Cols / 64 swizzled 64 x 64 boxes) taken in turn: begin() waits
// until the buffer's previous store has read it (stores complete in order, so with two buffers "all
// but the latest group" is this buffer's) and returns it; the caller fills it (swizzled); end() hands
// it to the TMA store. The turn is counted across tiles: a tile of 192 columns has 3 slices, so its
// slice number alone would put the next tile's first slice in the buffer whose store was issued
// last, while that store may still be reading it. `group`: the warpgroup's named barrier is 1 + group.
template <int Cols, int Buffers>
struct EpilogueSlices {
    static_assert(Cols % 64 == 0, "a slice is whole 64-column boxes");
    static_assert(Buffers == 1 || Buffers == 2, "one epilogue buffer, or two in turn");
    u32 begun = 0;  // slices begun so far: the buffer turn
    bf16_bits* buffers;
    int group, thread;
    __device__ __forceinline__ EpilogueSlices(bf16_bits* buffers_, int group_, int thread_)
        : buffers(buffers_), group(group_), thread(thread_) {}
    __device__ __forceinline__ bf16_bits* begin() {
        if (thread == 0) bulk_wait_read<Buffers - 1>();
        named_barrier(1 + group, 128);
        return buffers + begun++ % Buffers * 64 * Cols;
    }
    // The filled slice to C at (row, col): its 64-column boxes, one bulk group.
    __device__ __forceinline__ void end(const TensorMap& map, const bf16_bits* slice, int row, int col) const {
        fence_proxy_async();
        named_barrier(1 + group, 128);
        if (thread == 0) {
            for (int c = 0; c < Cols / 64; ++c) tma_store_2d(map, slice + c * 64 * 64, col + 64 * c, row);
            bulk_commit();
        }
    }
    // Before the CTA exits: its shared memory must outlive the last store's reads.
    __device__ __forceinline__ void drain() const {
        if (thread == 0) bulk_wait_read();
    }
};

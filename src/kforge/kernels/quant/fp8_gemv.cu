// FP8 weight-only GEMV on mma.sync: y[m, n] = sum_c s[n / 128, c] sum_{k in chunk c} q[n, k] x[m, k],
// 1 to 16 tokens, fp32 sums, y bf16. One launch, no partial sums in global memory.
//
// W as `formats.quantize_fp8_blockwise(w, (128, 128))` makes it: q [N, K] e4m3 codes, s [ceil(N/128),
// K/128] fp32, one scale per 128 x 128 block. x [M, K] bf16, not quantized. The tensor cores take the
// weights as rows of A (m16) and the tokens as columns of B (n8): D[n, m] += sum_k q[n, k] x[m, k].
// Per weight the kernel reads one byte; at 3 TB/s an SM takes in ~13 a clock and can issue ~9
// instructions for each. The loop spends ~2.5 whatever the batch (<= 8 tokens a tile).
//
// Decoding, exact: every e4m3 value is a bf16 value (3 mantissa bits, exponents 2^-9..2^8). The
// hardware converts a pair of codes to an f16 pair (cvt.rn.f16x2.e4m3x2, sm_89 on), each half is
// widened to fp32 and the two are packed to a bf16 pair (cvt.rn.bf16x2.f32, exact here): four
// instructions a pair. x stays bf16, so A and B are both bf16 and q * x is exact in the fp32 sum.
// (An f16 mma would save two of the four, but bf16 x does not fit f16's range.)
//
// Which k a lane holds. A fragment's columns for lane (g = lane / 4, t = lane % 4) are 2t, 2t+1,
// 2t+8, 2t+9 and B's rows the same four. A dot product does not care which physical k a logical
// column is, as long as A and B agree, so lane t takes 32 whole k (32 bytes, two 16-byte loads) of
// each row in each 128-k chunk: k16 step s (0..7) uses the lane's word s, k = 32t + 4s + 0..3,
// its low code pair as columns (2t, 2t+1) and its high pair as (2t+8, 2t+9). B's registers are
// then x's bf16 pairs (k 32t + 4s, +1) and (+2, +3): words 2s and 2s+1 of the lane's 64 bytes of x,
// used as loaded.
//
// Scales. A chunk (128 k) lies in one scale block and a warp's 16 MT rows in one 128-row band, so
// one fp32 scale covers a warp's whole chunk: its 8 steps sum in fresh accumulators, which are
// multiplied by the scale into the running sums (q * s is never rounded).
//
// Layout. A warp owns MT m-tiles (16 MT rows); the KW warps of a block split K, chunk c going to
// warp c % KW (a block reads KW neighbouring chunks of each row at a time), and add their sums
// through shared memory at the end in a fixed order: deterministic. The next chunk's W is loaded
// while this one is computed (a register double buffer; XPF=1 loads its x with it, at the cost of 16
// NT registers). W is read once
// (loads that skip L1); x is read by every block and stays in L1/L2. Rows past N re-read row N - 1
// and tokens past the batch the last token; neither is stored. K must be whole chunks and W's and
// x's rows 16-byte aligned (the wrapper checks).
//
// The defaults here (MT 1, KW 8, XPF 0, MINB 3: 74-80 registers on sm_90, no spills, 3 blocks of 8
// warps an SM) and the variants taken by width and batch are measured choices: fp8_gemv.py's
// `cuda_variant`.
//
// RESIDUAL 1 adds `residual` (M, N) bf16 in the store, as the unfused pair rounds it: the product
// to bf16 first, then the add in fp32 (torch's bf16 add), rounded again; one launch less a layer.

#ifndef MT
#define MT 1  // 16-row m-tiles a warp
#endif
#ifndef NT
#define NT 1  // 8-token n-tiles: the batch is at most 8 NT
#endif
#ifndef KW
#define KW 8  // warps a block, splitting K
#endif
#ifndef MINB
#define MINB 3  // blocks an SM that __launch_bounds__ asks ptxas to make room for (registers)
#endif
#ifndef XPF
#define XPF 0  // 1: x loaded a chunk ahead with W (registers) instead of when the chunk is computed
#endif
#ifndef RESIDUAL
#define RESIDUAL 0  // 1: y = residual + y, the residual add that follows the down projection in a decode step
#endif

#include "gemv_common.cuh"

static_assert(128 % (16 * MT) == 0, "a warp's rows must lie in one 128-row scale band");

// The four e4m3 codes of a word (the low byte first) as two bf16 pairs: codes (0, 1) in `low`,
// (2, 3) in `high`, the lower code in each pair's low half. Exact.
__device__ __forceinline__ void e4m3x4_to_bf16(u32 word, u32& low, u32& high) {
    asm("{\n\t"
        ".reg .b16 c01, c23;\n\t"
        ".reg .b32 h01, h23;\n\t"
        ".reg .f16 a, b;\n\t"
        ".reg .f32 fa, fb;\n\t"
        "mov.b32 {c01, c23}, %2;\n\t"
        "cvt.rn.f16x2.e4m3x2 h01, c01;\n\t"
        "cvt.rn.f16x2.e4m3x2 h23, c23;\n\t"
        "mov.b32 {a, b}, h01;\n\t"
        "cvt.f32.f16 fa, a;\n\t"
        "cvt.f32.f16 fb, b;\n\t"
        "cvt.rn.bf16x2.f32 %0, fb, fa;\n\t"  // the first source goes to the upper half
        "mov.b32 {a, b}, h23;\n\t"
        "cvt.f32.f16 fa, a;\n\t"
        "cvt.f32.f16 fb, b;\n\t"
        "cvt.rn.bf16x2.f32 %1, fb, fa;\n\t"
        "}"
        : "=r"(low), "=r"(high)
        : "r"(word));
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 word_of(const uint4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// One chunk of a lane: 32 bytes of rows g and g + 8 of each m-tile, and the chunk's scale.
struct Chunk {
    uint4 q[MT][2][2];  // [m-tile][row g, g + 8][first, second 16 bytes]
    float scale;
#if XPF
    uint4 x[4][NT];
#endif
};

// Offsets are 32-bit element indices (uint4 for q and x, fp32 for s): one IMAD.WIDE an address.
__device__ __forceinline__ void load_chunk(Chunk& chunk, const uint4* q, const float* s, const u32 (&rows)[MT][2],
                                           u32 scale_row, const uint4* x, const u32 (&tokens)[NT], int c) {
#if XPF
#pragma unroll
    for (int w = 0; w < 4; ++w)
#pragma unroll
        for (int j = 0; j < NT; ++j) chunk.x[w][j] = __ldg(x + (tokens[j] + 16 * c) + w);
#endif
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int half = 0; half < 2; ++half) chunk.q[i][h][half] = load_once(q + (rows[i][h] + 8 * c + half));
    chunk.scale = __ldg(s + (scale_row + c));
}

// acc += this chunk's products: 8 k16 steps of MT x NT mma, then the chunk's scale.
__device__ __forceinline__ void compute_chunk(float (&acc)[MT][NT][4], const Chunk& chunk, const uint4* x,
                                              const u32 (&tokens)[NT], int c) {
#if XPF
    const uint4 (&xs)[4][NT] = chunk.x;
#else
    uint4 xs[4][NT];  // x's words 4w..4w+3 of the lane's 16 (k 32t + 8w ..)
#pragma unroll
    for (int w = 0; w < 4; ++w)
#pragma unroll
        for (int j = 0; j < NT; ++j) xs[w][j] = __ldg(x + (tokens[j] + 16 * c) + w);
#endif
    float part[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) part[i][j][e] = 0.0f;
#pragma unroll
    for (int s = 0; s < 8; ++s) {  // k 32t + 4s .. + 3: W's word s, x's words 2s and 2s + 1
        u32 b[NT][2];
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            b[j][0] = word_of(xs[s / 2][j], 2 * (s % 2));
            b[j][1] = word_of(xs[s / 2][j], 2 * (s % 2) + 1);
        }
#pragma unroll
        for (int i = 0; i < MT; ++i) {
            u32 g_low, g_high, g8_low, g8_high;
            e4m3x4_to_bf16(word_of(chunk.q[i][0][s / 4], s % 4), g_low, g_high);
            e4m3x4_to_bf16(word_of(chunk.q[i][1][s / 4], s % 4), g8_low, g8_high);
            const u32 a[4] = {g_low, g8_low, g_high, g8_high};
#pragma unroll
            for (int j = 0; j < NT; ++j) mma_bf16(part[i][j], a, b[j][0], b[j][1]);
        }
    }
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = fmaf(part[i][j][e], chunk.scale, acc[i][j][e]);
}

// Strides in the pointers' units: uint4 for q's and x's rows, fp32 for s's, u16 for y's.
extern "C" __global__ void __launch_bounds__(KW * 32, MINB)
fp8_gemv(const uint4* __restrict__ q, const float* __restrict__ s, const uint4* __restrict__ x,
         u16* __restrict__ y, const u16* __restrict__ residual, int n, int batch, int chunks, int q_row, int s_row,
         int x_row, int y_row, int r_row) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
    const int first = blockIdx.x * 16 * MT;
    u32 rows[MT][2];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // rows past n re-read the last one and are not stored
            const u32 row = min(first + 16 * i + 8 * h + g, n - 1);
            rows[i][h] = row * q_row + 2 * t;
        }
    const u32 scale_row = static_cast<u32>(first / 128) * s_row;
    u32 tokens[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j) tokens[j] = min(8 * j + g, batch - 1) * x_row + 4 * t;

    float acc[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

    // Two chunks in registers, taking turns: one is computed while the other's loads are in flight.
    Chunk even, odd;
    if (warp < chunks) load_chunk(even, q, s, rows, scale_row, x, tokens, warp);
    for (int c = warp; c < chunks; c += 2 * KW) {
        if (c + KW < chunks) load_chunk(odd, q, s, rows, scale_row, x, tokens, c + KW);
        compute_chunk(acc, even, x, tokens, c);
        if (c + KW >= chunks) break;
        if (c + 2 * KW < chunks) load_chunk(even, q, s, rows, scale_row, x, tokens, c + 2 * KW);
        compute_chunk(acc, odd, x, tokens, c + KW);
    }

    // The warps' sums meet in warp 0, added in warp order.
    constexpr int SUMS = MT * NT * 4;
    static_assert((KW - 1) * SUMS * 32 * 4 <= 48 * 1024, "the cross-warp sums exceed static shared memory");
    __shared__ float others[KW > 1 ? KW - 1 : 1][SUMS][32];
    if (warp > 0) {
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) others[warp - 1][(i * NT + j) * 4 + e][lane] = acc[i][j][e];
    }
    __syncthreads();
    if (warp > 0) return;
#pragma unroll
    for (int i = 0; i < MT; ++i) {
#pragma unroll
        for (int j = 0; j < NT; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float sum = acc[i][j][e];
                for (int w = 0; w < KW - 1; ++w) sum += others[w][(i * NT + j) * 4 + e][lane];
                const int row = first + 16 * i + g + 8 * (e / 2), token = 8 * j + 2 * t + e % 2;
                if (row < n && token < batch) {
                    u16 rounded = round_bf16(sum);
#if RESIDUAL
                    rounded = add_residual_bf16(residual[static_cast<size_t>(token) * r_row + row], rounded);
#endif
                    y[static_cast<size_t>(token) * y_row + row] = rounded;
                }
            }
        }
    }
}

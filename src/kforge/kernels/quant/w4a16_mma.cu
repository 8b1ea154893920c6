// W4A16 for 1 to 32 tokens on mma.sync: y[m, n] = sum_g s[n, g] sum_{k in g} q[n, k] x[m, k],
// fp32 sums, y bf16. One launch, no partial sums in global memory.
//
// W as `formats.quantize_int4` packs it: q [N, K/2] bytes, k = 2j in byte j's low nibble, a 4-bit
// two's complement; s [N, K/group] bf16. x [M, K] bf16. The tensor cores take the weights as rows
// of A (m16) and the tokens as columns of B (n8): D[n, m] += sum_k q[n, k] x[m, k] over k16 steps.
//
// Decoding without a conversion. XOR 0x88888888 turns each nibble into u = q + 8 in 0..15, and
// (word >> 4i) & 0x000F000F | 0x43004300 is a pair of bf16, 128 + u, from nibbles i and i + 4
// (0x4300 is 128.0 and its 7 mantissa bits count units of 1). One FMA, x * 1.0 - 136, leaves
// exactly q. So a word of 8 weights is 3 shifts, 4 LOP3 and 4 HFMA2 for 4 registers of A.
//
// Which k a lane holds. A fragment's columns for lane (g = lane / 4, t = lane % 4) are 2t, 2t+1,
// 2t+8, 2t+9, and B's rows the same four: a dot product does not care which physical k each
// logical column is, as long as A and B agree. So lane t takes 32 whole k (16 bytes of a row,
// one load) of each 128-k chunk, and a k16 step pairs nibbles (i, i + 4) of one word as the
// decode makes them; B's pairs of x are put in the same order with one PRMT each. A chunk is 8
// steps: words 0..3, nibble pairs (0, 4) + (1, 5), then (2, 6) + (3, 7).
//
// Scales. The products q * x are exact and summed in fp32 over a chunk (128 k, inside one group:
// the group must be 128 k times a power of two, its index a shift); the chunk's sum is multiplied
// by its row's scale into the running sum, as the other W4A16 kernels do (q * s is never rounded
// to bf16). That takes a second set of accumulators: at 32 tokens and 4 m-tiles a warp, 255
// registers and a few spills.
//
// Layout. A warp owns MT m-tiles (16 MT rows); the KW warps of a block split K, chunk c going to
// warp c % KW (so a block reads KW neighbouring chunks of each row at a time), and add their sums
// through shared memory at the end in a fixed order: one launch, deterministic. The next DEPTH - 1
// chunks' W is loaded while one is computed (a register ring; XPF=1 loads each chunk's x with it,
// where the registers allow); x (read by every block) goes through L1. Tokens past the batch
// re-read the last token's x and are not stored.
//
// RESIDUAL 1 adds `residual` (M, N) bf16 in the store, as the unfused pair rounds it: the product
// to bf16 first, then the add in fp32 (torch's bf16 add), rounded again; one launch less a layer.
//
// Measured on the H100 (scripts/quant_gemv_sweep.py w4a16-batch): at N x K = 4096 x 4096, 14336 x
// 4096, 4096 x 14336, 28672 x 4096 and 2, 3, 8, 16, 32 tokens, faster than cuBLAS's bf16 GEMM on the
// dequantized W (1.1-3.1x) and than the Triton paths it replaces (1.1-1.9x) at every one; 2 to 8
// tokens reach 30-70% of copy (the read stream of the same bytes 40-85%), 32 tokens 20-39%. The
// loop is 2.2 (NT 1) to 3.3 (NT 4, MT 2) instructions a weight: few tokens are bound by the memory,
// many by issue. On the H200 at one token it beat the one-token kernels at 4096 and 28672 rows
// (w4a16.py's `one_token_kernel`).

#ifndef MT
#define MT 2  // 16-row m-tiles a warp
#endif
#ifndef NT
#define NT 2  // 8-token n-tiles: the batch is at most 8 NT
#endif
#ifndef KW
#define KW 4  // warps a block, splitting K
#endif

#ifndef DEPTH
#define DEPTH 2  // chunks a warp holds in registers: DEPTH - 1 loading while one is computed
#endif
#ifndef RESIDUAL
#define RESIDUAL 0  // 1: y = residual + y, the residual add that follows the down projection in a decode step
#endif
#ifndef XPF
#define XPF 0  // 1: x loaded a chunk ahead with W (registers) instead of when the chunk is computed
#endif

#include "gemv_common.cuh"

// nibbles i and i + 4 of a word shifted down by 4i, as two bf16 q: (nibble ^ 8) | 0x4300 is 128 + u
// (one LOP3 with the XOR folded in), and x * 1 - 136 leaves q. `mask` is 0x000F000F, passed in a
// register: LOP3 takes one immediate, and ptxas would otherwise rebuild the constant every time.
__device__ __forceinline__ u32 nibble_pair(u32 shifted, u32 mask) {
    const u32 biased = (shifted & mask) ^ 0x43084308u;
    u32 q;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(q) : "r"(biased), "r"(0x3F803F80u), "r"(0xC308C308u));
    return q;
}

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 selector) {
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(selector));
    return d;
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

// One chunk of a lane: rows g and g + 8 of each m-tile, 16 bytes each, and their scales.
struct Chunk {
    uint4 q[MT][2];
    u16 scales[MT][2];
#if XPF
    uint4 x[4][NT];
#endif
};

// Operand offsets are 32-bit element indices (uint4 for q and x, u16 for s): one IMAD.WIDE makes
// an address, where 64-bit pointers kept per row cost ptxas more registers than it would spend.
__device__ __forceinline__ void load_chunk(Chunk& chunk, const uint4* q, const u16* s, const u32 (&rows)[MT][2],
                                           const u32 (&row_scales)[MT][2], const uint4* x, const u32 (&tokens)[NT],
                                           int c, int group_shift) {
#if XPF
#pragma unroll
    for (int w = 0; w < 4; ++w)
#pragma unroll
        for (int j = 0; j < NT; ++j) chunk.x[w][j] = __ldg(x + (tokens[j] + 16 * c) + w);
#endif
#pragma unroll
    for (int i = 0; i < MT; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            chunk.q[i][h] = load_once(q + (rows[i][h] + 4 * c));
            chunk.scales[i][h] = load_once(s + (row_scales[i][h] + (c >> group_shift)));
        }
    }
}

// acc += this chunk's products: 8 k16 steps of MT x NT mma, then each row's scale.
__device__ __forceinline__ void compute_chunk(float (&acc)[MT][NT][4], const Chunk& chunk, const uint4* x,
                                              const u32 (&tokens)[NT], int c, u32 mask) {
#if XPF
    const uint4 (&xs)[4][NT] = chunk.x;
#else
    uint4 xs[4][NT];  // word w's x: (k0, k1) (k2, k3) (k4, k5) (k6, k7) of k 32t + 8w
#pragma unroll
    for (int w = 0; w < 4; ++w)
#pragma unroll
        for (int j = 0; j < NT; ++j) xs[w][j] = __ldg(x + (tokens[j] + 16 * c) + w);
#endif
    float part[MT][NT][4];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
#pragma unroll
        for (int p = 0; p < 2; ++p) {  // the step of nibble pairs (2p, 2p + 4) and (2p + 1, 2p + 5)
            u32 b[NT][2];
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                const u32 low = p == 0 ? xs[w][j].x : xs[w][j].y, high = p == 0 ? xs[w][j].z : xs[w][j].w;
                b[j][0] = prmt(low, high, 0x5410);  // (k 2p, k 2p + 4)
                b[j][1] = prmt(low, high, 0x7632);  // (k 2p + 1, k 2p + 5)
            }
#pragma unroll
            for (int i = 0; i < MT; ++i) {
                const u32 g_word = word_of(chunk.q[i][0], w), g8_word = word_of(chunk.q[i][1], w);
                const u32 a[4] = {nibble_pair(g_word >> (8 * p), mask), nibble_pair(g8_word >> (8 * p), mask),
                                  nibble_pair(g_word >> (8 * p + 4), mask), nibble_pair(g8_word >> (8 * p + 4), mask)};
#pragma unroll
                for (int j = 0; j < NT; ++j) {
                    if (w == 0 && p == 0) {
#pragma unroll
                        for (int e = 0; e < 4; ++e) part[i][j][e] = 0.0f;
                    }
                    mma_bf16(part[i][j], a, b[j][0], b[j][1]);
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < MT; ++i) {
        const float row_g = __uint_as_float(static_cast<u32>(chunk.scales[i][0]) << 16);
        const float row_g8 = __uint_as_float(static_cast<u32>(chunk.scales[i][1]) << 16);
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            acc[i][j][0] = fmaf(part[i][j][0], row_g, acc[i][j][0]);
            acc[i][j][1] = fmaf(part[i][j][1], row_g, acc[i][j][1]);
            acc[i][j][2] = fmaf(part[i][j][2], row_g8, acc[i][j][2]);
            acc[i][j][3] = fmaf(part[i][j][3], row_g8, acc[i][j][3]);
        }
    }
}

// Strides in the pointers' units: uint4 for q's and x's rows, u16 for s's and y's.
extern "C" __global__ void __launch_bounds__(KW * 32)
w4a16_mma(const uint4* __restrict__ q, const u16* __restrict__ s, const uint4* __restrict__ x,
          u16* __restrict__ y, const u16* __restrict__ residual, int n, int batch, int chunks, int group_shift,
          int q_row, int s_row, int x_row, int y_row, int r_row) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
    const int first = blockIdx.x * 16 * MT;
    u32 rows[MT][2], row_scales[MT][2];
#pragma unroll
    for (int i = 0; i < MT; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // rows past n re-read the last one and are not stored
            const u32 row = min(first + 16 * i + 8 * h + g, n - 1);
            rows[i][h] = row * q_row + t;
            row_scales[i][h] = row * s_row;
        }
    }
    u32 tokens[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j) tokens[j] = min(8 * j + g, batch - 1) * x_row + 4 * t;
    // 0x000F000F (n >= 0) in a form ptxas cannot fold: as a constant it is rebuilt before every LOP3
    const u32 mask = 0x000F000Fu | static_cast<u32>(n >> 31);

    float acc[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

    // DEPTH chunks in registers, a ring: the loads of the next DEPTH - 1 are in flight while one is computed.
    Chunk ring[DEPTH];
#pragma unroll
    for (int d = 0; d < DEPTH - 1; ++d)
        if (warp + d * KW < chunks) load_chunk(ring[d], q, s, rows, row_scales, x, tokens, warp + d * KW, group_shift);
    for (int first_chunk = warp; first_chunk < chunks; first_chunk += DEPTH * KW) {
#pragma unroll
        for (int d = 0; d < DEPTH; ++d) {
            const int c = first_chunk + d * KW;
            if (c >= chunks) break;
            const int ahead = c + (DEPTH - 1) * KW;
            if (ahead < chunks)
                load_chunk(ring[(d + DEPTH - 1) % DEPTH], q, s, rows, row_scales, x, tokens, ahead, group_shift);
            compute_chunk(acc, ring[d], x, tokens, c, mask);
        }
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

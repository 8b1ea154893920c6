// Form 1 of w4a16_bulk_mma.cu (session 18, never committed; see this folder's README), with knobs for an A/B:
// FEED_ONLY 1: TIMING ONLY, WRONG RESULTS: the consumers wait for each stage and free it without computing.
// ROW_STRIDE: the rows' stride in a stage (2112, form 1's, puts rows g and g + 1 16 banks apart;
//   2048 and 2176 keep every row 128-byte aligned, at a 2-way bank conflict on W's loads).
// UNROLL: chunks a warp's loop takes at a time (2 in form 1).
#ifndef FEED_ONLY
#define FEED_ONLY 0
#endif
#ifndef UNROLL
#define UNROLL 2
#endif
// W4A16 decode GEMV for one token on the tensor cores, fed by the bulk-copy engine:
// y[n] = sum_g s[n, g] sum_{k in g} q[n, k] x[k], fp32 sums, y bf16.
//
// Why. w4a16_gemv_bulk.cu streams W into shared memory as fast as a read-only stream reads it
// (built with its consumers computing nothing it takes 23.5 us at 28672 x 4096, the read stream
// 23.0), yet runs at 25.7 us: its consumers spend 2.6 instructions a weight on the CUDA cores
// and, at two blocks of four warps an SM, cannot issue them fast enough to keep up
// (benchmarks/notes/2026-11-26-session18). Here the same bytes go through mma.sync m16n8k16:
// the decode is 7 instructions a word of 8 weights and the multiply-adds cost an mma per 256.
//
// Decode (w4a16_decode.cuh, w4a16_mma.cu): nibble pairs (i, i + 4) of a word shifted down by 4i
// become a bf16 pair of 136 + q with one LOP3, a word's four pairs after 3 shifts. With
// EXACT_DECODE 1 an HFMA2 per pair takes the 136 off, exactly, before the mma (as w4a16_mma.cu
// does). With EXACT_DECODE 0 the mma sums (136 + q) x and each 128-k chunk's sum has 136 sum x
// taken off afterwards in fp32 (x_corr, computed once a block): one instruction fewer a pair,
// at the price of summing terms ~34x larger than q x before that cancellation: relative to
// sum |q x| the chunk's rounding grows from ~2^-24 to ~2^-19, still far below bf16's 2^-9.
//
// One token as the mma's B: lane (g, t) holds x for token column g, and every column gets the
// same token, so D's eight columns are the same sums and a lane reads what it needs (rows g and
// g + 8 of the m-tile) from its own registers. x is put into B's fragment order once a block
// (xf: for chunk c, word w, lane t the four bf16 pairs of its two k16 steps), so the loop loads
// a step's B with one shared-memory load shared by the 8 lanes of a t, and no PRMT.
//
// Work. A tile is 16 rows of W (one m-tile). The producer's one thread copies a tile's rows (one
// bulk copy each, at a 2112-byte stride: rows g and g + 1 land 16 banks apart, so the 16-byte
// loads of a quarter-warp never collide) and their scales (one copy: consecutive rows' scales are
// contiguous) into a ring of STAGES. The CONSUMERS warps split each tile's K by 128-k chunks
// (warp w takes chunks w, w + CONSUMERS, ...), free the stage, and add their 16 row sums in
// shared memory in warp order: deterministic. Tiles are dealt round-robin over a persistent grid.
// K must be a multiple of 1024 and at most 4096 (a row is one copy of whole 16-byte units, its
// scales too), the group 128, W and its scales contiguous and 16-byte aligned (the wrapper checks).

#include "../gemm_bf16/hopper.cuh"
#include "w4a16_decode.cuh"

#ifndef CONSUMERS
#define CONSUMERS 4  // warps a block that compute, splitting each tile's K
#endif
#ifndef STAGES
#define STAGES 6
#endif
#ifndef EXACT_DECODE
#define EXACT_DECODE 0  // 1: q made exact before the mma (an HFMA2 a pair); 0: 136 sum x taken off each chunk's sum
#endif

#define TILE_ROWS 16
#ifndef ROW_STRIDE
#define ROW_STRIDE 2112
#endif  // a row's codes (at most 2048 bytes) + 64: consecutive rows 16 banks apart
#define SCALES_OFFSET (TILE_ROWS * ROW_STRIDE)
#define STAGE_BYTES (SCALES_OFFSET + TILE_ROWS * 64)  // the codes, then the tile's scales (at most 32 a row)

extern "C" __global__ void __launch_bounds__(32 * (CONSUMERS + 1), 1)
w4a16_bulk_mma(const unsigned char* __restrict__ q, const unsigned char* __restrict__ s, const uint4* __restrict__ x,
               u16* __restrict__ y, int n, int k) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int chunks = k / 128, row_bytes = k / 2, scale_bytes = k / 64;  // a row's 128-k chunks, codes, scales
    const int tiles = CEIL_DIV(n, TILE_ROWS);
    uint4* xf = reinterpret_cast<uint4*>(smem + STAGES * STAGE_BYTES);       // [chunks][4 words][4 lanes t]
    float* x_corr = reinterpret_cast<float*>(xf + 16 * chunks);                // [chunks]: -136 sum x
    float* row_sums = x_corr + chunks;                                         // [2][CONSUMERS - 1][16]
    u64* full = reinterpret_cast<u64*>(row_sums + 2 * (CONSUMERS - 1) * 16);  // (8-byte aligned: chunks % 8 == 0)
    u64* empty = full + STAGES;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

    if (threadIdx.x == 0) {
        for (int st = 0; st < STAGES; ++st) {
            mbar_init(&full[st], 1);  // the producer's arrival (and the copies' bytes)
            mbar_init(&empty[st], CONSUMERS);
        }
        fence_barrier_init();
    }
    __syncthreads();

    if (warp == CONSUMERS) {  // the producer: one thread books a stage's bytes and asks for the tile's rows
        if (lane != 0) return;
        int it = 0;
        for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x, ++it) {
            const int st = it % STAGES, row0 = tile * TILE_ROWS, rows = min(TILE_ROWS, n - row0);
            unsigned char* stage = smem + st * STAGE_BYTES;
            mbar_wait(&empty[st], ((it / STAGES) & 1) ^ 1);
            mbar_arrive_expect_tx(&full[st], rows * (row_bytes + scale_bytes));
            bulk_load_1d(stage + SCALES_OFFSET, s + static_cast<size_t>(row0) * scale_bytes, rows * scale_bytes,
                         &full[st]);
            for (int r = 0; r < rows; ++r)
                bulk_load_1d(stage + r * ROW_STRIDE, q + static_cast<size_t>(row0 + r) * row_bytes, row_bytes,
                             &full[st]);
        }
        return;
    }

    // x in B's fragment order, and each chunk's -136 sum x, once a block (while the first tiles arrive):
    // one chunk (128 values, 16 loads issued together) a thread.
    for (int c = threadIdx.x; c < chunks; c += 32 * CONSUMERS) {
        uint4 v[16];  // v[4t + w]: k = 128 c + 32 t + 8 w .. + 7, as bf16 pairs
#pragma unroll
        for (int i = 0; i < 16; ++i) v[i] = __ldg(x + 16 * c + i);
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const u32 pairs[4] = {v[i].x, v[i].y, v[i].z, v[i].w};
#pragma unroll
            for (int p = 0; p < 4; ++p) sum += __uint_as_float(pairs[p] << 16) + __uint_as_float(pairs[p] & 0xFFFF0000u);
        }
        x_corr[c] = -136.0f * sum;
#pragma unroll
        for (int t = 0; t < 4; ++t)
#pragma unroll
            for (int w = 0; w < 4; ++w) {  // the k16 steps of nibble pairs (0, 4) + (1, 5), then (2, 6) + (3, 7)
                const uint4 u = v[4 * t + w];
                xf[(4 * c + w) * 4 + t] = make_uint4(prmt(u.x, u.z, 0x5410), prmt(u.x, u.z, 0x7632),
                                                     prmt(u.y, u.w, 0x5410), prmt(u.y, u.w, 0x7632));
            }
    }
    named_barrier(1, 32 * CONSUMERS);

    const int g = lane / 4, t = lane % 4;
    // 0x000F000F (n >= 0) in a form ptxas cannot fold: as a constant it is rebuilt before every LOP3
    const u32 mask = 0x000F000Fu | static_cast<u32>(n >> 31);
    int it = 0;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x, ++it) {
        const int st = it % STAGES;
        const unsigned char* stage = smem + st * STAGE_BYTES;
        const uint4* codes_g = reinterpret_cast<const uint4*>(stage + g * ROW_STRIDE) + t;  // + 4 c: chunk c
        const uint4* codes_g8 = reinterpret_cast<const uint4*>(stage + (g + 8) * ROW_STRIDE) + t;
        const u16* scales_g = reinterpret_cast<const u16*>(stage + SCALES_OFFSET + g * scale_bytes);
        const u16* scales_g8 = reinterpret_cast<const u16*>(stage + SCALES_OFFSET + (g + 8) * scale_bytes);
        float sum_g = 0.0f, sum_g8 = 0.0f;
        mbar_wait(&full[st], (it / STAGES) & 1);
        if (FEED_ONLY) {
            __syncwarp();
            if (lane == 0) mbar_arrive(&empty[st]);
            continue;
        }
#pragma unroll UNROLL
        for (int c = warp; c < chunks; c += CONSUMERS) {
            const uint4 wg = codes_g[4 * c], wg8 = codes_g8[4 * c];
            float even[4] = {0.0f, 0.0f, 0.0f, 0.0f}, odd[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // two mma chains
#pragma unroll
            for (int w = 0; w < 4; ++w) {
                const uint4 b = xf[(4 * c + w) * 4 + t];
                const u32 word_g = word_of(wg, w), word_g8 = word_of(wg8, w);
#pragma unroll
                for (int p = 0; p < 2; ++p) {
#if EXACT_DECODE
                    const u32 a[4] = {nibble_pair(word_g >> (8 * p), mask), nibble_pair(word_g8 >> (8 * p), mask),
                                      nibble_pair(word_g >> (8 * p + 4), mask), nibble_pair(word_g8 >> (8 * p + 4), mask)};
#else
                    const u32 a[4] = {biased_pair(word_g >> (8 * p), mask), biased_pair(word_g8 >> (8 * p), mask),
                                      biased_pair(word_g >> (8 * p + 4), mask), biased_pair(word_g8 >> (8 * p + 4), mask)};
#endif
                    mma_bf16(w % 2 ? odd : even, a, p ? b.z : b.x, p ? b.w : b.y);
                }
            }
            // group 128: chunk c's scale is the row's c-th
            const float scale_g = __uint_as_float(static_cast<u32>(scales_g[c]) << 16);
            const float scale_g8 = __uint_as_float(static_cast<u32>(scales_g8[c]) << 16);
#if EXACT_DECODE
            sum_g = fmaf(even[0] + odd[0], scale_g, sum_g);
            sum_g8 = fmaf(even[2] + odd[2], scale_g8, sum_g8);
#else
            const float corr = x_corr[c];
            sum_g = fmaf(even[0] + odd[0] + corr, scale_g, sum_g);
            sum_g8 = fmaf(even[2] + odd[2] + corr, scale_g8, sum_g8);
#endif
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[st]);

        // The warps' row sums meet in warp 0, added in warp order (a buffer per tile parity: a warp
        // writing tile it + 2's sums has passed tile it + 1's barrier, so warp 0 has read tile it's).
        float* others = row_sums + (it & 1) * (CONSUMERS - 1) * 16;
        if (warp > 0 && t == 0) others[(warp - 1) * 16 + g] = sum_g, others[(warp - 1) * 16 + g + 8] = sum_g8;
        named_barrier(1, 32 * CONSUMERS);
        if (warp == 0 && t == 0) {
            for (int w = 0; w < CONSUMERS - 1; ++w) sum_g += others[w * 16 + g], sum_g8 += others[w * 16 + g + 8];
            const int row = tile * TILE_ROWS + g;
            u16 rounded;
            if (row < n) {
                asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(rounded) : "f"(sum_g));
                y[row] = rounded;
            }
            if (row + 8 < n) {
                asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(rounded) : "f"(sum_g8));
                y[row + 8] = rounded;
            }
        }
    }
}

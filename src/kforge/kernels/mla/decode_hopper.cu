// MLA decode for Hopper in CUDA: kernel 1 of `decode.py`'s two (the split-KV partials; its combine is
// reused), on kforge's Hopper parts (../hopper/: the TMA + mbarrier stage ring, wgmma descriptors,
// stmatrix; ../attention/hopper_attention.cuh: exp2, quad reductions, pins). The contract is decode.py's:
// q (batch, s_q, h_q, 576) contiguous, the latent cache (pages, PAGE_SIZE, 1, 576) paged through a block
// table, each head attending to K_t = the whole 576-value row and V_t = its first 512 values, causal over
// the s_q query tokens or not; bf16 (or fp16 with FP16 1); PAGE_SIZE a multiple of 64.
//
// Why CUDA: Triton's 64-row tile runs both dots at 155-162 TFLOP/s (20% of the tensor rate) and its 16-
// and 32-row tiles fall to mma.sync. Here a CTA takes 64 query rows (fewer rows are padded: at 16 heads
// the padded products still finish under the tile's read) of one request over one split of its tokens,
// 64 tokens a tile (one page of 64, or a 64-token slice of a larger page: one TMA row coordinate).
//
// Roles, three warpgroups (as flash_hopper.cu): warp 0 of warpgroup 0 is the producer (24 registers a
// thread): its lanes read 32 page ids at a time from the block table, and its lane 0 loads the Q tile
// once and each cache tile as 9 boxes of 64 tokens x 64 values into a ring of STAGES stages. Warpgroups
// 1 and 2 are consumers (240 registers) and split each tile's work in halves with no duplicated product:
//   S_c = Q K^T over tokens 32c..32c+31 (64 x 32, 36 k16 steps over the 576 values);
//   the row max of both halves, exchanged through shared memory (a 256-thread named barrier), so both
//   use one running max and their P halves are on one scale; P_c rounded to 16 bits by stmatrix into
//   the stage's RoPE chunk (K's values 512-575, which only S reads: free once both have passed the
//   first barrier; 64 x 64, swizzled as wgmma reads it); a second barrier: P is whole;
//   O_c (64 x 256, fp32 registers) = O_c alpha + P V[:, 256c..256c+255] (4 k16 steps, V read N-major
//   from the same cache tile: no second read).
// Each consumer keeps its own share of the row sums (same max, same rescales); they are added once at
// the end. The last tile of a request may hold tokens past its length (stale rows of the page): their
// scores are masked to -inf by a select, and each consumer zeroes those rows of its V columns before
// P V, so a NaN left in the pool cannot reach the output (0 x NaN is NaN).
//
// The consumer's index and the stage are compile-time constants in each copy of the tile loop (one
// a consumer, unrolled by the two stages), so the wgmma descriptors are constant offsets; the output
// rescale is skipped where no row of the warp has a new max. Together 1-3% on not-causal shapes in one
// run (823 -> ~620 instructions a tile; scripts/mla_hopper_stages.py says where the rest goes).
// Why one tile at a time: S_{k+1} issued before P_k V_k (the softmax under the P V) holds both stages
// through the softmax, so tile k + 2's load starts only as it is due: 1.3-1.45x slower on the H200.
// Measured (H200, 2026-11-29, kforge bench mla, docs/deepseek.md): 77-91% of copy where memory-bound,
// 435-513 TFLOP/s where compute-bound (h_q s_q >= 128; a run before the constants, on another machine:
// 80.7-94.2% and 448-522); 1.3-3.1x the Triton kernels.
//
// Out: a request in one split (whole) writes out (q's dtype) and lse (natural log) itself; else each
// split writes its normalised fp32 output and lse (log2 units) where decode.py's combine reads them:
// part_out[(request rows + row) num_splits + split][512] (host plan) or [(first item + split) rows +
// row][512] (device schedule). A split past its request's length writes nothing (the combine counts
// only the splits a request has).
#include "../attention/hopper_attention.cuh"
#include "../hopper/pipeline.cuh"
#include "../hopper/tma.cuh"

#ifndef FP16
#define FP16 0  // 1: fp16 q, cache and out; 0: bf16
#endif
#ifndef CAUSAL
#define CAUSAL 0
#endif
#ifndef PAGE_SIZE
#define PAGE_SIZE 64
#endif
#ifndef STAGES
#define STAGES 2
#endif
#ifndef SCHEDULED
#define SCHEDULED 0  // 1: splits from the device schedule (schedule != null), else from split_size
#endif

#define D_QK 576  // 512 latent + 64 RoPE values a cache row
#define D_V 512
#define BLOCK_M 64  // query rows a CTA
#define BLOCK_N 64  // tokens a tile
#define HALF_N 32  // tokens of a tile whose scores a consumer computes
#define V_HALF 256  // value columns a consumer accumulates
#define CHUNKS (D_QK / 64)  // 64-value (128-byte) boxes across a row
#define ROPE_CHUNK (D_V / 64)  // the last: K's RoPE values, read by S only, then P's place
#define TILE (BLOCK_N * D_QK)  // elements of a Q or cache tile (both 64 rows)
#define NUM_THREADS 384
#define PAGE_IDS 32  // page ids the producer warp reads at once
#define SHARED_BYTES (2 * (1 + STAGES) * TILE + 4 * 4 * BLOCK_M + 8 * (1 + 2 * STAGES) + 1024)
#define EXCHANGE_BARRIER 1  // named barrier of the two consumer warpgroups (0 is __syncthreads)
#define PRODUCER_REGISTERS 24
#define CONSUMER_REGISTERS 240
static_assert(PAGE_SIZE % BLOCK_N == 0, "a tile is one page or a 64-token slice of one");
static_assert(SHARED_BYTES <= 227 * 1024, "fits one block's shared memory");
static_assert((PRODUCER_REGISTERS + 2 * CONSUMER_REGISTERS) * 128 <= 65536, "the register file");
// Descriptor steps in 16-byte units: a 64-value chunk of a 64-row tile is 8 KB; k16 slices are 32 bytes
// apart inside a chunk; V's 16-token slices are 16 rows of 128 bytes apart.
#define CHUNK_STEP (BLOCK_N * 128 / 16)
#define STEP_IN_CHUNK (32 / 16)
#define STAGE_STEP (TILE * 2 / 16)
#define V_SLICE_STEP (16 * 128 / 16)

#define WGMMA_D16_REGS "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define WGMMA_D16_OPERANDS(d) WGMMA_D8(d, 0), WGMMA_D8(d, 8)
// One wgmma from shared memory, both operands: D (64 x N, fp32) (+)= A (64 x 16) B (16 x N); the operand
// numbers follow D's registers (N / 2 of them), TRANS_B 1 reads B N-major.
#define MLA_WGMMA(TYPE, N, REGS, OPERANDS, A, B, SCALE, TRANS_B)                                  \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #SCALE ", 0;\n"                            \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " {" REGS "}, %" #A \
                 ", %" #B ", p, 1, 1, 0, " #TRANS_B ";\n}\n"                                          \
                 : OPERANDS(d)                                                                   \
                 : "l"(a_desc), "l"(b_desc), "r"(accumulate))
// S (64 x 32) (+)= Q (64 x 16, K-major) K^T (32 tokens x 16, K-major).
__device__ __forceinline__ void wgmma_scores(float (&d)[16], u64 a_desc, u64 b_desc, int accumulate) {
    if constexpr (FP16) MLA_WGMMA("f16", 32, WGMMA_D16_REGS, WGMMA_D16_OPERANDS, 16, 17, 18, 0);
    else MLA_WGMMA("bf16", 32, WGMMA_D16_REGS, WGMMA_D16_OPERANDS, 16, 17, 18, 0);
}
// O (64 x 256) += P (64 x 16 tokens, K-major) V (16 tokens x 256, N-major: transposed).
__device__ __forceinline__ void wgmma_values(float (&d)[128], u64 a_desc, u64 b_desc, int accumulate) {
    if constexpr (FP16) MLA_WGMMA("f16", 256, WGMMA_D128_REGS, WGMMA_D128_OPERANDS, 128, 129, 130, 1);
    else MLA_WGMMA("bf16", 256, WGMMA_D128_REGS, WGMMA_D128_OPERANDS, 128, 129, 130, 1);
}

template <int N> struct Index { static constexpr int value = N; };  // a compile-time int as a type

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
mla_decode_hopper(const __grid_constant__ TensorMap q_map, const __grid_constant__ TensorMap cache_map,
                  const int* __restrict__ block_table, const int* __restrict__ seqlens, bf16_bits* __restrict__ out,
                  float* __restrict__ lse, float* __restrict__ part_out, float* __restrict__ part_lse,
                  const int* __restrict__ schedule, int stride_table, int h_q, int s_q, int max_pages,
                  int num_splits, int split_size, float scale_log2) {
    check_launch(NUM_THREADS, SHARED_BYTES);
    const int rows_total = s_q * h_q, m_blocks = (rows_total + BLOCK_M - 1) / BLOCK_M;
    const int request = blockIdx.x / m_blocks, m_block = blockIdx.x % m_blocks, split = blockIdx.y;
    // clamped to the block-table row, so an unchecked length never reads past it
    const int length = max(0, min(seqlens[request], max_pages * PAGE_SIZE));
#if SCHEDULED  // decode.py's mla_decode_schedule_kernel sized the splits from the lengths: request b owns
    // items [schedule[1 + b], schedule[2 + b]) of schedule[0] tokens; partials item-major, as its combine reads
    const int first_item = schedule[1 + request], items = schedule[2 + request] - first_item;
    if (split >= items) return;  // (the whole CTA, before any barrier)
    const int start = split * schedule[0], end = min(start + schedule[0], length);
    const bool whole = items == 1;
#else  // splits of split_size tokens planned on the host; partials split-minor
    const int start = split * split_size;
    if (num_splits > 1 && start >= length) return;
    const int end = min(start + split_size, length);
    const bool whole = num_splits == 1;
#endif
    const int tiles = start < end ? (end - start + BLOCK_N - 1) / BLOCK_N : 0;

    extern __shared__ __align__(16) unsigned char smem_raw[];  // aligned to 1024 by hand (the swizzle atom)
    bf16_bits* q_tile = reinterpret_cast<bf16_bits*>((reinterpret_cast<size_t>(smem_raw) + 1023) & ~size_t(1023));
    bf16_bits* kv_tiles = q_tile + TILE;
    float* row_max_of = reinterpret_cast<float*>(kv_tiles + STAGES * TILE);  // [consumer][row]
    float* row_sum_of = row_max_of + 2 * BLOCK_M;
    u64* q_full = reinterpret_cast<u64*>(row_sum_of + 2 * BLOCK_M);
    const StageRing<STAGES> ring(q_full + 1);
    // (a shuffle from lane 0: ptxas then knows the warpgroup index is warp-uniform, so the branch on it below
    // does not count as divergent around the wgmmas)
    const int wg = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0), lane = threadIdx.x % 32;
    if (threadIdx.x == 0) {
        mbar_init(q_full, 1);
        ring.init(1, 8);  // the producer's arrive (+ the bytes); each consumer warp's release
        fence_barrier_init();
    }
    __syncthreads();

    if (wg == 0) {
        setmaxnreg_dec<PRODUCER_REGISTERS>();
        if (threadIdx.x >= 32) return;
        const int* table = block_table + size_t(request) * stride_table;
        if (lane == 0) {
            mbar_arrive_expect_tx(q_full, TILE * 2);
            for (int c = 0; c < CHUNKS; ++c)
                tma_load_2d(q_tile + c * BLOCK_M * 64, q_map, q_full, 64 * c, request * rows_total + m_block * BLOCK_M);
        }
        int page = 0;
        for (int k = 0; k < tiles; ++k) {
            const int token0 = start + k * BLOCK_N;
            if (k % PAGE_IDS == 0) {  // the next 32 tiles' pages, one a lane, read before they are due
                const int mine = token0 + lane * BLOCK_N;
                page = mine < end ? table[mine / PAGE_SIZE] : 0;
            }
            const int tile_page = __shfl_sync(0xffffffffu, page, k % PAGE_IDS);
            if (lane == 0) {
                const int s = ring.acquire(k);
                ring.expect(s, TILE * 2);
                const int row = tile_page * PAGE_SIZE + token0 % PAGE_SIZE;
                for (int c = 0; c < CHUNKS; ++c)
                    tma_load_2d(kv_tiles + s * TILE + c * BLOCK_N * 64, cache_map, ring.full_bar(s), 64 * c, row);
            }
            __syncwarp();
        }
        return;
    }

    setmaxnreg_inc<CONSUMER_REGISTERS>();
    // The consumer's index and the stage are compile-time constants in the code below (one copy of the
    // loop per consumer, the tile loop unrolled by the stages), so every wgmma descriptor is a constant
    // offset from one base: per wgmma, ptxas had spent ~7 instructions moving runtime descriptors into
    // uniform registers (290 of the tile's 823).
    auto consume = [&](auto which) {
    constexpr int consumer = decltype(which)::value;
    const int thread = threadIdx.x % 128, warp = thread / 32;
    int row_in_block[2], limit[2];  // this thread's rows (h = 0, 1) and the tokens each sees
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        row_in_block[h] = 16 * warp + lane / 4 + 8 * h;
        const int token_of_row = (m_block * BLOCK_M + row_in_block[h]) / h_q;
        limit[h] = CAUSAL ? min(length, length - s_q + token_of_row + 1) : length;
    }
    const int mask_from = CAUSAL ? max(0, length - s_q + 1) : length;  // the fewest tokens a real row sees
    const u64 q_desc = kmajor_desc(q_tile, 0);
    const u64 k_desc = kmajor_desc(kv_tiles + consumer * HALF_N * 64, 0);  // this consumer's 32 token rows
    const u64 v_desc = smem_desc(kv_tiles + consumer * 4 * BLOCK_N * 64, BLOCK_N * 128, 1024);  // its 4 chunks
    const u64 p_desc = kmajor_desc(kv_tiles + ROPE_CHUNK * BLOCK_N * 64, 0);  // P over the stage's RoPE chunk
    float s[HALF_N / 2], o[V_HALF / 2];  // wgmma's accumulator layout (hopper_attention.cuh)
    float row_max[2] = {ATTENTION_NEG_INF, ATTENTION_NEG_INF}, row_sum[2] = {0.0f, 0.0f}, rescale[2];
#pragma unroll
    for (int i = 0; i < V_HALF / 2; ++i) o[i] = 0.0f;

    auto issue_scores = [&](auto stage_c, u32 phase) {
        constexpr int at_stage = decltype(stage_c)::value;
        ring.wait(at_stage, phase);
        constexpr u64 stage = at_stage * STAGE_STEP;
#pragma unroll
        for (int ks = 0; ks < D_QK / 16; ++ks)
            wgmma_scores(s, q_desc + (ks / 4) * CHUNK_STEP + (ks % 4) * STEP_IN_CHUNK,
                         k_desc + stage + (ks / 4) * CHUNK_STEP + (ks % 4) * STEP_IN_CHUNK, ks > 0);
        wgmma_commit();
    };
    // Tile k's scores (landed) into P_k: the row max of both halves (barrier 1), exp2, this consumer's row
    // sums, P_k's half over the stage's RoPE chunk (its scores are done: both consumers passed barrier 1),
    // and a request's last tile's stale V rows zeroed; barrier 2: P_k whole.
    auto softmax = [&](int k, auto stage_c) {
        const int token0 = start + k * BLOCK_N;
        bf16_bits* tile = kv_tiles + decltype(stage_c)::value * TILE;
        if (token0 + BLOCK_N > mask_from) {  // the split's tail or the causal edge
            const int key = token0 + consumer * HALF_N + 2 * (lane % 4);
#pragma unroll
            for (int i = 0; i < HALF_N / 8; ++i)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    if (key + 8 * i + e >= limit[0]) s[4 * i + e] = ATTENTION_NEG_INF;
                    if (key + 8 * i + e >= limit[1]) s[4 * i + 2 + e] = ATTENTION_NEG_INF;
                }
        }
        float tile_max[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float m = fmaxf(s[2 * h], s[2 * h + 1]);
#pragma unroll
            for (int i = 1; i < HALF_N / 8; ++i) m = fmaxf(m, fmaxf(s[4 * i + 2 * h], s[4 * i + 2 * h + 1]));
            tile_max[h] = quad_max(m) * scale_log2;  // scale > 0: max(s) scale = max(s scale)
            if (lane % 4 == 0) row_max_of[consumer * BLOCK_M + row_in_block[h]] = tile_max[h];
        }
        named_barrier(EXCHANGE_BARRIER, 256);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float other = lds_f32(row_max_of + (1 - consumer) * BLOCK_M + row_in_block[h]);
            const float m_new = fmaxf(row_max[h], fmaxf(tile_max[h], other));
            const float m_sub = m_new == ATTENTION_NEG_INF ? 0.0f : m_new;  // a row that has seen nothing yet
            rescale[h] = exp2_approx(row_max[h] - m_sub);
            row_max[h] = m_new;
            float sum = 0.0f;
#pragma unroll
            for (int i = 0; i < HALF_N / 8; ++i) {
                float& a = s[4 * i + 2 * h];
                float& b = s[4 * i + 2 * h + 1];
                a = exp2_approx(fmaf(a, scale_log2, -m_sub)), b = exp2_approx(fmaf(b, scale_log2, -m_sub));
                sum += a + b;
            }
            row_sum[h] = fmaf(row_sum[h], rescale[h], sum);
        }
        if (token0 + BLOCK_N > end) {  // the request's last tile: zero this consumer's V rows past the length
            const int valid = end - token0;
            for (int unit = thread; unit < (BLOCK_N - valid) * 4 * 8; unit += 128) {  // 16-byte units
                const int r = valid + unit / 32, chunk = consumer * 4 + (unit / 8) % 4;
                *reinterpret_cast<uint4*>(tile + chunk * BLOCK_N * 64 + r * 64 + (unit % 8) * 8) =
                    make_uint4(0, 0, 0, 0);
            }
        }
        const int q = lane / 8, r = 16 * warp + lane % 8 + 8 * (q % 2);  // stmatrix (store_rows_swizzled's)
#pragma unroll
        for (int j = 0; j < HALF_N / 8; j += 2) {
            const int group = consumer * 4 + j + q / 2;  // P_c is column groups 4c..4c+3 of the 64 x 64 tile
            stmatrix_x4(reinterpret_cast<char*>(tile + ROPE_CHUNK * BLOCK_N * 64) + r * 128 + ((group ^ (r % 8)) * 16),
                        pack_pair<FP16>(s[4 * j], s[4 * j + 1]), pack_pair<FP16>(s[4 * j + 2], s[4 * j + 3]),
                        pack_pair<FP16>(s[4 * j + 4], s[4 * j + 5]), pack_pair<FP16>(s[4 * j + 6], s[4 * j + 7]));
        }
        fence_proxy_async();  // P and the zeroed rows, written by threads, read by wgmma
        named_barrier(EXCHANGE_BARRIER, 256);
    };

    // O times the tile's factors, then O += P V over this consumer's 256 columns; the stage is free after.
    // (skipped where no row of the warp has a new max: a factor of exactly 1, most tiles once the max settles)
    auto rescale_output = [&]() {
        if (__any_sync(0xffffffffu, rescale[0] != 1.0f || rescale[1] != 1.0f)) {
#pragma unroll
            for (int i = 0; i < V_HALF / 8; ++i)
                o[4 * i] *= rescale[0], o[4 * i + 1] *= rescale[0], o[4 * i + 2] *= rescale[1],
                    o[4 * i + 3] *= rescale[1];
        }
        pin(o);
        wgmma_fence();
    };
    auto issue_values = [&](auto stage_c) {
        constexpr u64 stage = decltype(stage_c)::value * STAGE_STEP;
#pragma unroll
        for (int ks = 0; ks < BLOCK_N / 16; ++ks)
            wgmma_values(o, p_desc + stage + ks * STEP_IN_CHUNK, v_desc + stage + ks * V_SLICE_STEP, 1);
        wgmma_commit();
    };
    auto retire_values = [&](auto stage_c) {
        wgmma_wait<0>();
        pin(o);
        ring.release(decltype(stage_c)::value, lane);
    };
    // One tile at a time: S, its softmax, P V, then the stage is free. (Issuing S_{k+1} before P_k V_k, to run
    // the softmax under P V, holds both stages through it, so tile k + 2's load could start only as tile
    // k + 1's scores were due: 1.3-1.45x slower on the H200, memory- and compute-bound alike; the worklog.)
    auto step = [&](int k, auto stage_c) {
        wgmma_fence();
        issue_scores(stage_c, (k / STAGES) & 1);
        wgmma_wait<0>();
        pin(s);
        softmax(k, stage_c);
        rescale_output();
        issue_values(stage_c);
        retire_values(stage_c);
    };
    mbar_wait(q_full, 0);
    static_assert(STAGES == 2, "the tile loop is unrolled by two stages");
    int k = 0;
    for (; k + 1 < tiles; k += 2) step(k, Index<0>{}), step(k + 1, Index<1>{});
    if (k < tiles) step(k, Index<0>{});

    // Epilogue: the two consumers' row sums added, then O / l and the lse of each real row.
    float total[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        total[h] = quad_sum(row_sum[h]);
        if (lane % 4 == 0) row_sum_of[consumer * BLOCK_M + row_in_block[h]] = total[h];
    }
    named_barrier(EXCHANGE_BARRIER, 256);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = m_block * BLOCK_M + row_in_block[h];
        if (row >= rows_total) continue;
        const float l = total[h] + lds_f32(row_sum_of + (1 - consumer) * BLOCK_M + row_in_block[h]);
        const bool seen = l > 0.0f;
        const float inv = seen ? 1.0f / l : 0.0f;
        const float lse2 = seen ? row_max[h] + log2f(l) : ATTENTION_NEG_INF;
        const size_t flat = size_t(request) * rows_total + row;
        const int col0 = consumer * V_HALF + 2 * (lane % 4);
        if (whole) {
            bf16_bits* dst = out + flat * D_V + col0;
#pragma unroll
            for (int i = 0; i < V_HALF / 8; ++i)
                *reinterpret_cast<u32*>(dst + 8 * i) =
                    pack_pair<FP16>(o[4 * i + 2 * h] * inv, o[4 * i + 2 * h + 1] * inv);
            if (consumer == 0 && lane % 4 == 0)
                lse[(size_t(request) * h_q + row % h_q) * s_q + row / h_q] = lse2 * 0.69314718055994531f;  // x ln 2
        } else {
#if SCHEDULED
            const size_t partial = size_t(first_item + split) * rows_total + row;
#else
            const size_t partial = flat * num_splits + split;
#endif
            float* dst = part_out + partial * D_V + col0;
#pragma unroll
            for (int i = 0; i < V_HALF / 8; ++i)
                *reinterpret_cast<float2*>(dst + 8 * i) =
                    make_float2(o[4 * i + 2 * h] * inv, o[4 * i + 2 * h + 1] * inv);
            if (consumer == 0 && lane % 4 == 0) part_lse[partial] = lse2;
        }
    }
    };
    if (wg == 1) consume(Index<0>{});
    else consume(Index<1>{});
}

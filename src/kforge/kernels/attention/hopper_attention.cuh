// Hopper attention parts: what a FlashAttention kernel needs beside ../hopper/ (the stage ring, the
// wgmma descriptors, stmatrix): TMA copies through 4-D tensor maps over (batch, head, seq, dim); the two
// products on wgmma in bf16 or fp16 (S = Q K^T with both operands in shared memory, O += P V with P from
// registers); the arrive half of a named barrier (the ping-pong between consumer warpgroups); exp2 on
// the MUFU unit; the online softmax of a thread's two rows of a score tile; the swizzled store of a
// warpgroup's output rows; and which key tiles a query tile sees (the causal skip). Why a part: each
// forward variant (this one, a varlen or paged one, a backward) needs the same pieces, and the fragment
// arithmetic below is where such kernels go wrong; each is compiled alone and checked on the CPU by
// tests/kernels/test_flash_hopper.py. PTX ISA 8.x, sm_90a.
//
// The fragment layout everything here follows (wgmma's m64nNk16 fp32 accumulator): in a warpgroup's
// 64-row tile, lane l of warp w holds rows 16w + l/4 (h = 0) and 16w + l/4 + 8 (h = 1), and for each
// 8-column group i the columns 8i + 2(l%4) + {0, 1}: register 4i + 2h + e is (row h, column 8i + 2(l%4)
// + e). A row's values are spread over the 4 lanes of a quad (l/4 equal), so a row reduction is a
// thread's own values, then two xor shuffles (1, 2) inside the quad.
#pragma once
#include "../hopper/common.cuh"
#include "../hopper/epilogue.cuh"
#include "../hopper/wgmma.cuh"

// ---- TMA through 4-D tensor maps: coordinates (dim, seq, head, batch); rows past seq read as zeros
// and are not written, so the tails of Q, K, V and O need no masks in memory ----

__device__ __forceinline__ void tma_load_4d(void* dst, const TensorMap& map, u64* bar, int col, int row, int head,
                                            int batch) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4, %5, %6}], [%2];" ::"r"(smem_u32(dst)),
        "l"(reinterpret_cast<u64>(&map)), "r"(smem_u32(bar)), "r"(col), "r"(row), "r"(head), "r"(batch)
        : "memory");
}
__device__ __forceinline__ void tma_store_4d(const TensorMap& map, const void* src, int col, int row, int head,
                                             int batch) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];" ::"l"(
                     reinterpret_cast<u64>(&map)),
                 "r"(smem_u32(src)), "r"(col), "r"(row), "r"(head), "r"(batch)
                 : "memory");
}

// Arrive on named barrier `id` without waiting: the other half of a bar.sync among `threads` threads
// (the waiting warpgroup's own 128 count towards it too).
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Pins registers at this point of the program for the compiler's front end: an empty volatile asm that
// "rewrites" them (CUTLASS's warpgroup_fence_operand). It moves register arithmetic freely across the
// volatile wgmma asm, which names only its own operands: a pin after a wait keeps the reads of what the
// wgmma wrote below that wait, a pin after the softmax keeps it above the next one. (ptxas schedules
// later and sees no pins; flash_hopper.cu says how the kernel keeps ptxas's waits in place.)
template <int N>
__device__ __forceinline__ void pin(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void pin(u32 (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// 2^x in one MUFU.EX2 (flush to zero below 2^-126; exp2(-inf) = 0).
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}
#define ATTENTION_NEG_INF __int_as_float(0xff800000u)

// Two fp32 values rounded to one 16-bit pair (lo in the low half): bf16, or fp16 with F16 = 1.
template <int F16>
__device__ __forceinline__ u32 pack_pair(float lo, float hi) {
    u32 packed;
    if constexpr (F16) asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(hi), "f"(lo));
    else asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(hi), "f"(lo));
    return packed;
}

// ---- the two products ----

// S (64 x 128, fp32) (+)= Q (64 x 16, smem, K-major) K^T, K's tile (128 keys x 16, smem) K-major too:
// both are rows of head-dim values, so neither operand is transposed.
#define ATTENTION_WGMMA_QK(TYPE)                                                                    \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                     \
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " {" WGMMA_D64_REGS \
                 "}, %64, %65, p, 1, 1, 0, 0;\n}\n"                                                 \
                 : WGMMA_D64_OPERANDS(d)                                                           \
                 : "l"(q_desc), "l"(k_desc), "r"(accumulate))
template <int F16>
__device__ __forceinline__ void wgmma_qk(float (&d)[64], u64 q_desc, u64 k_desc, int accumulate) {
    if constexpr (F16) ATTENTION_WGMMA_QK("f16");
    else ATTENTION_WGMMA_QK("bf16");
}

#define WGMMA_D32_REGS \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15," \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define WGMMA_D32_OPERANDS(d) WGMMA_D8(d, 0), WGMMA_D8(d, 8), WGMMA_D8(d, 16), WGMMA_D8(d, 24)
// O (64 x DIM, fp32) += P (64 x 16 keys, registers: this warp's 16 rows as `p`) V, V's tile (16 keys x DIM,
// smem) N-major: each key's row of DIM values is contiguous, so wgmma reads it transposed (imm-trans-b 1).
#define ATTENTION_WGMMA_PV(TYPE, N, REGS, OPERANDS, A0, A1, A2, A3, B, SCALE)                           \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #SCALE ", 0;\n"                                 \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " {" REGS "}, {%" #A0 \
                 ", %" #A1 ", %" #A2 ", %" #A3 "}, %" #B ", p, 1, 1, 1;\n}\n"                           \
                 : OPERANDS(d)                                                                         \
                 : "r"(p[0]), "r"(p[1]), "r"(p[2]), "r"(p[3]), "l"(v_desc), "r"(accumulate))
template <int DIM, int F16>
__device__ __forceinline__ void wgmma_pv(float (&d)[DIM / 2], const u32 (&p)[4], u64 v_desc, int accumulate) {
    static_assert(DIM == 64 || DIM == 128, "head dims 64 and 128");
    if constexpr (DIM == 128) {
        if constexpr (F16) ATTENTION_WGMMA_PV("f16", 128, WGMMA_D64_REGS, WGMMA_D64_OPERANDS, 64, 65, 66, 67, 68, 69);
        else ATTENTION_WGMMA_PV("bf16", 128, WGMMA_D64_REGS, WGMMA_D64_OPERANDS, 64, 65, 66, 67, 68, 69);
    } else {
        if constexpr (F16) ATTENTION_WGMMA_PV("f16", 64, WGMMA_D32_REGS, WGMMA_D32_OPERANDS, 32, 33, 34, 35, 36, 37);
        else ATTENTION_WGMMA_PV("bf16", 64, WGMMA_D32_REGS, WGMMA_D32_OPERANDS, 32, 33, 34, 35, 36, 37);
    }
}

// P (the S accumulator after the softmax, fp32) as wgmma's register A fragments for P V, rounded to
// 16 bits. A k16 slice ks of P (keys 16ks..16ks+15) wants, per lane, (row l/4, keys 2(l%4)+{0,1}) in
// a[0], row + 8 in a[1], keys + 8 in a[2], both in a[3]. Keys 16ks + 2(l%4) + e are column group 2ks and
// keys + 8 group 2ks + 1, so a[q] of slice ks holds S registers 4(2ks + q/2) + 2(q%2) + e = 8ks + 2q + e:
// register pair n of S becomes packed value n, in order, with no shuffles.
template <int TILE_N, int F16>
__device__ __forceinline__ void scores_to_operand(const float (&s)[TILE_N / 2], u32 (&p)[TILE_N / 4]) {
#pragma unroll
    for (int n = 0; n < TILE_N / 4; ++n) p[n] = pack_pair<F16>(s[2 * n], s[2 * n + 1]);
}

// ---- the online softmax of a thread's two rows ----

// Per row h (the layout above): the running max m of score * scale * log2(e) (log2 units, so every
// exponential is one FFMA and one MUFU.EX2), this lane's share of the running denominator (the quad's
// four shares add up to the row's at the end: every lane scales its share by the same factor, since
// after the quad max all four hold the same m), and the factor the output rows so far must be
// multiplied by before this tile's P V is added.
template <int TILE_N>
struct OnlineSoftmax {
    float row_max[2] = {ATTENTION_NEG_INF, ATTENTION_NEG_INF};
    float row_sum[2] = {0.0f, 0.0f};
    float rescale[2] = {1.0f, 1.0f};

    // One tile of scores s (TILE_N keys from key0) in place into exp2(s scale log2e - m_new). MASKED:
    // keys at or past limit[h] (n_k, or causal row + 1) become -inf first. A row that has seen no key yet
    // (all -inf so far) subtracts 0, not -inf, so it gets zeros and a rescale of 0 instead of NaNs; only
    // masked tiles can leave a row so, which is why the unmasked path skips the check.
    template <bool MASKED>
    __device__ __forceinline__ void tile(float (&s)[TILE_N / 2], float scale_log2, int key0, int limit0, int limit1) {
        const int lane_key = key0 + 2 * (threadIdx.x % 4);
        if constexpr (MASKED) {
#pragma unroll
            for (int i = 0; i < TILE_N / 8; ++i)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int key = lane_key + 8 * i + e;
                    if (key >= limit0) s[4 * i + e] = ATTENTION_NEG_INF;
                    if (key >= limit1) s[4 * i + 2 + e] = ATTENTION_NEG_INF;
                }
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float even = s[2 * h], odd = s[2 * h + 1];  // two chains, not one 32 long
#pragma unroll
            for (int i = 1; i < TILE_N / 8; ++i)
                even = fmaxf(even, s[4 * i + 2 * h]), odd = fmaxf(odd, s[4 * i + 2 * h + 1]);
            // scale > 0, so max(s) scale = max(s scale): one multiply a row, not one a score
            const float m_new = fmaxf(row_max[h], quad_max(fmaxf(even, odd)) * scale_log2);
            const float m_sub = MASKED && m_new == ATTENTION_NEG_INF ? 0.0f : m_new;
            rescale[h] = exp2_approx(row_max[h] - m_sub);  // 0 while the row had seen nothing
            row_max[h] = m_new;
            float sum_even = 0.0f, sum_odd = 0.0f;
#pragma unroll
            for (int i = 0; i < TILE_N / 8; ++i) {
                float& a = s[4 * i + 2 * h];
                float& b = s[4 * i + 2 * h + 1];
                a = exp2_approx(fmaf(a, scale_log2, -m_sub)), b = exp2_approx(fmaf(b, scale_log2, -m_sub));
                sum_even += a, sum_odd += b;
            }
            row_sum[h] = fmaf(row_sum[h], rescale[h], sum_even + sum_odd);
        }
    }
    // The output accumulator's rows (DIM / 2 registers, the same layout) times this tile's factors.
    template <int DIM>
    __device__ __forceinline__ void rescale_rows(float (&o)[DIM / 2]) const {
#pragma unroll
        for (int i = 0; i < DIM / 8; ++i) o[4 * i] *= rescale[0], o[4 * i + 1] *= rescale[0],
                                          o[4 * i + 2] *= rescale[1], o[4 * i + 3] *= rescale[1];
    }
    // After the last tile: row h's 1 / denominator, and its log-sum-exp in natural log,
    // ln(sum exp(s scale)) = (m + log2(l)) ln 2. Every row has seen a key (n_k >= 1; causal is top-left,
    // so key 0 is every row's), so l >= 1.
    __device__ __forceinline__ float2 finish(int h) const {
        const float l = quad_sum(row_sum[h]);
        return make_float2(1.0f / l, (row_max[h] + log2f(l)) * 0.69314718055994531f);
    }
};

// ---- the output ----

// A warpgroup's 64 x DIM output rows times each row's 1 / l, rounded to 16 bits, into a slab of a
// swizzled tile laid out as TMA's 128-byte swizzle expects: DIM / 64 chunks of 64 columns, CHUNK_STRIDE
// elements apart, each 64 rows of 128 bytes from `slab` (1024-aligned) whose 16-byte unit u of row r
// sits at unit u ^ (r % 8). stmatrix stores four 8 x 8 matrices a lane: (group j, rows 0-7 of the
// warp's 16), (j, rows 8-15), (j + 1, 0-7), (j + 1, 8-15); lane l gives the address of row l % 8 of
// matrix l / 8, and holds in register q matrix q's pair at row l / 4, columns 2(l % 4) + {0, 1}: the
// accumulator's own layout (registers 4j + 2h + e), so no shuffles.
template <int DIM, int CHUNK_STRIDE, int F16>
__device__ __forceinline__ void store_rows_swizzled(const float (&o)[DIM / 2], bf16_bits* slab, float inv0,
                                                    float inv1) {
    const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
    const int q = lane / 8, r = 16 * warp + lane % 8 + 8 * (q % 2);
#pragma unroll
    for (int j = 0; j < DIM / 8; j += 2) {
        const int jq = j + q / 2;  // this lane's address is for column group jq
        char* row = reinterpret_cast<char*>(slab + (jq / 8) * CHUNK_STRIDE) + r * 128 + ((jq % 8) ^ (r % 8)) * 16;
        stmatrix_x4(row, pack_pair<F16>(o[4 * j] * inv0, o[4 * j + 1] * inv0),
                    pack_pair<F16>(o[4 * j + 2] * inv1, o[4 * j + 3] * inv1),
                    pack_pair<F16>(o[4 * j + 4] * inv0, o[4 * j + 5] * inv0),
                    pack_pair<F16>(o[4 * j + 6] * inv1, o[4 * j + 7] * inv1));
    }
}

// ---- the key tiles of a query tile ----

// A query tile of rows [m0, m0 + block_m) sees key tiles 0 .. count - 1 (block_n keys each); tiles
// 0 .. unmasked - 1 are seen whole by every row of it (no key at or past n_k; causal: none after the
// tile's first row, m0) and need no mask. Causal is top-left aligned (row i sees keys 0..i, as SDPA's
// is_causal), so tiles starting past the last row, m0 + block_m - 1, are skipped: never loaded.
struct KeyTiles {
    int count, unmasked;
};
__host__ __device__ constexpr KeyTiles key_tiles(int m0, int block_m, int block_n, int n_k, bool causal) {
    const int seen = causal && m0 + block_m < n_k ? m0 + block_m : n_k;
    const int whole = causal && m0 + 1 < n_k ? m0 + 1 : n_k;
    return KeyTiles{(seen + block_n - 1) / block_n, whole / block_n};
}

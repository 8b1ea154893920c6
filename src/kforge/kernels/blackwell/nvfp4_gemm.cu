// NVFP4 GEMM (and batched GEMV) on Blackwell (sm_100a) with block-scaled tcgen05 MMA:
// C[l] = (dequant(A[l]) @ dequant(B[l])^T) for each batch l, fp32 accumulation, bf16 or fp16 out.
//
// NOT YET RUN ON A GPU: compiled by NVRTC and checked on its machine code only (docs/blackwell.md).
//
// The operands are kforge's NVFP4 (quant/formats.py): A [L * M, K/2] bytes of E2M1 codes, two a byte
// along K (k = 2j in byte j's low nibble), one E4M3 block scale per 16 k, one fp32 global scale per
// tensor; B the same with N rows a batch. The value of a code is e2m1 * block_scale * global_scale.
//
// The math. Blackwell multiplies E2M1 codes directly (kind::mxf4nvf4), each 16-long run of K scaled
// by its own E4M3 factor on both sides (.block16, "scale_vec::4X": 4 scales per row per MMA of K = 64):
//     D[m, n] += sum_k (a[m, k] sa[m, k/16]) (b[n, k] sb[n, k/16])
// Every product there is exact in fp32 (2 + 4 significant bits a side), so the only roundings are the
// fp32 sums, as in kforge's float64 reference. The two global scales, one scalar, multiply the
// finished accumulator in the epilogue: C = D * (a_gs * b_gs), rounded once.
//
// The hardware mapping, per CTA of 128 threads, one 128 x BN tile of C:
// - warp 0 (one elected lane), the producer: per K block of BK = 256 codes (128 bytes a row: one
//   128-byte swizzle row) TMA loads A's 128 x 128-byte box and B's BN x 128-byte box, and two 1-D bulk
//   copies bring the block's scale factors, 2048 bytes each for A and B, already in the layout the
//   tensor core wants (packed on the host by nvfp4_gemm.py: `pack_scale_factors`).
// - warp 1 allocates TMEM and one lane issues, per K block: 4 + 4 tcgen05.cp that copy the scale
//   factors from shared memory into TMEM, then the 4 MMAs of K = 64 (32 bytes into the swizzled rows
//   each), each naming its 4 TMEM columns of A's and of B's scales; then tcgen05.commit frees the slot.
// - all 4 warps, the epilogue: TMEM lanes = rows of C, tcgen05.ld 32 columns at a time, times the
//   global scales, rounded, stored.
//
// Scale factors in TMEM. The MMA reads A's scales for 128 rows x 4 k-blocks (one MMA's K = 64) from 4
// TMEM columns: row r's 4 scales are the 4 bytes of column (r / 32) at lane r % 32. `tcgen05.cp
// .32x128b.warpx4` fills exactly that from 512 contiguous bytes of shared memory (32 lines of 16
// bytes; line i holds rows i, i + 32, i + 64, i + 96, 4 bytes each) and copies it to all four lane
// quarters. Each ring slot has its own 32 TMEM columns of scale factors (16 for A, 16 for B), so a
// slot's columns are only rewritten after the commit that freed the slot, when its MMAs have finished.
//
// Shapes: any M; N a multiple of 8 (16-byte stores; N = 1 too, stored one value at a time: the
// batched GEMV of one B row a batch); K a multiple of 32 (16-byte TMA rows). TMA fills codes past
// the edges with zeros, and the packed scale factors are zero-padded to whole 128-row, 256-K tiles.
// BN < 128 (the GEMV's 16) needs N <= BN: the tile's B scale rows must start its 128-row SF tile.
#include "sm100.cuh"

#ifndef BN
#define BN 128  // columns of C a CTA computes: the MMA's N (16 for the GEMV, whose N is 1)
#endif
#ifndef STAGES
#define STAGES 4
#endif
#ifndef OUT_FP16
#define OUT_FP16 0  // 0: bf16 out (the GEMM), 1: fp16 (the GEMV's contract)
#endif
#define BM 128
#define BK 256  // codes a ring slot holds per row: 128 bytes
#define ROW_BYTES (BK / 2)
#define UMMA_K 64
#define THREADS 128
#define SF_CHUNK_BYTES 512                    // 128 rows x 4 scales: one MMA's scale factors
#define SF_TILE_BYTES (4 * SF_CHUNK_BYTES)     // a K block's: 128 rows x 16 scales
#define A_TILE_BYTES (BM * ROW_BYTES)
#define B_TILE_BYTES (BN * ROW_BYTES)
#define STAGE_BYTES (A_TILE_BYTES + B_TILE_BYTES + 2 * SF_TILE_BYTES)
#define SHARED_BYTES (STAGES * STAGE_BYTES + (2 * STAGES + 1) * 8 + 8 + 1024)
// TMEM: the accumulator (BN fp32 columns, at least one 32-column allocation unit), then 32 columns of
// scale factors per ring slot; allocated in a power of two
#define ACC_COLS (BN < 32 ? 32 : BN)
#define SF_COLS_PER_SLOT 32
#define TMEM_NEEDED (ACC_COLS + STAGES * SF_COLS_PER_SLOT)
#define TMEM_COLS (TMEM_NEEDED <= 64 ? 64 : TMEM_NEEDED <= 128 ? 128 : TMEM_NEEDED <= 256 ? 256 : 512)

static_assert(BN % 16 == 0 && BN >= 16 && BN <= 128, "the MMA's N (M = 128): a multiple of 16; one 128-row SF tile");
static_assert(TMEM_NEEDED <= 512, "TMEM has 512 columns");
static_assert(B_TILE_BYTES % 1024 == 0, "tiles on 1024-byte boundaries (the swizzle atom)");

// The block-scaled instruction descriptor: A and B E2M1 (bits 7-9 and 10-12 = 1), K-major, N >> 3 at
// bit 17, scales UE4M3 (bit 23 = 0), M >> 4 at bit 24, K = 64 (bit 31 = 0); the scale-factor ids
// (bits 4-5, 29-30), which byte of a scale word to use, are 0: block16 uses all four.
#define IDESC ((1u << 7) | (1u << 10) | ((u32)(BN >> 3) << 17) | ((u32)(BM >> 4) << 24))

// D[tmem] (+)= (A * SFA) x (B * SFB)^T for E2M1 A and B in shared memory, E4M3 scales in TMEM.
__device__ __forceinline__ void umma_nvfp4(u32 d_tmem, u64 a_desc, u64 b_desc, u32 sfa_tmem, u32 sfb_tmem,
                                           u32 accumulate) {
    asm volatile(
        "{\n.reg .pred acc;\n"
        "setp.ne.b32 acc, %4, 0;\n"
        "tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.block16 [%0], %1, %2, %3, [%5], [%6], acc;\n}" ::"r"(
            d_tmem),
        "l"(a_desc), "l"(b_desc), "r"(IDESC), "r"(accumulate), "r"(sfa_tmem), "r"(sfb_tmem)
        : "memory");
}

// 512 bytes of scale factors (32 lines of 16 bytes, no swizzle: 8-line groups 128 bytes apart) into
// 4 TMEM columns of all 128 lanes. Asynchronous, ordered before this thread's later MMAs.
__device__ __forceinline__ void sf_copy(u32 tmem, const void* chunk) {
    const u64 desc = umma_desc(smem_u32(chunk), 0, 128, UMMA_NO_SWIZZLE);
    asm volatile("tcgen05.cp.cta_group::1.32x128b.warpx4 [%0], %1;" ::"r"(tmem), "l"(desc) : "memory");
}

__device__ __forceinline__ u32 pack_out(float lo, float hi) {
#if OUT_FP16
    u32 packed;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(hi), "f"(lo));
    return packed;
#else
    return pack_bf16x2(lo, hi);
#endif
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
    nvfp4_gemm(const __grid_constant__ TensorMap a_map, const __grid_constant__ TensorMap b_map,
               const unsigned char* __restrict__ a_sf, const unsigned char* __restrict__ b_sf,
               const float* __restrict__ a_gs, const float* __restrict__ b_gs, unsigned short* __restrict__ c,
               int m, int n, int k) {
#if KFORGE_SM100
    check_launch(THREADS, SHARED_BYTES);
    if (BN < 128 && gridDim.y != 1) __trap();  // see the header: B's scale rows must start an SF tile
    extern __shared__ unsigned char raw_shared[];
    unsigned char* shared = raw_shared + ((1024 - (smem_u32(raw_shared) & 1023)) & 1023);
    unsigned char* a_tiles = shared;
    unsigned char* b_tiles = a_tiles + STAGES * A_TILE_BYTES;
    unsigned char* sf_tiles = b_tiles + STAGES * B_TILE_BYTES;  // per slot: A's 2048 bytes, then B's
    u64* full = reinterpret_cast<u64*>(sf_tiles + STAGES * 2 * SF_TILE_BYTES);
    u64* empty = full + STAGES;
    u64* done = empty + STAGES;
    u32* tmem_slot = reinterpret_cast<u32*>(done + 1);

    const u32 warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int batch = blockIdx.z;
    const int row0 = blockIdx.x * BM, col0 = blockIdx.y * BN;
    const int k_blocks = CEIL_DIV(k, BK);
    // the packed scale factors: [L][row tiles][K blocks][2048 bytes], A's and B's
    const long long a_sf_tile = (long long)(batch * CEIL_DIV(m, BM) + blockIdx.x) * k_blocks;
    const long long b_sf_tile = (long long)(batch * CEIL_DIV(n, 128) + col0 / 128) * k_blocks;
    const unsigned char* a_sf_tiles = a_sf + a_sf_tile * SF_TILE_BYTES;
    const unsigned char* b_sf_tiles = b_sf + b_sf_tile * SF_TILE_BYTES;

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], 1);
        }
        mbar_init(done, 1);
        fence_barrier_init();
    }
    if (warp == 1) tmem_alloc<1>(tmem_slot, TMEM_COLS);
    tcgen05_before_sync();
    __syncthreads();
    tcgen05_after_sync();
    const u32 accumulator = *tmem_slot;

    if (warp == 0) {
        for (int kb = 0; kb < k_blocks; ++kb) {
            const int s = kb % STAGES;
            mbar_wait(&empty[s], ((kb / STAGES) & 1) ^ 1);
            if (elect_one()) {
                unsigned char* sf = sf_tiles + s * 2 * SF_TILE_BYTES;
                mbar_arrive_expect_tx(&full[s], STAGE_BYTES);
                tma_load_2d(a_tiles + s * A_TILE_BYTES, a_map, &full[s], kb * ROW_BYTES, batch * m + row0);
                tma_load_2d(b_tiles + s * B_TILE_BYTES, b_map, &full[s], kb * ROW_BYTES, batch * n + col0);
                bulk_load_1d(sf, a_sf_tiles + (long long)kb * SF_TILE_BYTES, SF_TILE_BYTES, &full[s]);
                bulk_load_1d(sf + SF_TILE_BYTES, b_sf_tiles + (long long)kb * SF_TILE_BYTES, SF_TILE_BYTES, &full[s]);
            }
            __syncwarp();
        }
    } else if (warp == 1) {
        for (int kb = 0; kb < k_blocks; ++kb) {
            const int s = kb % STAGES;
            mbar_wait(&full[s], (kb / STAGES) & 1);
            tcgen05_after_sync();
            const unsigned char* a_tile = a_tiles + s * A_TILE_BYTES;
            const unsigned char* b_tile = b_tiles + s * B_TILE_BYTES;
            const unsigned char* sf = sf_tiles + s * 2 * SF_TILE_BYTES;
            const u32 sfa_tmem = accumulator + ACC_COLS + s * SF_COLS_PER_SLOT, sfb_tmem = sfa_tmem + 16;
            if (elect_one()) {
#pragma unroll
                for (int kk = 0; kk < BK / UMMA_K; ++kk) {
                    sf_copy(sfa_tmem + 4 * kk, sf + kk * SF_CHUNK_BYTES);
                    sf_copy(sfb_tmem + 4 * kk, sf + SF_TILE_BYTES + kk * SF_CHUNK_BYTES);
                }
#pragma unroll
                for (int kk = 0; kk < BK / UMMA_K; ++kk) {  // K step kk: 64 codes, 32 bytes into the rows
                    umma_nvfp4(accumulator, kmajor_sw128_desc(a_tile, kk * UMMA_K / 2),
                               kmajor_sw128_desc(b_tile, kk * UMMA_K / 2), sfa_tmem + 4 * kk, sfb_tmem + 4 * kk,
                               (kb | kk) != 0);
                }
                umma_commit(&empty[s]);
            }
            __syncwarp();
        }
        if (elect_one()) umma_commit(done);
    }
    __syncwarp();

    mbar_wait(done, 0);
    tcgen05_after_sync();
    const float scale = a_gs[0] * b_gs[0];
    const int row = row0 + warp * 32 + lane;
    unsigned short* c_row = c + ((long long)batch * m + row) * n;
#pragma unroll 1
    for (int chunk = 0; chunk < ACC_COLS / 32; ++chunk) {
        u32 v[32];
        tmem_load_32cols(accumulator + ((warp * 32) << 16) + chunk * 32, v);
        tmem_wait_loads();
        const int col = col0 + chunk * 32;
        if (row >= m) continue;
#pragma unroll
        for (int g = 0; g < 4; ++g) {
            const int first = col + 8 * g;
            if (first >= n) break;
            u32 packed[4];
#pragma unroll
            for (int p = 0; p < 4; ++p)
                packed[p] = pack_out(__uint_as_float(v[8 * g + 2 * p]) * scale,
                                     __uint_as_float(v[8 * g + 2 * p + 1]) * scale);
            if (n % 8 == 0) {
                stg_128(c_row + first, packed[0], packed[1], packed[2], packed[3]);
            } else {  // N = 1 (the GEMV) or ragged: one value at a time, inside N
                for (int j = 0; j < 8 && first + j < n; ++j)
                    c_row[first + j] = (unsigned short)(packed[j / 2] >> (16 * (j % 2)));
            }
        }
    }

    tcgen05_before_sync();
    __syncthreads();
    if (warp == 1) {
        tcgen05_after_sync();
        tmem_dealloc<1>(accumulator, TMEM_COLS);
    }
#else
    __trap();  // not an sm_100 target (see KFORGE_SM100)
#endif
}

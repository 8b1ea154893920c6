// bf16 GEMM on Blackwell (sm_100a): C [M, N] = A [M, K] @ B [N, K]^T, fp32 accumulation, bf16 out.
// A and B are both K-major (row-major A, a linear layer's weight B), as tcgen05 reads them fastest.
//
// NOT YET RUN ON A GPU: compiled by NVRTC and checked on its machine code only (docs/blackwell.md).
//
// The math. C = sum over K blocks kb of A[:, kb] @ B[:, kb]^T; each K block of BK = 64 is four MMAs
// of K = 16 (kind::f16's depth), each a 128 x BN (or 256 x BN for a CTA pair) outer-product step
// that the tensor core adds into the fp32 accumulator held in tensor memory.
//
// The hardware mapping, per CTA of 128 threads (4 warps):
// - warp 0, one thread: the TMA producer. For each K block it waits until the ring slot is free
//   (the `empty` barrier, armed by the MMA's commit), then loads A's 128 x 64 box and B's box into
//   the slot with the 128-byte swizzle; the slot's `full` barrier counts the bytes.
// - warp 1: allocates BN columns of TMEM (the accumulator: 128 lanes = rows, BN fp32 columns), and
//   one of its threads issues the MMAs: wait for `full`, four tcgen05.mma reading both tiles from
//   shared memory through descriptors, then tcgen05.commit on the slot's `empty` barrier, which
//   fires when those MMAs have read their operands. After the last K block, a commit on `done`.
// - all 4 warps, the epilogue: wait for `done`, each warp copies its 32 TMEM lanes (32 rows of C)
//   32 columns at a time into registers (tcgen05.ld), rounds to bf16, and stores 16 bytes at a time.
//   No shared memory and no cross-warp shuffles: TMEM lane = row, so each thread owns one row.
// The producer runs STAGES slots ahead of the MMA; nothing waits on the MMA but the ring.
//
// CTA_PAIR = 1 (compile-time): clusters of 2 CTAs run one MMA of M = 256 (cta_group::2). Each CTA
// loads its own 128 rows of A and HALF of B's BN rows; the leader (even CTA) issues every MMA, which
// reads both CTAs' shared memory and writes each CTA's 128 rows of C into that CTA's TMEM. Per CTA the
// ring then holds 128 x 64 of A and BN/2 x 64 of B a slot: half of B's traffic and shared memory for
// the same tile of C, the win of 2-CTA MMA. Protocol: both producers' TMA bytes land on the LEADER's
// `full` barrier (cta_group::2 loads); the peer producer arrives there remotely; the leader's commits
// multicast to the `empty` and `done` barriers of both CTAs.
//
// Shapes: any M; N and K multiples of 8 (16-byte TMA rows and 16-byte stores). TMA fills reads past
// M, N or K with zeros, so ragged edges need no masking in the main loop; the epilogue skips rows
// past M and 8-column groups past N.
#include "sm100.cuh"

#ifndef CTA_PAIR
#define CTA_PAIR 0
#endif
#ifndef BN
#define BN 256  // columns of C a CTA (pair) computes: the MMA's N, and the accumulator's TMEM columns
#endif
#ifndef STAGES
#define STAGES 4
#endif
#define BM 128  // rows of C a CTA computes (the MMA's M is 128, or 256 for a pair)
#define BK 64   // K a ring slot holds: one 128-byte swizzle row of bf16
#define UMMA_K 16
#define THREADS 128
#define PAIR_CTAS (CTA_PAIR ? 2 : 1)
#define B_ROWS (BN / PAIR_CTAS)  // rows of B this CTA loads
#define A_TILE_BYTES (BM * BK * 2)
#define B_TILE_BYTES (B_ROWS * BK * 2)
#define STAGE_BYTES (A_TILE_BYTES + B_TILE_BYTES)
// the ring, 2 barriers a slot, `done`, the TMEM address slot; 1024 bytes of alignment slack
#define SHARED_BYTES (STAGES * STAGE_BYTES + (2 * STAGES + 1) * 8 + 8 + 1024)

static_assert(BN % 32 == 0 && BN >= 32 && BN <= 256, "the MMA's N: a multiple of 32 (the epilogue's chunk), <= 256");
static_assert(B_ROWS % 8 == 0, "B's box: whole 8-row swizzle atoms");
static_assert((BN & (BN - 1)) == 0, "TMEM is allocated in powers of two columns");

// The instruction descriptor of kind::f16 (32 bits): D fp32 (bits 4-5 = 1), A and B bf16 (bits 7-9
// and 10-12 = 1), both K-major (bits 15, 16 = 0), N >> 3 at bit 17, M >> 4 at bit 24.
#define UMMA_M (BM * PAIR_CTAS)
#define IDESC ((1u << 4) | (1u << 7) | (1u << 10) | ((u32)(BN >> 3) << 17) | ((u32)(UMMA_M >> 4) << 24))

extern "C" __global__ void __launch_bounds__(THREADS, 1)
    tcgen05_gemm(const __grid_constant__ TensorMap a_map, const __grid_constant__ TensorMap b_map,
                 bf16_bits* __restrict__ c, int m, int n, int k) {
#if KFORGE_SM100
    check_launch(THREADS, SHARED_BYTES);
    extern __shared__ unsigned char raw_shared[];
    // TMA's 128-byte swizzle and the descriptors' base offset 0 need 1024-byte aligned tiles
    unsigned char* shared = raw_shared + ((1024 - (smem_u32(raw_shared) & 1023)) & 1023);
    bf16_bits* a_tiles = reinterpret_cast<bf16_bits*>(shared);
    bf16_bits* b_tiles = reinterpret_cast<bf16_bits*>(shared + STAGES * A_TILE_BYTES);
    u64* full = reinterpret_cast<u64*>(shared + STAGES * STAGE_BYTES);
    u64* empty = full + STAGES;
    u64* done = empty + STAGES;
    u32* tmem_slot = reinterpret_cast<u32*>(done + 1);

    const u32 warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const u32 rank = CTA_PAIR ? cluster_rank() : 0;
    const int row0 = blockIdx.x * BM;  // a pair's two CTAs are consecutive in x: rows 256 p + 128 rank
    const int col0 = blockIdx.y * BN;
    const int k_blocks = CEIL_DIV(k, BK);

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(&full[s], PAIR_CTAS);  // the producers' arrivals (a pair's both land on the leader's)
            mbar_init(&empty[s], 1);         // the MMA's commit
        }
        mbar_init(done, 1);
        fence_barrier_init();
    }
    if (warp == 1) tmem_alloc<PAIR_CTAS>(tmem_slot, BN);
    // the allocation's address and the barriers must be seen by all (for a pair: by the peer too,
    // whose TMA will arrive on our barriers)
    tcgen05_before_sync();
    if (CTA_PAIR) cluster_sync(); else __syncthreads();
    tcgen05_after_sync();
    const u32 accumulator = *tmem_slot;

    if (warp == 0) {
        // the producer: a slot is reused after the MMA's commit for its previous round has fired
        // (parity of round - 1; the first round's wait on parity 1 returns at once)
        const u32 leader_full = cluster_address(full, 0);
        for (int kb = 0; kb < k_blocks; ++kb) {
            const int s = kb % STAGES, round = kb / STAGES;
            mbar_wait(&empty[s], (round & 1) ^ 1);
            bf16_bits* a_dst = a_tiles + s * (BM * BK);
            bf16_bits* b_dst = b_tiles + s * (B_ROWS * BK);
            if (elect_one()) {
                if (CTA_PAIR) {
                    const u32 bar = leader_full + s * 8;
                    if (rank == 0) mbar_arrive_expect_tx_remote(bar, PAIR_CTAS * STAGE_BYTES);
                    tma_load_2d_pair(a_dst, a_map, bar, kb * BK, row0);
                    tma_load_2d_pair(b_dst, b_map, bar, kb * BK, col0 + rank * B_ROWS);
                    if (rank != 0) mbar_arrive_remote(bar);
                } else {
                    mbar_arrive_expect_tx(&full[s], STAGE_BYTES);
                    tma_load_2d(a_dst, a_map, &full[s], kb * BK, row0);
                    tma_load_2d(b_dst, b_map, &full[s], kb * BK, col0);
                }
            }
            __syncwarp();
        }
    } else if (warp == 1 && rank == 0) {
        // the MMA issuer (the leader's only, for a pair); a commit tracks the MMAs of the thread
        // that issued them, so one elected lane does both, every K block (elect.sync picks the
        // same lane of a converged warp each time)
        for (int kb = 0; kb < k_blocks; ++kb) {
            const int s = kb % STAGES;
            mbar_wait(&full[s], (kb / STAGES) & 1);
            tcgen05_after_sync();
            const bf16_bits* a_tile = a_tiles + s * (BM * BK);
            const bf16_bits* b_tile = b_tiles + s * (B_ROWS * BK);
            if (elect_one()) {
#pragma unroll
                for (int kk = 0; kk < BK / UMMA_K; ++kk) {
                    // K step kk starts kk * 32 bytes into the 128-byte rows
                    umma_bf16<PAIR_CTAS>(accumulator, kmajor_sw128_desc(a_tile, kk * UMMA_K * 2),
                                         kmajor_sw128_desc(b_tile, kk * UMMA_K * 2), IDESC, (kb | kk) != 0);
                }
                if (CTA_PAIR) umma_commit_pair(&empty[s], 0b11); else umma_commit(&empty[s]);
            }
            __syncwarp();
        }
        if (elect_one()) {
            if (CTA_PAIR) umma_commit_pair(done, 0b11); else umma_commit(done);
        }
    }
    __syncwarp();

    // the epilogue: one phase of `done`, then each thread its row
    mbar_wait(done, 0);
    tcgen05_after_sync();
    const int row = row0 + warp * 32 + lane;
    bf16_bits* c_row = c + (long long)row * n;
#pragma unroll 1
    for (int chunk = 0; chunk < BN / 32; ++chunk) {
        u32 v[32];
        tmem_load_32cols(accumulator + ((warp * 32) << 16) + chunk * 32, v);  // every lane, also rows past M
        tmem_wait_loads();
        const int col = col0 + chunk * 32;
        if (row >= m) continue;
#pragma unroll
        for (int g = 0; g < 4; ++g) {  // 8 columns (16 bytes) at a time; N is a multiple of 8
            if (col + 8 * g + 8 > n) break;
            const u32* x = v + 8 * g;
            stg_128(c_row + col + 8 * g, pack_bits(x[0], x[1]), pack_bits(x[2], x[3]), pack_bits(x[4], x[5]),
                    pack_bits(x[6], x[7]));
        }
    }

    // TMEM is freed by the warp that allocated it, once no one reads it; a pair frees together
    tcgen05_before_sync();
    if (CTA_PAIR) cluster_sync(); else __syncthreads();
    if (warp == 1) {
        tcgen05_after_sync();
        tmem_dealloc<PAIR_CTAS>(accumulator, BN);
    }
#else
    __trap();  // not an sm_100 target (see KFORGE_SM100)
#endif
}

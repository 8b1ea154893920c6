// FlashAttention forward for Hopper in CUDA, built from kforge's Hopper parts (../hopper/: the TMA +
// mbarrier stage ring, wgmma descriptors, stmatrix) and the attention parts beside it
// (hopper_attention.cuh: 4-D TMA, the two wgmma products, the online softmax, the causal tile range).
// What it computes: O = softmax(Q K^T scale) V and each row's log-sum-exp (natural log, fp32), for
// bf16 or fp16 (FP16 1) Q (batch, heads, n_q, d) and K, V (batch, kv_heads, n_k, d), kv_heads dividing
// heads (grouped-query: the K/V head is head / group, nothing copied); head dims 64 and 128; causal
// (CAUSAL 1, top-left as SDPA's is_causal) or not; any n_q and n_k >= 1 (the wrapper,
// flash_hopper.py, checks the rest). The same contract as the Triton forward (flash_forward.py).
//
// Tiling: one CTA per (128 query rows, head, batch), three warpgroups. Warpgroup 0 is the producer
// (24 registers a thread): one thread loads the Q tile once, then every key tile's K and V through two
// rings (STAGES K stages, V_STAGES V stages), so S = Q K^T of a tile can start before its V has
// landed. Warpgroups 1 and 2 are consumers (240 registers a thread), 64 query rows each, both walking
// the same key tiles. Causal tiles wholly above the diagonal are never loaded (key_tiles); the walk
// goes from the last key tile down, so the tiles that need a mask (the diagonal, the n_k tail) come
// first and the rest run a loop with none. Causal CTAs start with the query tiles that see the most
// keys (blockIdx.x reversed), so the short ones fill the last wave. Why not persistent: at ~193 KB of
// shared memory (hd 128) a CTA holds an SM alone either way; persistence would hide the epilogue and
// the Q load, a later step.
//
// A consumer's k-th key tile, from the second on (FlashAttention-3's schedule, our code):
//   wait for P_{k-2} V_{k-2} and free its V stage; round P_{k-1} to 16 bits, the P V's register operand;
//   (its turn) issue S = Q K_k^T; rescale O by tile k-1's factors; issue O += P_{k-1} V_{k-1};
//   (pass the turn) wait for S only and free K_k; the softmax of S into P_k (exp2, row max and sums)
//   while P_{k-1} V_{k-1} runs on the tensor cores.
// Across the two consumers a pair of named barriers makes them take turns issuing (ping-pong), so one's
// softmax runs under the other's products too. Scores stay in registers (fp32, 64 a thread); P goes
// to wgmma as its register A operand with no trip through shared memory (scores_to_operand: the same
// layout); the scale and log2(e) are one factor (one FFMA and one MUFU.EX2 a score). Waiting for the
// P V a tile late is what keeps the softmax under it: waited for at the end of its own tile, ptxas
// hoisted the wait above the exp2s. So a V stage is held a tile longer than a K stage (V_STAGES =
// STAGES + 1). The epilogue divides by the row sums, writes each warpgroup's 64 rows over its own rows
// of the Q tile (read no more), swizzled with stmatrix, and TMA stores them (rows past n_q clipped);
// the LSE goes straight to global memory.
//
// Not yet (issue 35): the persistent tile scheduler and epilogue overlap, head dim 256, varlen
// (cu_seqlens) and paged K/V, FP8, the backward, clusters (K/V multicast across query tiles of a head).
// Measured (H200, 2026-11-29, B 8, H 16, N 4096, hd 128, bf16; benchmarks/results/nvidia-h200/
// bench-attention-hopper.txt): 660 TFLOP/s non-causal, 614 causal: 0.965x and 1.017x cuDNN in the same
// run, 1.83-1.88x SDPA's flash backend, 1.34-1.40x our Triton forward. FlashAttention-3 adds persistence
// and the epilogue overlap to this structure (its paper: ~640 TFLOP/s on an H100 at these shapes).
#include "hopper_attention.cuh"
#include "../hopper/pipeline.cuh"
#include "../hopper/tma.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef CAUSAL
#define CAUSAL 0
#endif
#ifndef FP16
#define FP16 0  // 1: fp16 inputs and output; 0: bf16
#endif
#ifndef STAGES
#define STAGES 2  // K stages
#endif
#ifndef V_STAGES
#define V_STAGES (STAGES + 1)  // a V stage is held a tile longer than a K stage: its P V is retired in the next turn
#endif

#define BLOCK_M 128  // query rows a CTA: 64 per consumer warpgroup
#define BLOCK_N 128  // keys a tile
#define CONSUMERS 2
#define NUM_THREADS (128 * (CONSUMERS + 1))
#define CHUNKS (HEAD_DIM / 64)  // 64-column (128-byte) boxes across a row of the head dim
#define Q_TILE (BLOCK_M * HEAD_DIM)  // elements
#define KV_TILE (BLOCK_N * HEAD_DIM)
#define SHARED_BYTES (2 * (Q_TILE + (STAGES + V_STAGES) * KV_TILE) + 1024 + 8 * (1 + 2 * (STAGES + V_STAGES)))
#define TURN_BARRIER 1  // named barriers 1, 2: consumer c may issue its products (0 is __syncthreads)
#define EPILOGUE_BARRIER 3  // named barriers 3, 4: consumer c's output rows are in shared memory
#define PRODUCER_REGISTERS 24
#define CONSUMER_REGISTERS 240
static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "head dims 64 and 128 (256: not yet)");
static_assert(SHARED_BYTES <= 227 * 1024, "fits one block's shared memory");
static_assert((PRODUCER_REGISTERS + CONSUMERS * CONSUMER_REGISTERS) * 128 <= 65536, "the register file");
// Descriptor steps (16-byte units): the k16 slices of a 64-column chunk are 32 bytes apart, chunks a
// Q or K tile's rows x 128 bytes; V's 16-key slices are 16 rows of 128 bytes apart.
#define STEP_IN_CHUNK (32 / 16)
#define Q_CHUNK_STEP (BLOCK_M * 128 / 16)
#define KV_CHUNK_STEP (BLOCK_N * 128 / 16)
#define KV_STAGE_STEP (KV_TILE * 2 / 16)
#define V_SLICE_STEP (16 * 128 / 16)

template <bool MASKED> struct Masking { static constexpr bool value = MASKED; };  // a loop's softmax, as a type

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
flash_forward(const __grid_constant__ TensorMap q_map, const __grid_constant__ TensorMap k_map,
              const __grid_constant__ TensorMap v_map, const __grid_constant__ TensorMap o_map,
              float* __restrict__ lse, int n_q, int n_k, int heads, int kv_group, float scale_log2) {
    check_launch(NUM_THREADS, SHARED_BYTES);
    extern __shared__ __align__(16) unsigned char smem_raw[];  // aligned to 1024 by hand (the swizzle atom)
    bf16_bits* q_tile = reinterpret_cast<bf16_bits*>((reinterpret_cast<size_t>(smem_raw) + 1023) & ~size_t(1023));
    bf16_bits* k_tiles = q_tile + Q_TILE;
    bf16_bits* v_tiles = k_tiles + STAGES * KV_TILE;
    u64* q_full = reinterpret_cast<u64*>(v_tiles + V_STAGES * KV_TILE);
    const StageRing<STAGES> k_ring(q_full + 1);
    const StageRing<V_STAGES> v_ring(q_full + 1 + 2 * STAGES);

    const int m_block = CAUSAL ? gridDim.x - 1 - blockIdx.x : blockIdx.x;  // causal: the longest rows first
    const int m0 = m_block * BLOCK_M, head = blockIdx.y, batch = blockIdx.z, kv_head = head / kv_group;
    const KeyTiles tiles = key_tiles(m0, BLOCK_M, BLOCK_N, n_k, CAUSAL);
    const int wg = threadIdx.x / 128, lane = threadIdx.x % 32;

    if (threadIdx.x == 0) {
        mbar_init(q_full, 1);
        k_ring.init(1, CONSUMERS * 4);  // the producer's arrive (+ the bytes); every consumer warp's release
        v_ring.init(1, CONSUMERS * 4);
        fence_barrier_init();
    }
    __syncthreads();

    if (wg == 0) {  // producer: Q, then K_0, K_1, V_0, K_2, V_1, ..., V_last: the order the consumers read them
        setmaxnreg_dec<PRODUCER_REGISTERS>();
        if (threadIdx.x == 0) {
            mbar_arrive_expect_tx(q_full, Q_TILE * 2);
            for (int c = 0; c < CHUNKS; ++c)
                tma_load_4d(q_tile + c * BLOCK_M * 64, q_map, q_full, 64 * c, m0, head, batch);
            // the k-th tile walked is key tile count - 1 - k; position k in either ring
            auto load = [&](const auto& ring, bf16_bits* stages, const TensorMap& map, int k) {
                const int s = ring.acquire(k);
                ring.expect(s, KV_TILE * 2);
                for (int c = 0; c < CHUNKS; ++c)
                    tma_load_4d(stages + s * KV_TILE + c * BLOCK_N * 64, map, ring.full_bar(s), 64 * c,
                                (tiles.count - 1 - k) * BLOCK_N, kv_head, batch);
            };
            for (int k = 0; k < tiles.count; ++k) {
                load(k_ring, k_tiles, k_map, k);
                if (k > 0) load(v_ring, v_tiles, v_map, k - 1);
            }
            load(v_ring, v_tiles, v_map, tiles.count - 1);
        }
        return;
    }

    // consumers
    setmaxnreg_inc<CONSUMER_REGISTERS>();
    const int consumer = wg - 1, thread = threadIdx.x % 128;
    const int row = m0 + 64 * consumer + 16 * (thread / 32) + lane / 4;  // this thread's rows: row, row + 8
    const int limit0 = CAUSAL ? min(n_k, row + 1) : n_k, limit1 = CAUSAL ? min(n_k, row + 9) : n_k;
    // Descriptors of stage 0 and this warpgroup's 64 Q rows; the loop only adds constant offsets.
    const u64 q_desc = kmajor_desc(q_tile + consumer * 64 * 64, 0), k_desc = kmajor_desc(k_tiles, 0);
    const u64 v_desc = smem_desc(v_tiles, BLOCK_N * 128, 1024);  // LBO: the 64-column chunks of an N-major tile
    RingCursor<STAGES> k_at;
    RingCursor<V_STAGES> v_at, v_held;  // the V tile next multiplied; the one whose P V may still run
    OnlineSoftmax<BLOCK_N> softmax;
    float s[BLOCK_N / 2], o[HEAD_DIM / 2];  // scores (then P in fp32) and the output, wgmma's layout
    u32 p[BLOCK_N / 4];  // P in 16 bits: the P V's register operand
#pragma unroll
    for (int i = 0; i < HEAD_DIM / 2; ++i) o[i] = 0.0f;  // (the first rescale multiplies it by 0)

    // The ping-pong: consumer c issues its products only between a wait on barrier TURN + c and an arrive
    // on the other's, so the two take strict turns (0, 1, 0, 1, ...), each turn one consumer's products
    // of one tile. Consumer 1 arrives once first, giving consumer 0 the first turn; both take count + 1
    // turns, so consumer 1 skips its last arrive (no one waits for it) and every barrier generation pairs
    // one consumer's 128 waiting threads with the other's 128 arriving ones.
    auto begin_turn = [&]() { named_barrier(TURN_BARRIER + consumer, 256); };
    auto end_turn = [&](bool last) {
        if (!(last && consumer == 1)) named_barrier_arrive(TURN_BARRIER + 1 - consumer, 256);
    };
    auto issue_qk = [&]() {
        const u64 k_stage = k_desc + k_at.stage * KV_STAGE_STEP;
#pragma unroll
        for (int ks = 0; ks < HEAD_DIM / 16; ++ks)
            wgmma_qk<FP16>(s, q_desc + (ks / 4) * Q_CHUNK_STEP + (ks % 4) * STEP_IN_CHUNK,
                           k_stage + (ks / 4) * KV_CHUNK_STEP + (ks % 4) * STEP_IN_CHUNK, ks > 0);
    };
    auto issue_pv = [&]() {
        const u64 v_stage = v_desc + v_at.stage * KV_STAGE_STEP;
#pragma unroll
        for (int ks = 0; ks < BLOCK_N / 16; ++ks) {
            const u32 a[4] = {p[4 * ks], p[4 * ks + 1], p[4 * ks + 2], p[4 * ks + 3]};
            wgmma_pv<HEAD_DIM, FP16>(o, a, v_stage + ks * V_SLICE_STEP, 1);
        }
    };
    // Before a turn that multiplies P_{k-1} V_{k-1}: the P V before it, P_{k-2} V_{k-2}, is waited for
    // here, not at the end of the tile before, where it would sit right after the softmax's exp2s:
    // ptxas moved such a wait up above them (it treats a wait as free to hoist), so the softmax ran after
    // the P V instead of under it. Here the ring's spin loops stand between the two (a branch, which ptxas
    // does not schedule across). Then V_{k-2}'s stage and the p registers are free: P_{k-1} into them.
    auto retire_pv = [&](bool held) {
        wgmma_wait<0>();
        pin(o), pin(p);
        if (held) v_ring.release(v_held.stage, lane), v_held.advance();
        scores_to_operand<BLOCK_N, FP16>(s, p);
        pin(p);
    };
    // O, whose last P V is done, times the factors of the last softmax, before P V adds to it.
    auto rescale_output = [&]() {
        softmax.rescale_rows<HEAD_DIM>(o);
        pin(o);
        wgmma_fence();  // (o was written since the last wgmma)
    };

    if (consumer == 1) named_barrier_arrive(TURN_BARRIER, 256);
    mbar_wait(q_full, 0);

    // The first key tile walked (the last one: masked if any tile is): S, then its softmax.
    k_ring.wait(k_at.stage, k_at.phase);
    begin_turn();
    wgmma_fence();
    issue_qk();
    wgmma_commit();
    end_turn(false);
    wgmma_wait<0>();
    pin(s);
    k_ring.release(k_at.stage, lane), k_at.advance();
    softmax.tile<true>(s, scale_log2, (tiles.count - 1) * BLOCK_N, limit0, limit1);
    pin(s);

    // Tile k's S and tile k - 1's P V in one turn, then tile k's softmax while that P V runs.
    auto step = [&](int k, auto masked) {
        k_ring.wait(k_at.stage, k_at.phase);
        v_ring.wait(v_at.stage, v_at.phase);
        retire_pv(k > 1);
        begin_turn();
        wgmma_fence();  // (s and p were written since the last wgmma)
        issue_qk();
        wgmma_commit();
        rescale_output();  // under S's wgmmas
        issue_pv();
        wgmma_commit();
        end_turn(false);
        v_at.advance();
        wgmma_wait<1>();  // S has landed; the P V runs on
        pin(s);
        k_ring.release(k_at.stage, lane), k_at.advance();
        softmax.tile<decltype(masked)::value>(s, scale_log2, (tiles.count - 1 - k) * BLOCK_N, limit0, limit1);
        pin(s), pin(softmax.row_sum);  // (computed here, not sunk below the next tile's wait)
    };
    const int masked_tiles = tiles.count - tiles.unmasked;  // walked first
    int k = 1;
    for (; k < masked_tiles; ++k) step(k, Masking<true>{});
    for (; k < tiles.count; ++k) step(k, Masking<false>{});

    // The last P V.
    v_ring.wait(v_at.stage, v_at.phase);
    retire_pv(tiles.count > 1);
    rescale_output();
    begin_turn();
    issue_pv();
    wgmma_commit();
    end_turn(true);
    wgmma_wait<0>();
    pin(o);
    v_ring.release(v_held.stage, lane);

    // Epilogue: O / l rounded into this warpgroup's own rows of the Q tile, out by TMA; the LSE by the
    // quad's first lane.
    const float2 row0 = softmax.finish(0), row1 = softmax.finish(1);  // (1 / l, lse) of row and row + 8
    bf16_bits* slab = q_tile + consumer * 64 * 64;
    store_rows_swizzled<HEAD_DIM, BLOCK_M * 64, FP16>(o, slab, row0.x, row1.x);
    fence_proxy_async();
    named_barrier(EPILOGUE_BARRIER + consumer, 128);
    if (thread == 0) {
        for (int c = 0; c < CHUNKS; ++c)
            tma_store_4d(o_map, slab + c * BLOCK_M * 64, 64 * c, m0 + 64 * consumer, head, batch);
        bulk_commit();
    }
    if (lane % 4 == 0) {
        float* lse_rows = lse + size_t(batch * heads + head) * n_q;
        if (row < n_q) lse_rows[row] = row0.y;
        if (row + 8 < n_q) lse_rows[row + 8] = row1.y;
    }
    if (thread == 0) bulk_wait_read();  // the CTA's shared memory must outlive the stores' reads
}

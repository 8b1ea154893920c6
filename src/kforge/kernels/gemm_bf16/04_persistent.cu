// Rung 4: a persistent kernel with a tile scheduler, and the epilogue through shared
// memory and a TMA store.
// What changed: one CTA per SM for the whole GEMM (grid = SMs), each walking the output
// tiles job = blockIdx.x, + gridDim.x, ... in grouped order (GROUP_M rows of tiles at a
// time, so the tiles in flight share panels of A and B in L2). The producer runs ahead
// into the next tile while the consumers finish this one: the ring's stage and phase
// counters carry on across tiles, so there is no prologue bubble per tile. Results go
// registers -> swizzled shared memory (conflict-free) -> one bulk tensor store per
// 64 x 64 box, in EPI_COLS-wide slices through small buffers (room for a 4th stage); the
// buffer turn is counted across tiles, so a 192-wide tile's 3 slices never reuse a buffer
// whose store is still reading it.
// The epilogue overlaps the next tile (EPI_OVERLAP): a tile's results wait as 64 bf16-pair
// registers, the next tile's wgmmas start, and one 64-column slice is stored under every
// EPI_SPREAD-th (2nd) of its k-tiles. Why: the k-loop runs at the tensor cores' peak (64
// k-tiles in 1.00x their 65.5K-cycle minimum, scripts/gemm_timeline.py on a TIMELINE build),
// and stores after it left the tensor cores idle for ~2.1K cycles a tile (3% of the kernel);
// a slice under every k-tile slowed the k-loop 1-2%, every 2nd keeps it at 1.00x. The k-loop
// builds no descriptors: stage 0's are offset by a constant per stage and k-slice.
// Also here, compiled out at CLUSTER_M 1: rung 5's thread-block clusters (see 05_clusters.cu).
// SPLIT_K 1 (with BN 128: its registers do not fit beside a 128 x 256 tile's accumulators),
// for shapes with fewer tiles than SMs: with `splits` > 1 a job is one K range of one tile.
// Each split leaves its fp32 partial in a global workspace (only rows inside C), counts itself
// in on a per-tile counter, and the last to arrive adds the partials in split order (the same
// sum whoever is last), resets the counter and stores the tile. No split ever waits.
// NORM_A 1 computes rmsnorm(A; gamma, eps) B without the normed rows ever existing: each consumer
// loads its 64 A rows of a k-tile from shared memory into registers (ldmatrix: wgmma's register
// fragment), multiplies them by gamma there, adds up the squares of x per row, and gives wgmma A
// from registers; at the tile's end each row's 1/rms scales its accumulator row. The next k-tile's
// fragments are prepared into a second register set while this k-tile's wgmmas run; each stage
// brings its k-tile of gamma beside A and B (read with ld.shared), and the squares are added
// after the k-tile's wgmmas are issued. At M 4096, N 6144, K 4096 this runs in 277 us against
// the compiled norm + cuBLAS pair's 282 and this rung without the norm at 258.
// A fused epilogue (EPI_BIAS, EPI_ACT, EPI_RESIDUAL) applies a bias, an activation and a
// residual add to the fp32 accumulator slice by slice, just before it is rounded: what eager
// PyTorch does in further passes over C costs here ALU time and the residual's read.
// WG_ROWS 128 (with BM 256, BN 128) gives each consumer a 128 x 128 slab as two 64 x 128
// accumulators: cuBLAS's tile shape at 4096^3. It measures the same as 128 x 256, so it is a
// sweep variant only.
// STREAM_K 1 shares the last, partial wave out evenly: every CTA takes an equal run of the
// remaining tiles' k-tiles, leaves an fp32 partial for each tile it did not finish alone, and
// the last CTA to finish a tile adds them in CTA order and stores it. It wins at 8192^3 but
// loses at 4096^3 (the runs start at staggered k offsets, so CTAs sharing a panel stop reading
// it together and the tail streams from HBM): a sweep variant; `best_kernel` does not pick it.
// Why this rung: rung 3 paid a launch-sized pipeline fill and a global-store epilogue per tile,
// and its last wave left most SMs idle.
// Predicted: parity with cuBLAS at 4096^3 and above.
// Measured (H100, kforge ladder; records in benchmarks/results/nvidia-h100-80gb-hbm3/
// ladder-gemm-bf16-*.jsonl): 1.007x cuBLAS at 4096^3, 1.019x at 8192^3. History and the
// variants that lost: docs/worklogs/gemm-bf16.md.
#include "hopper.cuh"

#ifndef BM
#define BM 128  // 64 rows per consumer warpgroup
#endif
#ifndef BN
#define BN 256
#endif
#ifndef BK
#define BK 64
#endif
#ifndef STAGES
#define STAGES 4
#endif
#ifndef EPI_COLS
#define EPI_COLS 64  // the epilogue stores the tile in slices this wide (less shared memory, more stages)
#endif
#ifndef EPI_BUFFERS
#define EPI_BUFFERS 2  // epilogue slice buffers per consumer: 2 lets one slice fill while the last is stored
#endif
#ifndef GROUP_M
#define GROUP_M 8
#endif
#ifndef CLUSTER_M
#define CLUSTER_M 1  // CTAs per cluster, on consecutive row tiles sharing one column of B
#endif
#ifndef SPLIT_K
#define SPLIT_K 0  // 1: compile the split-K path in (see above); 0: `split_count` is ignored
#endif
#ifndef STREAM_K
#define STREAM_K 0  // 1: the last, partial wave of tiles shared out evenly by k-tile (stream-K, see below)
#endif
#ifndef STREAM_K_MIN
#define STREAM_K_MIN 8  // k-tiles a CTA's share must reach, else the partial wave runs as whole tiles
#endif
#ifndef B_KMAJOR
#define B_KMAJOR 0  // 1: B is given as N x K (C = A @ B^T); 0: B is K x N
#endif
#ifndef EPI_BIAS
#define EPI_BIAS 0  // 1: C = act(A B + bias), a bf16 bias per column, added in fp32 before the rounding
#endif
#ifndef EPI_ACT
#define EPI_ACT 0  // the activation after the bias: 0 none, 1 GELU (erf), 2 GELU (tanh), 3 SiLU
#endif
#ifndef EPI_RESIDUAL
#define EPI_RESIDUAL 0  // 1: then + residual, a bf16 M x N tensor (a transformer's residual stream)
#endif
#ifndef NORM_A
#define NORM_A 0  // 1: C = rmsnorm(A; gamma, eps) B, A normalized on its way from shared memory to wgmma (above)
#endif

#ifndef TIMELINE
#define TIMELINE 0  // 1: a diagnostic build that writes per-CTA clock readings into `partials` (scripts/gemm_timeline.py)
#endif

#ifndef WG_ROWS
#define WG_ROWS 64  // rows a consumer warpgroup owns: 64 (one m64 wgmma a k-step) or 128 (two: 256 x 128 tiles)
#endif
#ifndef EPI_OVERLAP  // 1: a tile's results wait as bf16 pairs in registers, stored under the next tile's k-loop
// (not with a residual, erf-GELU or the norm: beside 128 accumulators and 64 held pairs, they spilled)
#define EPI_OVERLAP (!SPLIT_K && !STREAM_K && WG_ROWS == 64 && !EPI_RESIDUAL && EPI_ACT != 1 && !NORM_A)
#endif
#ifndef EPI_SPREAD
#define EPI_SPREAD 2  // with EPI_OVERLAP: k-tiles per slice stored (2: a slice under every other k-tile)
#endif
#define CONSUMERS (BM / WG_ROWS)
#define NUM_THREADS (128 * (CONSUMERS + 1))
#define A_TILE (BM * BK)
#define B_TILE (BN * BK)
#define C_TILE (64 * EPI_COLS * EPI_BUFFERS)  // one consumer's epilogue buffers: slices of its 64 x BN share
#define STAGE_BYTES ((A_TILE + B_TILE) * 2)
#define GAMMA_BYTES (NORM_A ? STAGES * BK * 2 : 0)  // NORM_A: each stage's k-tile of gamma beside its A and B
#define SHARED_BYTES (STAGES * STAGE_BYTES + CONSUMERS * C_TILE * 2 + 1024 + 2 * STAGES * 8 + GAMMA_BYTES)
#define B_CHUNKS (BN / 64)  // 64-column boxes of an N-major B tile
static_assert(BK == 64, "the swizzle atom is one 64-value row");
static_assert(SHARED_BYTES <= 227 * 1024, "fits one block's shared memory");
static_assert(CONSUMERS == 2, "the register split below is for one producer and two consumers");
static_assert(WG_ROWS == 64 || (WG_ROWS == 128 && BN == 128 && !SPLIT_K),
              "128 rows a warpgroup: two 64 x 128 accumulators, the registers of one 64 x 256");
static_assert(BN % EPI_COLS == 0 && EPI_COLS % 64 == 0, "the epilogue slices the tile into 64-column boxes");
static_assert(EPI_BUFFERS == 1 || EPI_BUFFERS == 2, "one epilogue buffer, or two in turn");
static_assert(B_CHUNKS % CLUSTER_M == 0, "each CTA of a cluster loads an equal share of B");
static_assert(!STREAM_K || (CLUSTER_M == 1 && !SPLIT_K && WG_ROWS == 64), "stream-K: one CTA a tile, 64-row slabs");
static_assert(!TIMELINE || (!STREAM_K && !SPLIT_K), "the timeline takes the partials' workspace");
static_assert(!NORM_A || (!SPLIT_K && !STREAM_K && WG_ROWS == 64 && (BN == 256 || BN == 192) && BK == 64),
              "the norm's statistic needs whole rows of K; its A fragments are 64 x 16 slices of 64-wide k-tiles");
static_assert(!NORM_A || !(EPI_BIAS || EPI_ACT || EPI_RESIDUAL), "the norm with a fused epilogue spilled: not built");
static_assert(!EPI_OVERLAP || (!STREAM_K && !SPLIT_K && WG_ROWS == 64), "the overlapped epilogue: whole tiles, one slab");
#define EPI_SLICES (BN / EPI_COLS)

// TIMELINE 1: each CTA writes TIMELINE_SLOTS u64 into `partials`: its SM, %globaltimer and clock64
// at entry and exit, then per job (up to TIMELINE_JOBS) the clock when the producer issued the job's
// first load, when consumer 0 found that k-tile landed, when its last wgmma finished, and when its
// epilogue had issued the last store. Enough to split a tile's time into wait, k-loop and epilogue.
#define TIMELINE_JOBS 16
#define TIMELINE_SLOTS (8 + 4 * TIMELINE_JOBS)
__device__ __forceinline__ u64 global_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ void timeline_mark(u64* slot, bool when) {
    if (TIMELINE && when) *slot = clock64();
}

// This CTA's jobs in order, each one tile (one a CTA of a cluster: CLUSTER_M row tiles, one column)
// and a range [k0, k1) of its k-tiles. Plain: tiles blockIdx.x, + gridDim.x, ... whole. Split-K: every
// tile `splits` times, one K range each. Stream-K: whole tiles while every CTA has one (the full
// waves); the remaining tiles' k-tiles, taken in order, are cut into gridDim.x equal shares, so no
// CTA idles through a partial last wave. A share is shorter than a tile, so it covers the end of
// one tile and the start of the next at most.
// (Job, one tile and a range of its k-tiles: ../hopper/scheduler.cuh)
struct Jobs {
    int k_tiles, splits, next_job, end_job, whole_tiles;
    long long shared_next, shared_end;
    __device__ Jobs(int tiles, int k_tiles_, int splits_) : k_tiles(k_tiles_), splits(splits_) {
        const int ctas = gridDim.x / CLUSTER_M, rest = tiles % ctas;
        whole_tiles = STREAM_K && (long long)rest * k_tiles >= (long long)ctas * STREAM_K_MIN ? tiles - rest : tiles;
        next_job = blockIdx.x / CLUSTER_M, end_job = whole_tiles * splits;
        shared_next = share_start(blockIdx.x, tiles), shared_end = share_start(blockIdx.x + 1, tiles);
    }
    __device__ long long share_start(int cta, int tiles) const {  // the first shared k-tile of a CTA's share
        return STREAM_K ? (long long)(tiles - whole_tiles) * k_tiles * cta / gridDim.x : 0;
    }
    __device__ bool next(Job& job) {
        if (next_job < end_job) {
            job.tile = next_job / splits, job.split = next_job % splits;
            job.k0 = job.split * k_tiles / splits, job.k1 = (job.split + 1) * k_tiles / splits;
            next_job += gridDim.x / CLUSTER_M;
            return true;
        }
        if (!STREAM_K || shared_next >= shared_end) return false;
        job.tile = whole_tiles + int(shared_next / k_tiles), job.split = 0;
        job.k0 = int(shared_next % k_tiles), job.k1 = int(min((long long)k_tiles, job.k0 + shared_end - shared_next));
        shared_next += job.k1 - job.k0;
        return true;
    }
};

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
gemm(const __grid_constant__ TensorMap a_map, const __grid_constant__ TensorMap b_map,
     const __grid_constant__ TensorMap c_map, int M, int N, int K, int split_count, float4* __restrict__ partials,
     int* __restrict__ arrivals, const bf16_bits* __restrict__ bias, const bf16_bits* __restrict__ residual,
     const bf16_bits* __restrict__ norm_gamma, float norm_eps) {
    const int splits = SPLIT_K ? split_count : 1;
    check_launch(NUM_THREADS, SHARED_BYTES);
    extern __shared__ __align__(16) unsigned char smem_raw[];  // aligned to 1024 by hand below
#if SPLIT_K
    __shared__ int last_split[CONSUMERS];  // whether this warpgroup's split arrived last
#endif
#if STREAM_K
    __shared__ int last_share[CONSUMERS];  // whether this warpgroup's share of a tile arrived last
#endif
    bf16_bits* tiles = reinterpret_cast<bf16_bits*>((reinterpret_cast<size_t>(smem_raw) + 1023) & ~size_t(1023));
    bf16_bits* c_tiles = tiles + STAGES * (A_TILE + B_TILE);
    u64* full = reinterpret_cast<u64*>(c_tiles + CONSUMERS * C_TILE);
    u64* empty = full + STAGES;
    bf16_bits* gamma_ring = reinterpret_cast<bf16_bits*>(empty + STAGES);  // NORM_A: BK values a stage
    auto a_tile = [&](int s) { return tiles + s * (A_TILE + B_TILE); };
    auto b_tile = [&](int s) { return tiles + s * (A_TILE + B_TILE) + A_TILE; };

    const int tiles_m = CEIL_DIV(M, BM), tiles_n = CEIL_DIV(N, BN), k_tiles = CEIL_DIV(K, BK);
    const int job_tiles = CEIL_DIV(tiles_m, CLUSTER_M) * tiles_n;
    const u32 rank = CLUSTER_M > 1 ? cluster_rank() : 0;
    const int wg = threadIdx.x / 128, lane = threadIdx.x % 32;
    u64* timeline = reinterpret_cast<u64*>(partials) + size_t(blockIdx.x) * TIMELINE_SLOTS;
    if (TIMELINE && threadIdx.x == 0) {
        u32 sm;
        asm("mov.u32 %0, %%smid;" : "=r"(sm));
        timeline[0] = sm, timeline[1] = global_ns(), timeline[2] = clock64();
    }

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], CONSUMERS * 4 * CLUSTER_M);  // every consumer warp of the cluster
        }
        fence_barrier_init();
    }
    if (NORM_A) {  // a k-tile past K fills only part of its gamma slot: the rest must not be NaN (x there is 0)
        for (int i = threadIdx.x; i < STAGES * BK; i += NUM_THREADS) gamma_ring[i] = 0;
        fence_proxy_async();  // before the copy engine writes the same bytes
    }
    if (CLUSTER_M > 1) cluster_sync();  // no CTA may signal a peer's barriers before they exist
    else __syncthreads();

    if (wg == 0) {  // producer
        setmaxnreg_dec<40>();
        if (threadIdx.x == 0) {
            int it = 0, job_number = 0;  // it: k-tiles loaded so far, across jobs: the ring position
            Jobs jobs(job_tiles, k_tiles, splits);
            for (Job job; jobs.next(job); ++job_number) {
                int cm, tn;
                tile_coords(job.tile, CEIL_DIV(tiles_m, CLUSTER_M), tiles_n, GROUP_M, cm, tn);
                const int row0 = (cm * CLUSTER_M + rank) * BM, col0 = tn * BN;
                for (int kt = job.k0; kt < job.k1; ++kt, ++it) {
                    const int s = it % STAGES;
                    mbar_wait(&empty[s], ((it / STAGES) & 1) ^ 1);
                    timeline_mark(&timeline[8 + 4 * job_number], kt == job.k0 && job_number < TIMELINE_JOBS);
                    // all of B arrives, our share and the peers'; with NORM_A also this k-tile's gamma (inside K)
                    const u32 gamma_bytes = NORM_A ? min(BK, K - kt * BK) * 2 : 0;
                    mbar_arrive_expect_tx(&full[s], STAGE_BYTES + gamma_bytes);
                    tma_load_2d(a_tile(s), a_map, &full[s], kt * BK, row0);
                    if (NORM_A) bulk_load_1d(gamma_ring + s * BK, norm_gamma + kt * BK, gamma_bytes, &full[s]);
                    if (CLUSTER_M == 1) {
                        if (B_KMAJOR) tma_load_2d(b_tile(s), b_map, &full[s], kt * BK, col0);
                        else
                            for (int c = 0; c < B_CHUNKS; ++c)
                                tma_load_2d(b_tile(s) + c * BK * 64, b_map, &full[s], col0 + 64 * c, kt * BK);
                    } else {  // rung 5: this CTA's share of B, written into every CTA of the cluster
                        const unsigned short everyone = (1u << CLUSTER_M) - 1;
                        if (B_KMAJOR) {
                            const int rows = BN / CLUSTER_M;
                            tma_load_2d_multicast(b_tile(s) + rank * rows * BK, b_map, &full[s], kt * BK,
                                                  col0 + rank * rows, everyone);
                        } else {
                            for (int c = rank * (B_CHUNKS / CLUSTER_M); c < (rank + 1) * (B_CHUNKS / CLUSTER_M); ++c)
                                tma_load_2d_multicast(b_tile(s) + c * BK * 64, b_map, &full[s], col0 + 64 * c,
                                                      kt * BK, everyone);
                        }
                    }
                }
            }
        }
    } else {  // consumers
        setmaxnreg_inc<232>();
        const int consumer = wg - 1, thread = threadIdx.x % 128;
        bf16_bits* c_tile = c_tiles + consumer * C_TILE;
        auto release = [&](int s) {  // this warp is done reading stage s, in every CTA it was loaded for
            if (lane != 0) return;
            if (CLUSTER_M == 1) mbar_arrive(&empty[s]);
            else
                for (int r = 0; r < CLUSTER_M; ++r) mbar_arrive_cluster(&empty[s], r);
        };
        float acc[BN / 2], acc_lower[BN / 2];  // acc_lower: rows 64-127 of the warpgroup's slab (WG_ROWS 128)
        int job_number = 0;
        // The ring position as a stage and a phase bit, and the wgmma descriptors of stage 0 at k-slice 0:
        // another stage or k-slice only adds a constant to the start-address field (address / 16), which
        // halved the k-loop's instructions (97 -> 45 a k-tile) against building each descriptor afresh.
        int stage = 0, last_stage = 0;
        u32 phase = 0;
        const u64 a_desc0 = kmajor_desc(a_tile(0) + consumer * WG_ROWS * BK, 0);
        const u64 b_desc0 = B_KMAJOR ? kmajor_desc(b_tile(0), 0) : nmajor_desc<BK>(b_tile(0), 0);
        constexpr u32 STAGE_STEP = STAGE_BYTES / 16, A_KSTEP = 32 / 16, A_LOWER = 64 * BK * 2 / 16;
        constexpr u32 B_KSTEP = B_KMAJOR ? 32 / 16 : 16 * 64 * 2 / 16;
        // One EPI_COLS-wide slice of a 64-row result goes out through this consumer's slice buffers, taken
        // in turn: slice_begin waits until the buffer's previous store has read it (stores complete in
        // order, so with two buffers "all but the latest group" is this buffer's); the caller fills it
        // (swizzled); slice_end hands it to the TMA store. The turn is counted across tiles: a tile of
        // 192 columns has 3 slices, so its slice number alone would put the next tile's first slice in
        // the buffer whose store was issued last, while that store may still be reading it.
        u32 slices_begun = 0;
        auto slice_begin = [&]() {
            if (thread == 0) bulk_wait_read<EPI_BUFFERS - 1>();
            named_barrier(1 + consumer, 128);
            return c_tile + slices_begun++ % EPI_BUFFERS * 64 * EPI_COLS;
        };
        auto slice_end = [&](bf16_bits* slice, int sl, int first_row, int first_col) {
            fence_proxy_async();
            named_barrier(1 + consumer, 128);
            if (thread == 0) {
                for (int c = 0; c < EPI_COLS / 64; ++c)
                    tma_store_2d(c_map, slice + c * 64 * 64, first_col + sl * EPI_COLS + 64 * c, first_row);
                bulk_commit();
            }
        };
#if EPI_OVERLAP
        // The previous tile's results as bf16 pairs (pack_tile), stored a slice every EPI_SPREAD k-tiles
        // under this tile's k-loop, while the tensor cores work through the wgmmas just issued.
        u32 held[BN / 4];
        int held_row = -1, held_col = 0;  // held_row < 0: nothing held
        auto store_held = [&](int sl) {  // slice `sl` (a run-time value) of the held tile
#pragma unroll
            for (int s = 0; s < EPI_SLICES; ++s)
                if (s == sl) {  // (held[] is registers: each slice's indices must be constants)
                    bf16_bits* slice = slice_begin();
                    store_packed_swizzled<BN, EPI_COLS>(held, slice, s * EPI_COLS);
                    slice_end(slice, s, held_row, held_col);
                }
        };
#endif
#if NORM_A
        u32 frag_even[4][4], frag_odd[4][4];  // A fragments of even and odd k-tiles
        u32 x[4][4];  // the k-tile being prepared, as loaded
        float4 sumsq = make_float4(0.0f, 0.0f, 0.0f, 0.0f);  // squares of x in this thread's two A rows (x + z, y + w)
#endif
        Jobs jobs(job_tiles, k_tiles, splits);
        for (Job job; jobs.next(job); ++job_number) {
            const bool mark = TIMELINE && threadIdx.x == 128 && job_number < TIMELINE_JOBS;
            int cm, tn;
            tile_coords(job.tile, CEIL_DIV(tiles_m, CLUSTER_M), tiles_n, GROUP_M, cm, tn);
            const int row0 = (cm * CLUSTER_M + rank) * BM, col0 = tn * BN, split = job.split;
            const int kt_begin = job.k0, kt_end = job.k1;
#if NORM_A
            // A through registers (wgmma's register operand). The next k-tile's fragments are loaded and
            // normalized while this k-tile's wgmmas run, into the other of two register sets, after the
            // wait that retires the wgmmas that read that set. (Written before that wait, or with both
            // sets allocated to the same registers, ptxas serialized every wgmma: its note C7513.)
            // gamma comes from the stage's slot, not global memory: no load in flight at the wgmma fence.
            auto prepare = [&](int s, u32 ph, u32 (&frag)[4][4]) {
                mbar_wait(&full[s], ph);
                u32 g[8];  // gamma pairs at k 16 ks + 2 (lane % 4) and 8 further, from the stage's gamma slot
#pragma unroll
                for (int ks = 0; ks < 4; ++ks) {
                    const bf16_bits* slot = gamma_ring + s * BK + 16 * ks + 2 * (lane % 4);
                    g[2 * ks] = lds_u32(slot), g[2 * ks + 1] = lds_u32(slot + 8);
                }
                ldmatrix_a_ktile(a_tile(s) + (consumer * 64 + 16 * (thread / 32)) * BK, x);
#pragma unroll
                for (int ks = 0; ks < 4; ++ks)
#pragma unroll
                    for (int q = 0; q < 4; ++q) frag[ks][q] = mul_bf16x2(x[ks][q], g[2 * ks + q / 2]);
            };
            auto k_step = [&](int kt, u32 (&frag)[4][4], u32 (&next)[4][4]) {
                wgmma_fence();
                const u64 b = b_desc0 + stage * STAGE_STEP;
#pragma unroll
                for (int ks = 0; ks < 4; ++ks)
                    wgmma_m64k16_rs<BN, !B_KMAJOR>(acc, frag[ks], b + ks * B_KSTEP, kt > kt_begin || ks > 0);
                wgmma_commit();
                add_squares(x, sumsq);  // (after the wgmmas are issued: off the path to the tensor cores)
                wgmma_wait<1>();  // the previous k-tile's wgmmas are done: its stage and fragments are free
                if (kt > kt_begin) release(last_stage);
                last_stage = stage;
                if (++stage == STAGES) stage = 0, phase ^= 1;
                if (kt + 1 < kt_end) prepare(stage, phase, next);
            };
            prepare(stage, phase, frag_even);
            timeline_mark(&timeline[9 + 4 * job_number], mark);
            for (int kt = kt_begin; kt < kt_end; kt += 2) {
                k_step(kt, frag_even, frag_odd);
                if (kt + 1 < kt_end) k_step(kt + 1, frag_odd, frag_even);
            }
#else
            for (int kt = kt_begin; kt < kt_end; ++kt) {
                mbar_wait(&full[stage], phase);
                timeline_mark(&timeline[9 + 4 * job_number], mark && kt == kt_begin);
                wgmma_fence();
                const u64 a = a_desc0 + stage * STAGE_STEP, b = b_desc0 + stage * STAGE_STEP;
#pragma unroll
                for (int ks = 0; ks < BK / 16; ++ks) {
                    wgmma_m64k16<BN, !B_KMAJOR>(acc, a + ks * A_KSTEP, b + ks * B_KSTEP, kt > kt_begin || ks > 0);
                    if constexpr (WG_ROWS == 128)  // the same B slice against the slab's lower 64 rows
                        wgmma_m64k16<BN, !B_KMAJOR>(acc_lower, a + ks * A_KSTEP + A_LOWER, b + ks * B_KSTEP,
                                                     kt > kt_begin || ks > 0);
                }
                wgmma_commit();
#if EPI_OVERLAP
                if (held_row >= 0 && (kt - kt_begin) % EPI_SPREAD == EPI_SPREAD - 1 &&
                    (kt - kt_begin) / EPI_SPREAD < EPI_SLICES)
                    store_held((kt - kt_begin) / EPI_SPREAD);
#endif
                wgmma_wait<1>();
                if (kt > kt_begin) release(last_stage);
                last_stage = stage;
                if (++stage == STAGES) stage = 0, phase ^= 1;
            }
#endif
            wgmma_wait<0>();
            timeline_mark(&timeline[10 + 4 * job_number], mark);
            float2 row_scale = make_float2(1.0f, 1.0f);
#if NORM_A
            // A quad's 4 lanes hold a row's k values between them; the sums end up in the lanes whose
            // accumulator rows they are (rows lane / 4 and + 8 of the warp's 16).
            float2 rows_sumsq = make_float2(sumsq.x + sumsq.z, sumsq.y + sumsq.w);
            for (int mask = 1; mask <= 2; mask *= 2)
                rows_sumsq.x += __shfl_xor_sync(0xffffffffu, rows_sumsq.x, mask),
                rows_sumsq.y += __shfl_xor_sync(0xffffffffu, rows_sumsq.y, mask);
            row_scale = make_float2(rsqrtf(rows_sumsq.x / K + norm_eps), rsqrtf(rows_sumsq.y / K + norm_eps));
            sumsq = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#endif
#if SPLIT_K
            if (kt_end > kt_begin) release(last_stage);
            else
#pragma unroll
                for (int i = 0; i < BN / 2; ++i) acc[i] = 0.0f;  // an empty K range (more splits than k-tiles)
#else
            release(last_stage);  // (K > 0: the host returns zeros itself for K = 0)
#endif

#if SPLIT_K
            if (splits > 1) {
                const int first_row = row0 + consumer * 64;  // of this warpgroup's 64 x BN slice
                if (first_row >= M) continue;  // entirely outside C: nothing to add up or store
                // This warp's 16 rows as 32 lanes x BN/2 registers, lane-fastest: coalesced 16-byte accesses.
                const int warp = (thread / 32), slice = ((cm * CLUSTER_M + rank) * tiles_n + tn) * CONSUMERS + consumer;
                const bool rows_in_c = first_row + 16 * warp < M;
                auto part = [&](int sp) { return partials + ((size_t(slice) * splits + sp) * 4 + warp) * (BN / 8) * 32; };
                if (rows_in_c)
#pragma unroll
                    for (int q = 0; q < BN / 8; ++q)
                        part(split)[q * 32 + lane] = make_float4(acc[4 * q], acc[4 * q + 1], acc[4 * q + 2], acc[4 * q + 3]);
                __threadfence();  // our partial is visible before we count ourselves in
                named_barrier(1 + consumer, 128);
                if (thread == 0) last_split[consumer] = atomicAdd(&arrivals[slice], 1) == splits - 1;
                named_barrier(1 + consumer, 128);
                if (!last_split[consumer]) continue;
                __threadfence();
                // Every partial (our own too) read back in split order: the same sum whoever is last.
                // A split's BN/8 loads are independent and in flight together; a loop over splits
                // inside the loop over registers would wait out one load latency per register group.
                if (rows_in_c) {
#pragma unroll
                    for (int q = 0; q < BN / 8; ++q) {
                        const float4 x = __ldcg(part(0) + q * 32 + lane);
                        acc[4 * q] = x.x, acc[4 * q + 1] = x.y, acc[4 * q + 2] = x.z, acc[4 * q + 3] = x.w;
                    }
                    for (int sp = 1; sp < splits; ++sp)
#pragma unroll
                        for (int q = 0; q < BN / 8; ++q) {
                            const float4 x = __ldcg(part(sp) + q * 32 + lane);
                            acc[4 * q] += x.x, acc[4 * q + 1] += x.y, acc[4 * q + 2] += x.z, acc[4 * q + 3] += x.w;
                        }
                }
                if (thread == 0) arrivals[slice] = 0;  // every split has arrived: ready for the next launch
            }
#endif

#if STREAM_K
            if (kt_end - kt_begin < k_tiles) {  // a share of a tile: the last CTA to finish one adds them all up
                // A CTA's partial for its first shared tile goes to slot 2 cta, for its second to 2 cta + 1;
                // per warp, 32 lanes x BN/8 float4s, lane-fastest (coalesced 16-byte accesses).
                const int sk_tile = job.tile - jobs.whole_tiles, warp = thread / 32;
                const long long tile_start = (long long)sk_tile * k_tiles;
                auto cta_of = [&](long long k) {  // the CTA whose share holds shared k-tile k
                    const long long shared = jobs.share_start(gridDim.x, job_tiles);
                    return int(((k + 1) * gridDim.x - 1) / shared);
                };
                auto part = [&](int cta) {
                    const int second = jobs.share_start(cta, job_tiles) < tile_start;  // its share began in an earlier tile
                    return partials + (((size_t(2 * cta + second) * CONSUMERS + consumer) * 4 + warp) * (BN / 8)) * 32 + lane;
                };
                float4* mine = part(blockIdx.x);
#pragma unroll
                for (int q = 0; q < BN / 8; ++q)
                    mine[q * 32] = make_float4(acc[4 * q], acc[4 * q + 1], acc[4 * q + 2], acc[4 * q + 3]);
                __threadfence();  // our partial is visible before we count ourselves in
                named_barrier(1 + consumer, 128);
                const int first = cta_of(tile_start), last = cta_of(tile_start + k_tiles - 1);
                int* arrived = arrivals + sk_tile * CONSUMERS + consumer;
                if (thread == 0) last_share[consumer] = atomicAdd(arrived, 1) == last - first;
                named_barrier(1 + consumer, 128);
                if (!last_share[consumer]) continue;
                __threadfence();
                // Every share (our own too) added from zero in CTA order: the same sum whoever is last.
                // Eight 16-byte loads in flight at a time keep the registers beside the accumulators few.
#pragma unroll
                for (int i = 0; i < BN / 2; ++i) acc[i] = 0.0f;
                for (int cta = first; cta <= last; ++cta) {
                    const float4* p = part(cta);
#pragma unroll
                    for (int q0 = 0; q0 < BN / 8; q0 += 8) {
                        float4 x[8];
#pragma unroll
                        for (int u = 0; u < 8; ++u) x[u] = __ldcg(p + (q0 + u) * 32);
#pragma unroll
                        for (int u = 0; u < 8; ++u) {
                            acc[4 * (q0 + u)] += x[u].x, acc[4 * (q0 + u) + 1] += x[u].y;
                            acc[4 * (q0 + u) + 2] += x[u].z, acc[4 * (q0 + u) + 3] += x[u].w;
                        }
                    }
                }
                if (thread == 0) *arrived = 0;  // every share has arrived: ready for the next launch
            }
#endif

#if EPI_OVERLAP
            for (int sl = (kt_end - kt_begin) / EPI_SPREAD; sl < EPI_SLICES; ++sl)  // a K too short to store them all under
                if (held_row >= 0) store_held(sl);
            pack_tile<BN, EPI_BIAS, EPI_ACT, EPI_RESIDUAL, NORM_A>(acc, held, row0 + consumer * 64, col0, M, N, bias,
                                                                  residual, row_scale);
            held_row = row0 + consumer * 64, held_col = col0;
#else
            // Epilogue, slice by slice: fill a buffer from the accumulator, store it.
            auto store_rows = [&](const float (&d)[BN / 2], int first_row) {  // one 64-row accumulator
#pragma unroll
                for (int sl = 0; sl < EPI_SLICES; ++sl) {
                    bf16_bits* slice = slice_begin();
                    store_cols_swizzled<BN, EPI_COLS, EPI_BIAS, EPI_ACT, EPI_RESIDUAL, NORM_A>(
                        d, slice, sl * EPI_COLS, first_row, col0, M, N, bias, residual, row_scale);
                    slice_end(slice, sl, first_row, col0);
                }
            };
            store_rows(acc, row0 + consumer * WG_ROWS);
            if constexpr (WG_ROWS == 128) store_rows(acc_lower, row0 + consumer * WG_ROWS + 64);
#endif
            timeline_mark(&timeline[11 + 4 * job_number], mark);
        }
#if EPI_OVERLAP
        if (held_row >= 0)  // the last tile
            for (int sl = 0; sl < EPI_SLICES; ++sl) store_held(sl);
#endif
        if (thread == 0) bulk_wait_read();  // the CTA's shared memory must outlive the last store's reads
        if (TIMELINE && threadIdx.x == 128) timeline[3] = job_number, timeline[4] = global_ns(), timeline[5] = clock64();
    }
    if (CLUSTER_M > 1) cluster_sync();  // peers may still arrive on our barriers until they finish
}

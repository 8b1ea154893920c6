// Rung 8: warptiling. A level between the block and the thread: each warp owns a WM x WN
// region of the block's tile and its 32 lanes tile that region in WMITER x WNITER steps of
// (8 x 4 lanes) x (TM x TN) values.
// What changed: in rung 7 the thread layout was fixed by the block shape; here the warp's
// footprint is a parameter, so a warp reads a compact strip of As and Bs (fewer distinct
// shared addresses per load, all float4s consecutive across lanes: conflict-free), its
// loads reuse better in registers, and the tile shapes become knobs for rung 10's sweep.
// Also new: the fragments are double-buffered in registers, and a tile's last k-step runs
// after the barrier that publishes the next tile, with the next tile's first fragments
// loading beneath it: the barrier no longer drains the pipeline (CUTLASS's SIMT main loop
// does the same). GROUP_M > 1 reorders blocks so that GROUP_M row-blocks of C run
// together and share the panels of A and B they read in L2.
// Predicted: a few % over rung 7 at the same shape; its real value is the tuning space.
#include "common.cuh"

#ifndef BM
#define BM 128
#endif
#ifndef BN
#define BN 128
#endif
#ifndef BK
#define BK 8
#endif
#ifndef WM
#define WM 64
#endif
#ifndef WN
#define WN 32
#endif
#ifndef WNITER
#define WNITER 2
#endif
#ifndef TM
#define TM 4
#endif
#ifndef TN
#define TN 4
#endif
#ifndef NUM_THREADS
#define NUM_THREADS 256
#endif
#ifndef GROUP_M
#define GROUP_M 1
#endif
#ifndef APAD
#define APAD 4
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 2  // blocks per SM the register budget must allow (2 x 256 threads: <= 128 registers)
#endif

#define WARPS (NUM_THREADS / 32)
#define WMITER ((WM * WN) / (32 * TM * TN * WNITER))
#define WSUBM (WM / WMITER)
#define WSUBN (WN / WNITER)
#define SHARED_BYTES (2 * BK * (BM + APAD + BN) * 4)  // kforge.kernels.gemm_fp32 computes the same
#define A_ROUNDS (BM * BK / 4 / NUM_THREADS)
#define B_ROUNDS (BK * BN / 4 / NUM_THREADS)
static_assert(SHARED_BYTES <= 227 * 1024, "the buffers fit one block's shared memory on Hopper");
static_assert((BM / WM) * (BN / WN) == WARPS, "the warps tile the block exactly");
static_assert(WMITER >= 1 && WMITER * WSUBM == WM && WNITER * WSUBN == WN, "warp tile splits evenly");
static_assert((WSUBM / TM) * (WSUBN / TN) == 32, "a warp's 32 lanes tile one sub-tile");
static_assert(TM % 4 == 0 && TN % 4 == 0, "fragments load as float4s");
static_assert(A_ROUNDS * NUM_THREADS * 4 == BM * BK && B_ROUNDS * NUM_THREADS * 4 == BK * BN,
              "tiles load in whole rounds of float4s");

extern "C" __global__ void __launch_bounds__(NUM_THREADS, MIN_BLOCKS)
sgemm(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C, int M, int N, int K) {
    // Two buffers of each tile, in dynamic shared memory: large tiles need more than the
    // 48 KB a block may hold statically. The launcher passes SHARED_BYTES.
    extern __shared__ __align__(16) float smem[];
    float (*As)[BK][BM + APAD] = reinterpret_cast<float (*)[BK][BM + APAD]>(smem);  // transposed, padded
    float (*Bs)[BK][BN] = reinterpret_cast<float (*)[BK][BN]>(smem + 2 * BK * (BM + APAD));

    // Which tile of C: blocks in groups of GROUP_M row-blocks, column-major inside a group.
    int bm = blockIdx.y, bn = blockIdx.x;
    if (GROUP_M > 1) {
        const int grid_m = gridDim.y, grid_n = gridDim.x, pid = blockIdx.y * grid_n + blockIdx.x;
        const int group = pid / (GROUP_M * grid_n), first_m = group * GROUP_M;
        const int rows = min(grid_m - first_m, GROUP_M), in_group = pid % (GROUP_M * grid_n);
        bm = first_m + in_group % rows;
        bn = in_group / rows;
    }
    const int row0 = bm * BM, col0 = bn * BN;

    const int t = threadIdx.x, warp = t / 32, lane = t % 32;
    const int wrow = (warp / (BN / WN)) * WM, wcol = (warp % (BN / WN)) * WN;  // the warp's region
    const int lrow = (lane / (WSUBN / TN)) * TM, lcol = (lane % (WSUBN / TN)) * TN;  // the lane's spot
    const bool a_aligned = K % 4 == 0 && reinterpret_cast<size_t>(A) % 16 == 0;
    const bool b_aligned = N % 4 == 0 && reinterpret_cast<size_t>(B) % 16 == 0;
    const bool c_aligned = N % 4 == 0 && reinterpret_cast<size_t>(C) % 16 == 0;

    float4 a_stage[A_ROUNDS], b_stage[B_ROUNDS];
    auto load_tiles = [&](int k0) {  // global -> registers
#pragma unroll
        for (int i = 0; i < A_ROUNDS; ++i) {
            const int e = t + i * NUM_THREADS, r = e / (BK / 4), c = (e % (BK / 4)) * 4;
            a_stage[i] = load4(A, row0 + r, k0 + c, M, K, K, a_aligned);
        }
#pragma unroll
        for (int i = 0; i < B_ROUNDS; ++i) {
            const int e = t + i * NUM_THREADS, r = e / (BN / 4), c = (e % (BN / 4)) * 4;
            b_stage[i] = load4(B, k0 + r, col0 + c, K, N, N, b_aligned);
        }
    };
    auto store_tiles = [&](int buf) {  // registers -> shared, A transposed
#pragma unroll
        for (int i = 0; i < A_ROUNDS; ++i) {
            const int e = t + i * NUM_THREADS, r = e / (BK / 4), c = (e % (BK / 4)) * 4;
            As[buf][c + 0][r] = a_stage[i].x; As[buf][c + 1][r] = a_stage[i].y;
            As[buf][c + 2][r] = a_stage[i].z; As[buf][c + 3][r] = a_stage[i].w;
        }
#pragma unroll
        for (int i = 0; i < B_ROUNDS; ++i) {
            const int e = t + i * NUM_THREADS, r = e / (BN / 4), c = (e % (BN / 4)) * 4;
            *reinterpret_cast<float4*>(&Bs[buf][r][c]) = b_stage[i];
        }
    };

    // Fragments (a thread's column of A and row of B for one k) in two register slots:
    // the next k's are read from shared memory while this k's multiply-adds run.
    float acc[WMITER * TM][WNITER * TN] = {{0.f}};
    float a[2][WMITER * TM], b[2][WNITER * TN];
    auto load_fragments = [&](int buf, int k, int slot) {
#pragma unroll
        for (int wm = 0; wm < WMITER; ++wm)
#pragma unroll
            for (int i = 0; i < TM; i += 4) {
                const float4 v = lds4(&As[buf][k][wrow + wm * WSUBM + lrow + i]);
                float* dst = &a[slot][wm * TM + i];
                dst[0] = v.x; dst[1] = v.y; dst[2] = v.z; dst[3] = v.w;
            }
#pragma unroll
        for (int wn = 0; wn < WNITER; ++wn)
#pragma unroll
            for (int j = 0; j < TN; j += 4) {
                const float4 v = lds4(&Bs[buf][k][wcol + wn * WSUBN + lcol + j]);
                float* dst = &b[slot][wn * TN + j];
                dst[0] = v.x; dst[1] = v.y; dst[2] = v.z; dst[3] = v.w;
            }
    };

    const int tiles = CEIL_DIV(K, BK);
    load_tiles(0);
    store_tiles(0);
    __syncthreads();
    load_fragments(0, 0, 0);
    for (int kt = 0; kt < tiles; ++kt) {
        const int buf = kt & 1;
        const bool more = kt + 1 < tiles;
        if (more) load_tiles((kt + 1) * BK);  // global loads in flight during this tile's math
#pragma unroll
        for (int k = 0; k < BK; ++k) {
            if (k < BK - 1) {
                load_fragments(buf, k + 1, (k + 1) & 1);
            } else {
                // Before the tile's last k: publish the next tile, then fetch its first
                // fragments, so the barrier and that first shared load overlap with math.
                // The other buffer was last read before the previous tile's barrier.
                if (more) store_tiles(buf ^ 1);
                __syncthreads();
                if (more) load_fragments(buf ^ 1, 0, (k + 1) & 1);
            }
#pragma unroll
            for (int i = 0; i < WMITER * TM; ++i)
#pragma unroll
                for (int j = 0; j < WNITER * TN; ++j) acc[i][j] += a[k & 1][i] * b[k & 1][j];
        }
    }
#pragma unroll
    for (int wm = 0; wm < WMITER; ++wm)
#pragma unroll
        for (int i = 0; i < TM; ++i) {
            const int r = row0 + wrow + wm * WSUBM + lrow + i;
#pragma unroll
            for (int wn = 0; wn < WNITER; ++wn)
#pragma unroll
                for (int j = 0; j < TN; j += 4) {
                    const float* v = &acc[wm * TM + i][wn * TN + j];
                    store4(C, make_float4(v[0], v[1], v[2], v[3]), r, col0 + wcol + wn * WSUBN + lcol + j, M, N, N,
                           c_aligned);
                }
        }
}

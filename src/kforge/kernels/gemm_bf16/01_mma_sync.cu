// Rung 1: tensor cores the Ampere way: mma.sync fed by ldmatrix from swizzled shared
// memory, filled by a cp.async multistage pipeline.
// What changed (from the fp32 ladder's CUDA-core FFMAs): each warp issues
// mma.sync.m16n8k16 (a 16 x 8 x 16 bf16 product accumulated in fp32, 4096 FLOPs per
// instruction instead of 64 for an FFMA). Its operands must sit in registers in the
// tensor cores' fragment layout; ldmatrix loads four 8 x 8 matrices per instruction
// straight into that layout (.trans for a K x N B). Tiles reach shared memory by cp.async
// (16-byte copies bypassing registers) through a STAGES-deep ring, and are stored with
// each 16-byte chunk of a row XOR-ed with the row index (mod 8): the 8 rows one ldmatrix
// matrix reads then land in 8 different bank groups, conflict-free, in both the load and
// the transposed load.
// Block 128 x 128 x 64, 4 warps of 64 x 64: per k16 step a warp loads 4 A and 4 B
// fragments (ldmatrix.x4) and issues 32 mma.sync.
// Why: this is how every GPU since Volta multiplies; on Hopper it still works but every
// operand passes through registers, which caps it well below wgmma.
// Predicted: roughly half of cuBLAS (which uses wgmma); 10x the fp32 rungs.
#include "hopper.cuh"

#ifndef BM
#define BM 128
#endif
#ifndef BN
#define BN 128
#endif
#ifndef BK
#define BK 64  // one 128-byte row of bf16 per A row: 8 chunks, the XOR swizzle's period
#endif
#ifndef STAGES
#define STAGES 3  // 96 KB: two blocks (8 warps) per SM
#endif
#ifndef B_KMAJOR
#define B_KMAJOR 0  // 1: B is given as N x K (C = A @ B^T); 0: B is K x N
#endif

#define WM 64
#define WN 64
#define NUM_THREADS ((BM / WM) * (BN / WN) * 32)
#define A_TILE (BM * BK)  // elements
#define B_TILE (BK * BN)
#define SHARED_BYTES (STAGES * (A_TILE + B_TILE) * 2)
#define A_COPIES (A_TILE / 8 / NUM_THREADS)  // 16-byte chunks per thread per tile
#define B_COPIES (B_TILE / 8 / NUM_THREADS)
static_assert(BK == 64, "rows of 8 chunks: the swizzle below assumes it");
static_assert(BM % WM == 0 && BN % WN == 0 && BN % 64 == 0, "warps tile the block");
static_assert(A_COPIES * NUM_THREADS * 8 == A_TILE && B_COPIES * NUM_THREADS * 8 == B_TILE, "whole rounds of copies");
static_assert(SHARED_BYTES <= 227 * 1024, "fits one block's shared memory");

// Element offset of chunk `chunk` (8 bf16) of row `row` in a tile of `row_chunks` chunks
// per row: the low 3 bits of the chunk index are XOR-ed with the row (mod 8).
__device__ __forceinline__ int swizzled(int row, int chunk, int row_chunks) {
    return row * row_chunks * 8 + ((chunk ^ (row & 7)) * 8);
}

__device__ __forceinline__ void copy16_or_zero(bf16_bits* dst, const bf16_bits* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
                 "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const bf16_bits* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], const bf16_bits* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
}

// d += a (16 x 16, row) * b (16 x 8, col), bf16 in, fp32 accumulate.
__device__ __forceinline__ void mma_16x8x16(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
gemm(const bf16_bits* __restrict__ A, const bf16_bits* __restrict__ B, bf16_bits* __restrict__ C, int M, int N,
     int K) {
    check_launch(NUM_THREADS, SHARED_BYTES);
    extern __shared__ __align__(128) bf16_bits smem[];
    auto a_tile = [&](int s) { return smem + s * (A_TILE + B_TILE); };           // [BM][BK]
    auto b_tile = [&](int s) { return smem + s * (A_TILE + B_TILE) + A_TILE; };  // [BN][BK] or [BK][BN]

    const int row0 = blockIdx.y * BM, col0 = blockIdx.x * BN, k_tiles = CEIL_DIV(K, BK);
    const int t = threadIdx.x, warp = t / 32, lane = t % 32;
    const int wrow = (warp / (BN / WN)) * WM, wcol = (warp % (BN / WN)) * WN;

    // One tile of A and B into stage kt % STAGES as one commit group (empty past the end).
    // K and N are multiples of 8, so a 16-byte chunk is wholly inside or wholly outside.
    auto load = [&](int kt) {
        if (kt < k_tiles) {
            const int k0 = kt * BK, s = kt % STAGES;
#pragma unroll
            for (int i = 0; i < A_COPIES; ++i) {
                const int e = t + i * NUM_THREADS, r = e / (BK / 8), c = e % (BK / 8);
                const bool ok = row0 + r < M && k0 + c * 8 < K;
                copy16_or_zero(a_tile(s) + swizzled(r, c, BK / 8), ok ? A + (size_t)(row0 + r) * K + k0 + c * 8 : A, ok);
            }
#pragma unroll
            for (int i = 0; i < B_COPIES; ++i) {
                const int e = t + i * NUM_THREADS;
                if (B_KMAJOR) {  // B is N x K: rows of the tile are n, 8 chunks of k each
                    const int r = e / (BK / 8), c = e % (BK / 8);
                    const bool ok = col0 + r < N && k0 + c * 8 < K;
                    copy16_or_zero(b_tile(s) + swizzled(r, c, BK / 8), ok ? B + (size_t)(col0 + r) * K + k0 + c * 8 : B,
                                   ok);
                } else {  // B is K x N: rows of the tile are k, BN / 8 chunks of n each
                    const int r = e / (BN / 8), c = e % (BN / 8);
                    const bool ok = k0 + r < K && col0 + c * 8 < N;
                    copy16_or_zero(b_tile(s) + swizzled(r, c, BN / 8), ok ? B + (size_t)(k0 + r) * N + col0 + c * 8 : B,
                                   ok);
                }
            }
        }
        asm volatile("cp.async.commit_group;\n" ::);
    };

    float acc[WM / 16][WN / 8][4] = {};
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) load(s);
    for (int kt = 0; kt < k_tiles; ++kt) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 2));
        __syncthreads();  // tile kt visible to all; everyone is done with tile kt - 1's stage
        load(kt + STAGES - 1);
        const bf16_bits* as = a_tile(kt % STAGES);
        const bf16_bits* bs = b_tile(kt % STAGES);
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            // A: lanes 0-15 address rows 0-15 at k 0-7, lanes 16-31 the same rows at k 8-15:
            // registers (rows 0-7, k 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15), mma's order.
            u32 a[WM / 16][4], b[WN / 16][4];
#pragma unroll
            for (int i = 0; i < WM / 16; ++i) {
                const int r = wrow + i * 16 + lane % 16;
                ldmatrix_x4(a[i], as + swizzled(r, kk * 2 + lane / 16, BK / 8));
            }
            // B: per pair of n8 tiles, registers (b0, b1) of the first tile, then of the second.
#pragma unroll
            for (int j = 0; j < WN / 16; ++j) {
                if (B_KMAJOR) {  // rows n, k contiguous: the fragment layout as stored
                    const int r = wcol + j * 16 + lane % 8 + (lane / 16) * 8;
                    ldmatrix_x4(b[j], bs + swizzled(r, kk * 2 + (lane / 8) % 2, BK / 8));
                } else {  // rows k, n contiguous: transposed on the way in
                    const int r = kk * 16 + lane % 8 + ((lane / 8) % 2) * 8;
                    ldmatrix_x4_trans(b[j], bs + swizzled(r, (wcol + j * 16) / 8 + lane / 16, BN / 8));
                }
            }
#pragma unroll
            for (int i = 0; i < WM / 16; ++i)
#pragma unroll
                for (int j = 0; j < WN / 8; ++j) mma_16x8x16(acc[i][j], a[i], b[j / 2][(j % 2) * 2], b[j / 2][(j % 2) * 2 + 1]);
        }
    }
    asm volatile("cp.async.wait_group 0;\n" ::);

    // Accumulator layout: d0, d1 at row lane / 4, columns 2 (lane % 4) + {0, 1}; d2, d3 eight rows below.
#pragma unroll
    for (int i = 0; i < WM / 16; ++i)
#pragma unroll
        for (int j = 0; j < WN / 8; ++j) {
            const int r = row0 + wrow + i * 16 + lane / 4, c = col0 + wcol + j * 8 + 2 * (lane % 4);
            if (c < N) {  // N is a multiple of 8: the pair is inside too
                if (r < M) *reinterpret_cast<u32*>(C + (size_t)r * N + c) = pack_bf16x2(acc[i][j][0], acc[i][j][1]);
                if (r + 8 < M)
                    *reinterpret_cast<u32*>(C + (size_t)(r + 8) * N + c) = pack_bf16x2(acc[i][j][2], acc[i][j][3]);
            }
        }
}

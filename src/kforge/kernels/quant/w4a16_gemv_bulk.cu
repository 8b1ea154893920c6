// W4A16 decode GEMV for one token, fed by the bulk-copy engine: the same sums as w4a16_gemv.cu
// (bit for bit), with W streamed into shared memory by cp.async.bulk instead of loaded into
// registers.
//
// Why. w4a16_gemv.cu holds its loads in flight in registers: 111 of them at 4 rows a warp, so
// few warps fit an SM, each keeps two 16-byte steps in flight, and ncu saw under one eligible
// warp a scheduler (latency-bound, 70% of the copy bandwidth at 28672 x 4096 against the read
// stream's 84.5%). Here one producer warp asks the copy engine for whole tiles of W (TILE_ROWS
// rows x CHUNK_BYTES, one bulk copy a row, and the rows' scales) into a ring of STAGES in shared
// memory, so the bytes in flight cost no registers (8 rows x 2 KB a stage, 4 stages a block,
// two blocks an SM: 135 KB). CONSUMERS warps compute from the ring and free each stage through
// an mbarrier.
//
// x is read once a block: each x value is multiplied by its nibble's factor (w4a16_decode.cuh)
// and kept in shared memory as fp32, with -8 sum x of each 32 values (the decode's offset term),
// so the consumers' inner loop is shared-memory loads, one LOP3 and one FFMA a weight. Layout
// of the prescaled x: float4 f (values 4f..4f+3) of unit u (32 values) at [f][u], so a warp's
// 32 lanes (consecutive units) read 512 consecutive bytes (no bank conflicts).
//
// Work: a persistent grid (as many blocks as fit at once: two an SM at 4 stages of 8 rows and
// K = 4096), tiles of TILE_ROWS rows dealt round-robin, each row's chunk its own bulk copy. In a
// tile, warp w owns rows ROWS w .. ROWS w + ROWS - 1 and lane l the 16-byte units l, l + 32, ...
// of each chunk, the same units as w4a16_gemv.cu's lanes (so the same sums in the same order).
// K must be a multiple of 1024 (a chunk's scales are whole 16-byte copies), the group 128, W
// and its scales contiguous (the wrapper checks).
//
// Measured on the H100 (kforge bench quant and scripts/quant_gemv_sweep.py, device time after an
// L2 flush): at 28672 x 4096, 25.6-25.8 us, 77% of the copy bandwidth and 90% of a read-only stream
// of the same bytes (w4a16_gemv.cu: 28.4 us, 69%), 3.3x bf16 cuBLAS; at 14336 x 4096, 16.3 us
// against 17.4. Slower than w4a16_gemv.cu where N is small (4096 x 4096, 6144 x 4096) or K long
// (4096 x 14336, where x's 57 KB leave room for one block an SM): w4a16.py picks it only for
// K <= 4096 and N >= 12288. The producer thread's code is on the critical path: the same copies
// behind one more branch ran at 27.0 us.
// What limits it: built with its consumers computing nothing, its copies run at 23.5 us (the read
// stream 23.0), so the arithmetic costs 2.2 us, all of it in the tail: the last blocks' last copies
// wait ~3 us for the producer to refill a freed slot while the consumers compute. Fewer, larger or
// more copies, more or fewer warps, rows and stages, and one token on mma.sync were all slower or
// no faster (figures and commits: docs/worklogs/quant.md).

#include "../gemm_bf16/hopper.cuh"
#include "w4a16_decode.cuh"

#ifndef ROWS
#define ROWS 2  // rows a consumer warp
#endif
#ifndef CONSUMERS
#define CONSUMERS 4  // consumer warps a block
#endif
#ifndef STAGES
#define STAGES 4
#endif
#define TILE_ROWS (ROWS * CONSUMERS)
#define CHUNK_BYTES 2048                // of a row of W: 4096 weights, 128 units of 16 bytes
#define CHUNK_SCALE_BYTES (CHUNK_BYTES / 32)  // one bf16 scale a 64 bytes (group 128)
#define STAGE_BYTES (TILE_ROWS * (CHUNK_BYTES + CHUNK_SCALE_BYTES))

extern "C" __global__ void __launch_bounds__(32 * (CONSUMERS + 1), 1)
w4a16_gemv_bulk(const unsigned char* __restrict__ q, const unsigned char* __restrict__ s,
                const uint4* __restrict__ x, u16* __restrict__ y, int n, int k) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int units = k / 32, row_bytes = k / 2, chunks = CEIL_DIV(row_bytes, CHUNK_BYTES);
    const int tiles = CEIL_DIV(n, TILE_ROWS);  // dealt round-robin: the blocks stream neighbouring rows at once
    float4* xs = reinterpret_cast<float4*>(smem + STAGES * STAGE_BYTES);  // [8][units]
    float* x_offset = reinterpret_cast<float*>(xs + 8 * units);           // [units]: -8 sum x, in 2^-E0
    u64* full = reinterpret_cast<u64*>(x_offset + units);                 // (units: a multiple of 32)
    u64* empty = full + STAGES;
    // a stage holds its rows' chunks back to back (row r at r * the chunk's bytes), then their scales
    auto stage_q = [&](int st) { return smem + st * STAGE_BYTES; };
    auto stage_scales = [&](int st) { return smem + st * STAGE_BYTES + TILE_ROWS * CHUNK_BYTES; };
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

    if (threadIdx.x == 0) {
        for (int st = 0; st < STAGES; ++st) {
            mbar_init(&full[st], 1);  // the producer's arrival (and the copies' bytes)
            mbar_init(&empty[st], CONSUMERS);
        }
        fence_barrier_init();
    }
    __syncthreads();

    if (warp == CONSUMERS) {  // the producer: one thread books a stage's bytes and asks for its rows
        if (lane != 0) return;
        int it = 0;
        for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
            const int row0 = tile * TILE_ROWS, rows = min(TILE_ROWS, n - row0);
            for (int c = 0; c < chunks; ++c, ++it) {
                const int st = it % STAGES;
                const u32 bytes = min(CHUNK_BYTES, row_bytes - c * CHUNK_BYTES), scale_bytes = bytes / 32;
                mbar_wait(&empty[st], ((it / STAGES) & 1) ^ 1);
                mbar_arrive_expect_tx(&full[st], rows * (bytes + scale_bytes));
                for (int r = 0; r < rows; ++r) {
                    const size_t row = row0 + r;
                    bulk_load_1d(stage_q(st) + r * bytes, q + row * row_bytes + c * CHUNK_BYTES, bytes, &full[st]);
                    bulk_load_1d(stage_scales(st) + r * scale_bytes, s + row * (row_bytes / 32) + c * CHUNK_SCALE_BYTES,
                                 scale_bytes, &full[st]);
                }
            }
        }
        return;
    }

    // Consumers. x, prescaled, once (while the first stages are on their way): X_BATCH units a thread
    // at a time, all their loads issued before any is used (one memory latency a batch, not one a unit).
    constexpr int X_BATCH = 4;
    for (int first = threadIdx.x; first < units; first += X_BATCH * 32 * CONSUMERS) {
        uint4 loaded[X_BATCH][4];
#pragma unroll
        for (int b = 0; b < X_BATCH; ++b)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int u = first + b * 32 * CONSUMERS;
                loaded[b][j] = u < units ? __ldg(x + 4 * u + j) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
        for (int b = 0; b < X_BATCH; ++b) {
            const int u = first + b * 32 * CONSUMERS;
            if (u >= units) break;
            float sum = 0.0f;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const uint4 v = loaded[b][j];
                const u32 pairs[4] = {v.x, v.y, v.z, v.w};
                float scaled[8];
#pragma unroll
                for (int p = 0; p < 4; ++p) {
                    const float lo = __uint_as_float(pairs[p] << 16), hi = __uint_as_float(pairs[p] & 0xFFFF0000u);
                    sum += lo + hi;
                    scaled[2 * p] = lo * NIBBLE_UNIT[2 * p];
                    scaled[2 * p + 1] = hi * NIBBLE_UNIT[2 * p + 1];
                }
                xs[(2 * j) * units + u] = make_float4(scaled[0], scaled[1], scaled[2], scaled[3]);
                xs[(2 * j + 1) * units + u] = make_float4(scaled[4], scaled[5], scaled[6], scaled[7]);
            }
            x_offset[u] = sum * (-8.0f * ACC_UNIT);
        }
    }
    named_barrier(1, 32 * CONSUMERS);

    int it = 0;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const int row0 = tile * TILE_ROWS, rows = min(TILE_ROWS, n - row0);
        float acc[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[r] = 0.0f;
        for (int c = 0; c < chunks; ++c, ++it) {
            const int st = it % STAGES;
            const int chunk_units = min(CHUNK_BYTES, row_bytes - c * CHUNK_BYTES) / 16;
            const int first_unit = c * (CHUNK_BYTES / 16);
            mbar_wait(&full[st], (it / STAGES) & 1);
            // this warp's rows: chunk_units 16-byte units a row, and chunk_units / 4 scales
            const uint4* rows_q = reinterpret_cast<const uint4*>(stage_q(st)) + warp * ROWS * chunk_units;
            const u16* rows_scales = reinterpret_cast<const u16*>(stage_scales(st)) + warp * ROWS * (chunk_units / 4);
            for (int u = lane; u < chunk_units; u += 32) {
                float x32[32];
#pragma unroll
                for (int f = 0; f < 8; ++f) {
                    const float4 v = xs[f * units + first_unit + u];
                    x32[4 * f] = v.x, x32[4 * f + 1] = v.y, x32[4 * f + 2] = v.z, x32[4 * f + 3] = v.w;
                }
                const float start = x_offset[first_unit + u];
#pragma unroll
                for (int r = 0; r < ROWS; ++r) {  // two independent chains a row, as in w4a16_gemv.cu
                    const uint4 w = rows_q[r * chunk_units + u];
                    const float first_half = word_dot(w.y, x32 + 8, word_dot(w.x, x32, start));
                    const float second_half = word_dot(w.w, x32 + 24, word_dot(w.z, x32 + 16, 0.0f));
                    const u32 scale = static_cast<u32>(rows_scales[r * (chunk_units / 4) + u / 4]) << 16;
                    acc[r] = fmaf(first_half + second_half, __uint_as_float(scale), acc[r]);
                }
            }
            __syncwarp();
            if (lane == 0) mbar_arrive(&empty[st]);
        }
        const int first = row0 + warp * ROWS;
        float sum;
        if (warp_row_sums<ROWS>(acc, &sum) && warp * ROWS + lane < rows) {
            u16 rounded;
            asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(rounded) : "f"(sum * Y_UNIT));
            y[first + lane] = rounded;
        }
    }
}

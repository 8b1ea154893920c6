// Hopper building blocks for the bf16 GEMM rungs and the FP8 GEMM (quant/fp8_block_gemm.cu), one thin
// wrapper per PTX instruction.
// Each rung file keeps its own idea (the pipeline, the roles, the schedule); this header
// only names the instructions so the rungs read as algorithms. PTX ISA 8.x, sm_90a.
//
// Shared-memory layout used by every Hopper rung: operand tiles are written by TMA with
// the 128-byte swizzle, so a tile is a stack of 128-byte rows (64 bf16 values) in which
// 16-byte unit u of row r sits at unit u ^ (r % 8). Eight rows (1024 bytes) make one
// swizzle atom, so tiles start at 1024-byte boundaries. wgmma reads the same layout
// through a 64-bit descriptor (start address, LBO, SBO, swizzle mode).
#pragma once

typedef unsigned int u32;
typedef unsigned long long u64;
typedef unsigned short bf16_bits;  // a bf16 value as its 16 bits (cuda_bf16.h is not needed)

#define CEIL_DIV(a, b) (((a) + (b) - 1) / (b))

// A CUtensorMap (cuda.h): 128 opaque bytes that the launcher encodes on the host and
// passes by value; kernels take it as `const __grid_constant__ TensorMap`.
struct __align__(64) TensorMap { u64 opaque[16]; };

__device__ __forceinline__ u32 smem_u32(const void* p) { return static_cast<u32>(__cvta_generic_to_shared(p)); }
// A 4-byte shared-memory load the compiler cannot turn generic (a pointer aligned by integer arithmetic
// loses its address space, and a generic load waits on the long scoreboard).
__device__ __forceinline__ u32 lds_u32(const void* p) {
    u32 v;
    asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(smem_u32(p)));
    return v;
}
__device__ __forceinline__ float lds_f32(const void* p) { return __uint_as_float(lds_u32(p)); }
__device__ __forceinline__ void sts_f32(void* p, float v) {
    asm volatile("st.shared.f32 [%0], %1;" ::"r"(smem_u32(p)), "f"(v) : "memory");
}

// The launcher derives block size and shared memory from the same #defines in Python; a
// mismatch would corrupt memory quietly, so the kernel traps on it instead.
__device__ __forceinline__ void check_launch(u32 threads, u32 shared_bytes) {
    u32 dynamic;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dynamic));
    if (blockDim.x != threads || dynamic < shared_bytes) __trap();
}

// ---- mbarriers: a phase completes when its expected arrivals and bytes have all come ----

__device__ __forceinline__ void mbar_init(u64* bar, u32 arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(arrivals));
}
// Makes the initialised barriers visible to the copy engine and to the other CTAs of a cluster.
__device__ __forceinline__ void fence_barrier_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

// Arrive once and tell the barrier `bytes` more will land through TMA in this phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(u64* bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u64* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
// Arrive on the barrier at the same offset in CTA `cta` of this cluster (possibly this one).
__device__ __forceinline__ void mbar_arrive_cluster(u64* bar, u32 cta) {
    asm volatile(
        "{\n.reg .b32 remote;\n"
        "mapa.shared::cluster.u32 remote, %0, %1;\n"
        "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}" ::"r"(smem_u32(bar)),
        "r"(cta)
        : "memory");
}
// Spin until the phase with this parity (0, 1, 0, ...) has completed.
__device__ __forceinline__ void mbar_wait(u64* bar, u32 parity) {
    asm volatile(
        "{\n.reg .pred done;\n"
        "WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n}" ::"r"(smem_u32(bar)),
        "r"(parity)
        : "memory");
}

// ---- TMA: bulk tensor copies; coordinates are (column, row) in elements ----

__device__ __forceinline__ void tma_load_2d(void* dst, const TensorMap& map, u64* bar, int col, int row) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(
            smem_u32(dst)),
        "l"(reinterpret_cast<u64>(&map)), "r"(smem_u32(bar)), "r"(col), "r"(row)
        : "memory");
}
// `bytes` (a multiple of 16) from global to shared memory, counted on `bar` like a tensor box.
__device__ __forceinline__ void bulk_load_1d(void* dst, const void* src, u32 bytes, u64* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     smem_u32(dst)),
                 "l"(reinterpret_cast<u64>(src)), "r"(bytes), "r"(smem_u32(bar))
                 : "memory");
}
// The same box written to the same shared offset of every CTA in `cta_mask`, each CTA's
// barrier at `bar`'s offset told of the bytes.
__device__ __forceinline__ void tma_load_2d_multicast(void* dst, const TensorMap& map, u64* bar, int col, int row,
                                                      unsigned short cta_mask) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
        " [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(smem_u32(dst)),
        "l"(reinterpret_cast<u64>(&map)), "r"(smem_u32(bar)), "r"(col), "r"(row), "h"(cta_mask)
        : "memory");
}
// Shared -> global; rows and columns outside the tensor are not written.
__device__ __forceinline__ void tma_store_2d(const TensorMap& map, const void* src, int col, int row) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];" ::"l"(
                     reinterpret_cast<u64>(&map)),
                 "r"(smem_u32(src)), "r"(col), "r"(row)
                 : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Wait until the committed stores, all but the PENDING most recent groups, have finished
// reading shared memory (not until they land).
template <int PENDING = 0>
__device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(PENDING) : "memory");
}
// Ordinary shared-memory stores, made visible to the copy engine (the async proxy).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// ---- wgmma: a warpgroup (4 warps) multiplies 64 x 16 by 16 x N from shared memory ----

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int PENDING>  // wait until at most PENDING committed groups are still running
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(PENDING) : "memory");
}

// Descriptor of a 128-byte-swizzled tile. LBO: bytes between the 64-value chunks of the
// contiguous dimension (used by N-major tiles only); SBO: bytes between 8-row groups.
__device__ __forceinline__ u64 smem_desc(const void* start, u32 lbo, u32 sbo) {
    return (u64)((smem_u32(start) & 0x3FFFF) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32) |
           (1ull << 62);
}
// A K-major tile (rows of 64 k values, 128 bytes): its k-th 16-wide slice starts 32 bytes in.
__device__ __forceinline__ u64 kmajor_desc(const bf16_bits* tile, int kslice) {
    return smem_desc(tile + kslice * 16, 16, 1024);
}
// An N-major B tile: BK rows of k, stored as 64-column chunks of BK x 128 bytes each;
// the k-th 16-row slice starts 16 rows (2048 bytes) in.
template <int BK>
__device__ __forceinline__ u64 nmajor_desc(const bf16_bits* tile, int kslice) {
    return smem_desc(tile + kslice * 16 * 64, BK * 128, 1024);
}

// A wgmma's fp32 accumulator registers (64, 96 or 128 of them for N = 128, 192, 256): their places
// in the instruction's text and the asm operands binding them to d[0..] (shared by the
// shared-memory and register-A forms; each longer list extends the shorter).
#define WGMMA_D64_REGS \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15," \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31," \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47," \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define WGMMA_D96_REGS WGMMA_D64_REGS ", " \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79," \
    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define WGMMA_D128_REGS WGMMA_D96_REGS ", " \
    "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111," \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define WGMMA_D8(d, i) \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
    "+f"(d[i + 7])
#define WGMMA_D64_OPERANDS(d) \
    WGMMA_D8(d, 0), WGMMA_D8(d, 8), WGMMA_D8(d, 16), WGMMA_D8(d, 24), WGMMA_D8(d, 32), WGMMA_D8(d, 40), \
    WGMMA_D8(d, 48), WGMMA_D8(d, 56)
#define WGMMA_D96_OPERANDS(d) WGMMA_D64_OPERANDS(d), WGMMA_D8(d, 64), WGMMA_D8(d, 72), WGMMA_D8(d, 80), WGMMA_D8(d, 88)
#define WGMMA_D128_OPERANDS(d) \
    WGMMA_D96_OPERANDS(d), WGMMA_D8(d, 96), WGMMA_D8(d, 104), WGMMA_D8(d, 112), WGMMA_D8(d, 120)
// D(64 x 256, fp32) (+)= A(64 x 16, smem) * B(16 x 256, smem); TRANS_B = 1 when B's tile is N-major.
template <int TRANS_B>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], u64 a_desc, u64 b_desc, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        WGMMA_D128_REGS
        "}, %128, %129, p, 1, 1, 0, %131;\n}\n"
        : WGMMA_D128_OPERANDS(d)
        : "l"(a_desc), "l"(b_desc), "r"(accumulate), "n"(TRANS_B));
}

// D(64 x 128, fp32) (+)= A(64 x 16, smem) * B(16 x 128, smem); TRANS_B = 1 when B's tile is N-major.
template <int TRANS_B>
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], u64 a_desc, u64 b_desc, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        WGMMA_D64_REGS
        "}, %64, %65, p, 1, 1, 0, %67;\n}\n"
        : WGMMA_D64_OPERANDS(d)
        : "l"(a_desc), "l"(b_desc), "r"(accumulate), "n"(TRANS_B));
}

// D(64 x 128, fp32) (+)= A(64 x 32, e4m3, smem) * B(32 x 128, e4m3, smem), both K-major (fp8
// wgmma has no transposed operand).
__device__ __forceinline__ void wgmma_m64n128k32_e4m3(float (&d)[64], u64 a_desc, u64 b_desc, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {"
        WGMMA_D64_REGS
        "}, %64, %65, p, 1, 1;\n}\n"
        : WGMMA_D64_OPERANDS(d)
        : "l"(a_desc), "l"(b_desc), "r"(accumulate));
}

// D(64 x 192, fp32) (+)= A(64 x 16, smem) * B(16 x 192, smem); TRANS_B = 1 when B's tile is N-major.
template <int TRANS_B>
__device__ __forceinline__ void wgmma_m64n192k16(float (&d)[96], u64 a_desc, u64 b_desc, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 {"
        WGMMA_D96_REGS
        "}, %96, %97, p, 1, 1, 0, %99;\n}\n"
        : WGMMA_D96_OPERANDS(d)
        : "l"(a_desc), "l"(b_desc), "r"(accumulate), "n"(TRANS_B));
}

// The accumulator of one warpgroup's 64 x TILE_N fp32 tile: lane l of warp w holds, for each
// 8-column group i, rows 16w + l/4 and 16w + l/4 + 8 at columns 8i + 2(l%4) + {0, 1}.
template <int TILE_N, int TRANS_B>
__device__ __forceinline__ void wgmma_m64k16(float (&d)[TILE_N / 2], u64 a_desc, u64 b_desc, int accumulate) {
    static_assert(TILE_N == 128 || TILE_N == 192 || TILE_N == 256, "wgmma N of 128, 192 or 256");
    if constexpr (TILE_N == 256) wgmma_m64n256k16<TRANS_B>(d, a_desc, b_desc, accumulate);
    else if constexpr (TILE_N == 192) wgmma_m64n192k16<TRANS_B>(d, a_desc, b_desc, accumulate);
    else wgmma_m64n128k16<TRANS_B>(d, a_desc, b_desc, accumulate);
}

// ---- warp roles, clusters, conversions ----

template <int REGS> __device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(REGS));
}
template <int REGS> __device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(REGS));
}
// A barrier among `threads` threads (a multiple of 32) that leaves the others running.
__device__ __forceinline__ void named_barrier(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ u32 cluster_rank() {
    u32 rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    return rank;
}
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {  // round to nearest even
    u32 packed;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(hi), "f"(lo));
    return packed;
}

// Which output tile the `tile`-th job is: GROUP_M rows of tiles at a time, walked column
// by column inside a group, so the CTAs running together share A and B panels in L2.
__device__ __forceinline__ void tile_coords(int tile, int tiles_m, int tiles_n, int group_m, int& tm, int& tn) {
    const int per_group = group_m * tiles_n, first = (tile / per_group) * group_m;
    const int rows = min(tiles_m - first, group_m), in_group = tile % per_group;
    tm = first + in_group % rows;
    tn = in_group / rows;
}

// One warpgroup's 64 x TILE_N accumulator, rounded to bf16, straight to global memory: each
// lane stores 4-byte pairs (the simple epilogue of rungs 2 and 3; N is a multiple of 8).
template <int TILE_N>
__device__ __forceinline__ void store_tile_global(const float (&d)[TILE_N / 2], bf16_bits* C, int M, int N, int row0,
                                                  int col0) {
    const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
#pragma unroll
    for (int i = 0; i < TILE_N / 8; ++i)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = row0 + 16 * warp + lane / 4 + 8 * half, c = col0 + 8 * i + 2 * (lane % 4);
            if (r < M && c < N)
                *reinterpret_cast<u32*>(C + (size_t)r * N + c) = pack_bf16x2(d[4 * i + 2 * half], d[4 * i + 2 * half + 1]);
        }
}



// ---- fused epilogue: bias and activation on the fp32 accumulator, before the one rounding ----

// GELU with erf by Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7, branch-free: one reciprocal
// and one exp on the MUFU unit, eight FMAs), instead of libdevice's erff (two polynomial
// branches, ~25 instructions, both taken when a warp straddles |x| = 1).
__device__ __forceinline__ float gelu_erf(float x) {
    const float z = fabsf(x) * 0.70710678118654752f;
    const float t = __fdividef(1.0f, fmaf(0.3275911f, z, 1.0f));
    const float poly =
        t * fmaf(t, fmaf(t, fmaf(t, fmaf(t, 1.061405429f, -1.453152027f), 1.421413741f), -0.284496736f), 0.254829592f);
    const float erf_abs = 1.0f - poly * __expf(-z * z);
    return 0.5f * x * (1.0f + copysignf(erf_abs, x));
}
// GELU, tanh form: 0.5 x (1 + tanh(u)) = x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3).
__device__ __forceinline__ float gelu_tanh(float x) {
    return x * __fdividef(1.0f, 1.0f + __expf(-1.5957691216057308f * fmaf(0.044715f * x, x * x, x)));
}
__device__ __forceinline__ float silu(float x) { return x * __fdividef(1.0f, 1.0f + __expf(-x)); }

// ACT: 0 none, 1 GELU (erf), 2 GELU (tanh), 3 SiLU.
template <int ACT>
__device__ __forceinline__ float activation(float x) {
    if constexpr (ACT == 1) return gelu_erf(x);
    else if constexpr (ACT == 2) return gelu_tanh(x);
    else if constexpr (ACT == 3) return silu(x);
    else return x;
}

// Columns [first, first + COLS) of the same accumulator into shared memory laid out as
// TMA's 128-byte swizzle expects (COLS/64 chunks of 64 rows x 128 bytes), with stmatrix: one
// instruction stores four 8 x 8 matrices, whose 8 rows land in 8 different 16-byte units, so
// every matrix covers all 32 banks once. (4-byte stores through the generic address of the
// hand-aligned buffer, ptxas's ST.E, took 4x the instructions; at 4096^3 stmatrix cut the
// epilogue from ~2.3K to ~1.9K cycles a tile, measured with scripts/gemm_timeline.py.)
// `first` must be a compile-time constant after unrolling (it indexes registers). On the
// way, the fused epilogue: act(scale[row] value + bias[column]) + residual[row, column] in
// fp32 (ROW_SCALE, BIAS, ACT, RESIDUAL; row0 and col0 are the 64-row slab's first row and
// column, register 4i + 2h + e holds row 16 warp + lane / 4 + 8h and column
// 8i + 2 (lane % 4) + e), computed pair by pair into temporaries just before the rounding,
// so the accumulators stay as they are and the activation's temporaries stay few (writing
// the results back into the accumulator array spilled SiLU at the 168-register cap).
// Bias and residual are read as bf16 pairs (N is even: a pair inside N is whole), the
// residual (M x N, row-major) only inside C.
__device__ __forceinline__ float2 bf16x2_to_float2(u32 pair) {
    return make_float2(__uint_as_float(pair << 16), __uint_as_float(pair & 0xFFFF0000u));
}
// Four 8 x 8 bf16 matrices to shared memory in one instruction: lane l supplies the 16-byte row
// address of row l % 8 of matrix l / 8, and holds in register q the pair of matrix q at row l / 4,
// columns 2 (l % 4) + {0, 1}: the accumulator's own layout, so no shuffles.
__device__ __forceinline__ void stmatrix_x4(void* row, u32 m0, u32 m1, u32 m2, u32 m3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(smem_u32(row)), "r"(m0),
                 "r"(m1), "r"(m2), "r"(m3)
                 : "memory");
}
// The fused epilogue on one accumulator pair (4i + 2h, 4i + 2h + 1), rounded to bf16: row
// 16 warp + lane / 4 + 8h of the slab, column 8i + 2 (lane % 4) of the tile; `b` is that
// column pair's bias (bias_pair).
template <int BIAS, int ACT, int RESIDUAL>
__device__ __forceinline__ u32 epilogue_pair(float v0, float v1, float2 b, int i, int half, int row0, int col0, int M,
                                             int N, const bf16_bits* __restrict__ residual) {
    const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
    const int r = 16 * warp + lane / 4 + 8 * half, col = col0 + 8 * i + 2 * (lane % 4);
    if (BIAS) v0 += b.x, v1 += b.y;  // (+0.0f would not be free: it turns -0 into +0)
    v0 = activation<ACT>(v0), v1 = activation<ACT>(v1);
    if (RESIDUAL && row0 + r < M && col < N) {
        const float2 add =
            bf16x2_to_float2(__ldg(reinterpret_cast<const unsigned int*>(residual + size_t(row0 + r) * N + col)));
        v0 += add.x, v1 += add.y;
    }
    return pack_bf16x2(v0, v1);
}
template <int BIAS>
__device__ __forceinline__ float2 bias_pair(int i, int col0, int N, const bf16_bits* __restrict__ bias) {
    const int col = col0 + 8 * i + 2 * (threadIdx.x % 4);
    return BIAS && col < N ? bf16x2_to_float2(__ldg(reinterpret_cast<const unsigned int*>(bias + col)))
                           : make_float2(0.0f, 0.0f);
}
// Where lane l's stmatrix row address points for column groups (j, j + 1) of a swizzled slice:
// matrices (group j, rows 0-7), (j, rows 8-15), (j + 1, 0-7), (j + 1, 8-15).
__device__ __forceinline__ char* stmatrix_row(bf16_bits* tile, int j) {
    const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
    const int q = lane / 8, r = 16 * warp + lane % 8 + 8 * (q % 2), jq = j + q / 2;
    return reinterpret_cast<char*>(tile) + (jq / 8) * 64 * 128 + r * 128 + ((jq % 8) ^ (r % 8)) * 16;
}
// ROW_SCALE: each accumulator row first times its factor, scale.x for this thread's row
// 16 warp + lane / 4, scale.y for the row 8 below (rung 4's RMSNorm, NORM_A).
template <int TILE_N, int COLS, int BIAS = 0, int ACT = 0, int RESIDUAL = 0, int ROW_SCALE = 0>
__device__ __forceinline__ void store_cols_swizzled(const float (&d)[TILE_N / 2], bf16_bits* tile, int first,
                                                    int row0 = 0, int col0 = 0, int M = 0, int N = 0,
                                                    const bf16_bits* __restrict__ bias = nullptr,
                                                    const bf16_bits* __restrict__ residual = nullptr,
                                                    float2 scale = make_float2(1.0f, 1.0f)) {
    auto pair = [&](int i, int half, float2 b) {
        const float s = half ? scale.y : scale.x;
        return epilogue_pair<BIAS, ACT, RESIDUAL>(ROW_SCALE ? d[4 * i + 2 * half] * s : d[4 * i + 2 * half],
                                                  ROW_SCALE ? d[4 * i + 2 * half + 1] * s : d[4 * i + 2 * half + 1],
                                                  b, i, half, row0, col0, M, N, residual);
    };
#pragma unroll
    for (int j = 0; j < COLS / 8; j += 2) {
        const int i = first / 8 + j;
        const float2 b0 = bias_pair<BIAS>(i, col0, N, bias);
        const u32 m0 = pair(i, 0, b0), m1 = pair(i, 1, b0);
        const float2 b1 = bias_pair<BIAS>(i + 1, col0, N, bias);
        stmatrix_x4(stmatrix_row(tile, j), m0, m1, pair(i + 1, 0, b1), pair(i + 1, 1, b1));
    }
}
// The same in two halves, for an epilogue that overlaps the next tile's k-loop: first the whole
// accumulator through the fused epilogue into bf16 pairs (pair 2i + h: group i, half h) ...
template <int TILE_N, int BIAS = 0, int ACT = 0, int RESIDUAL = 0, int ROW_SCALE = 0>
__device__ __forceinline__ void pack_tile(const float (&d)[TILE_N / 2], u32 (&packed)[TILE_N / 4], int row0, int col0,
                                          int M, int N, const bf16_bits* __restrict__ bias,
                                          const bf16_bits* __restrict__ residual, float2 scale) {
#pragma unroll
    for (int i = 0; i < TILE_N / 8; ++i) {
        const float2 b = bias_pair<BIAS>(i, col0, N, bias);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const float s = half ? scale.y : scale.x;
            packed[2 * i + half] = epilogue_pair<BIAS, ACT, RESIDUAL>(
                ROW_SCALE ? d[4 * i + 2 * half] * s : d[4 * i + 2 * half],
                ROW_SCALE ? d[4 * i + 2 * half + 1] * s : d[4 * i + 2 * half + 1], b, i, half, row0, col0, M, N,
                residual);
        }
    }
}
// ... then columns [first, first + COLS) of it into a swizzled slice, whenever there is time.
template <int TILE_N, int COLS>
__device__ __forceinline__ void store_packed_swizzled(const u32 (&packed)[TILE_N / 4], bf16_bits* tile, int first) {
#pragma unroll
    for (int j = 0; j < COLS / 8; j += 2) {
        const int i = first / 8 + j;
        stmatrix_x4(stmatrix_row(tile, j), packed[2 * i], packed[2 * i + 1], packed[2 * i + 2], packed[2 * i + 3]);
    }
}

// ---- RMSNorm on the A operand (rung 4's NORM_A): A through registers ----

// Four 8 x 8 bf16 matrices from shared memory; lane l gives the 16-byte row address of row l % 8
// of matrix l / 8 and gets back, in register q, matrix q's pair at row l / 4, columns 2 (l % 4)
// + {0, 1}: with matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15,
// k 8-15) of a warp's 16 rows, exactly wgmma's register A fragment for a k16 slice.
__device__ __forceinline__ void ldmatrix_x4(const void* row, u32 (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(row)));
}
__device__ __forceinline__ u32 mul_bf16x2(u32 a, u32 b) {  // each half a * b rounded to nearest even
    u32 d;
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
// D(64 x TILE_N, fp32) (+)= A(64 x 16, registers: this warp's 16 rows as `a`) * B(16 x TILE_N, smem).
template <int TILE_N, int TRANS_B>
__device__ __forceinline__ void wgmma_m64k16_rs(float (&d)[TILE_N / 2], const u32 (&a)[4], u64 b_desc, int accumulate) {
    static_assert(TILE_N == 192 || TILE_N == 256, "register-A wgmma N of 192 or 256");
    if constexpr (TILE_N == 256)
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
            WGMMA_D128_REGS
            "}, {%128, %129, %130, %131}, %132, p, 1, 1, %134;\n}\n"
            : WGMMA_D128_OPERANDS(d)
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(accumulate), "n"(TRANS_B));
    else
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %101, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 {"
            WGMMA_D96_REGS
            "}, {%96, %97, %98, %99}, %100, p, 1, 1, %102;\n}\n"
            : WGMMA_D96_OPERANDS(d)
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(accumulate), "n"(TRANS_B));
}
// One k-tile (64 k) of this warp's 16 A rows from a swizzled K-major tile (`rows`: the warp's first
// row) as wgmma's register fragments: x[ks] holds k16 slice ks, (row lane / 4, k 2 (lane % 4) + {0, 1})
// in x[ks][0], row + 8 in [1], k + 8 in [2], both in [3] (wgmma's A fragment layout).
__device__ __forceinline__ void ldmatrix_a_ktile(const bf16_bits* rows, u32 (&x)[4][4]) {
    const int lane = threadIdx.x % 32, row = lane % 8 + 8 * ((lane / 8) % 2);
    const char* base = reinterpret_cast<const char*>(rows) + row * 128;
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) ldmatrix_x4(base + (((2 * ks + lane / 16) ^ (row % 8)) * 16), x[ks]);
}
// The squares of a k-tile of x (ldmatrix_a_ktile's layout) added to this thread's row sums in fp32:
// row lane / 4 in .x and .z, lane / 4 + 8 in .y and .w (four chains of FMAs, not two); a quad's 4 lanes
// split each row's k values between them.
__device__ __forceinline__ void add_squares(const u32 (&x)[4][4], float4& sums) {
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const float2 v = bf16x2_to_float2(x[ks][q]);
            float& sum = q == 0 ? sums.x : q == 1 ? sums.y : q == 2 ? sums.z : sums.w;
            sum = fmaf(v.x, v.x, fmaf(v.y, v.y, sum));
        }
}

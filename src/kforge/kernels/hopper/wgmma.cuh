// Hopper parts: wgmma, a warpgroup (4 warps) multiplying 64 x K16 (bf16) or 64 x K32 (e4m3) by
// K x N from shared memory (A optionally from registers) into fp32 accumulator registers, asynchronously:
// fence, issue, commit a group, wait for all but N groups. Also the shared-memory matrix descriptors.
// Why a part: the instructions' operand lists are 64-128 registers long and the descriptor bits are easy
// to get wrong; the kernels name a shape and a layout instead.
//
// Shared-memory layout: operand tiles are written by TMA with the 128-byte swizzle, so a tile is a
// stack of 128-byte rows (64 bf16 values) in which 16-byte unit u of row r sits at unit u ^ (r % 8).
// Eight rows (1024 bytes) make one swizzle atom, so tiles start at 1024-byte boundaries. wgmma reads
// the same layout through a 64-bit descriptor (start address, LBO, SBO, swizzle mode).
#pragma once
#include "common.cuh"

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

// A 128-byte-swizzled K-major tile of e4m3 (rows of 128 values); the k-th 32-wide slice starts 32 bytes in.
__device__ __forceinline__ u64 fp8_desc(const unsigned char* tile, int kslice) {
    return smem_desc(tile + 32 * kslice, 16, 1024);
}

// Blackwell (sm_100a) building blocks for tcgen05_gemm.cu and nvfp4_gemm.cu: one thin wrapper per PTX
// instruction, on top of the Hopper ones (mbarriers, TMA) in ../gemm_bf16/hopper.cuh. PTX ISA 8.7+.
//
// What Blackwell changes against Hopper's wgmma:
// - The accumulator lives in TENSOR MEMORY (TMEM), 512 columns x 128 lanes of 32-bit cells per SM,
//   not in registers. A warp allocates columns (tcgen05.alloc, a power of two >= 32), the MMA writes
//   them, and the epilogue copies them to registers (tcgen05.ld). Warp w of a CTA may only touch
//   lanes 32 (w % 4) .. 32 (w % 4) + 31. A TMEM address is (lane << 16) | column.
// - ONE thread issues the MMA (tcgen05.mma), asynchronously; it is tracked like a TMA: tcgen05.commit
//   makes an mbarrier arrive once every MMA this thread issued before it has finished.
// - Two CTAs of a cluster (a "CTA pair", cta_group::2) can run one MMA of M = 256 together: each holds
//   128 rows of A and half of B's columns in its shared memory and 128 rows of D in its TMEM; the
//   even CTA (the leader) issues it.
// - Block-scaled MMA (kind::mxf4nvf4) reads 4-bit operands from shared memory and their scale
//   factors from TMEM, copied there from shared memory by tcgen05.cp.
#pragma once

#include "../gemm_bf16/hopper.cuh"

// tcgen05 exists on the sm_100 family only. Compiled for anything else (kforge compiles every kernel
// for sm_90a as a smoke test) a kernel's body is replaced by a trap: no wrong answer can come from it.
#if defined(__CUDA_ARCH_FAMILY_SPECIFIC__) && __CUDA_ARCH_FAMILY_SPECIFIC__ == 1000
#define KFORGE_SM100 1
#else
#define KFORGE_SM100 0
#endif

// One lane of the (converged) warp is chosen. The whole warp runs a role's loop, so every value it
// computes is warp-uniform and lives in uniform registers, where tcgen05 and TMA take their operands;
// only the issue is one lane's. (A loop run by `lane == 0` alone makes ptxas wrap each such
// instruction in a loop over the active lanes, ELECT ... BRA.U.ANY, as it cannot prove uniformity.)
__device__ __forceinline__ bool elect_one() {
    u32 elected;
    asm volatile("{\n.reg .pred p;\nelect.sync _|p, 0xffffffff;\nselp.u32 %0, 1, 0, p;\n}" : "=r"(elected));
    return elected != 0;
}

// ---- clusters (cluster_rank and cluster_sync are hopper.cuh's) ----

// The shared::cluster address of the object at `p`'s offset in CTA `cta` of this cluster.
__device__ __forceinline__ u32 cluster_address(const void* p, u32 cta) {
    u32 remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_u32(p)), "r"(cta));
    return remote;
}

// A TMA box load whose completion is counted on the barrier of the CTA pair's leader (`leader_bar`,
// a shared::cluster address): the leader's MMA needs both halves of the pair's operands.
__device__ __forceinline__ void tma_load_2d_pair(void* dst, const TensorMap& map, u32 leader_bar, int col, int row) {
    asm volatile(
        "cp.async.bulk.tensor.2d.cta_group::2.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4}], [%2];" ::"r"(smem_u32(dst)),
        "l"(reinterpret_cast<u64>(&map)), "r"(leader_bar), "r"(col), "r"(row)
        : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx_remote(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cluster.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive_remote(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(bar) : "memory");
}

// ---- tensor memory ----

// CTA_GROUP is 1 (this CTA's TMEM) or 2 (the same columns in both CTAs of the pair; both CTAs' warps
// with the same warp index execute it). The address lands in shared memory at `slot`.
template <int CTA_GROUP>
__device__ __forceinline__ void tmem_alloc(u32* slot, u32 columns) {
    asm volatile("tcgen05.alloc.cta_group::%2.sync.aligned.shared::cta.b32 [%0], %1;" ::"r"(smem_u32(slot)),
                 "r"(columns), "n"(CTA_GROUP)
                 : "memory");
    // this CTA allocates once: let the other CTAs on the SM allocate without waiting for us
    asm volatile("tcgen05.relinquish_alloc_permit.cta_group::%0.sync.aligned;" ::"n"(CTA_GROUP));
}
template <int CTA_GROUP>
__device__ __forceinline__ void tmem_dealloc(u32 address, u32 columns) {
    asm volatile("tcgen05.dealloc.cta_group::%2.sync.aligned.b32 %0, %1;" ::"r"(address), "r"(columns),
                 "n"(CTA_GROUP)
                 : "memory");
}
// Thread syncs (barriers, mbarrier waits) do not order tcgen05 operations by themselves: these fences
// put the asynchronous tcgen05 work before (after) the sync in the order other threads observe.
__device__ __forceinline__ void tcgen05_before_sync() { asm volatile("tcgen05.fence::before_thread_sync;" ::: "memory"); }
__device__ __forceinline__ void tcgen05_after_sync() { asm volatile("tcgen05.fence::after_thread_sync;" ::: "memory"); }

// 32 consecutive columns of this warp's 32 lanes: lane i of the warp gets TMEM lane (address's lane + i),
// columns address .. address + 31, in v[0..31]. Asynchronous until tmem_wait_loads().
__device__ __forceinline__ void tmem_load_32cols(u32 address, u32 (&v)[32]) {
    asm volatile(
        "tcgen05.ld.sync.aligned.32x32b.x32.b32 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, "
        "%15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, [%32];"
        : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3]), "=r"(v[4]), "=r"(v[5]), "=r"(v[6]), "=r"(v[7]),
          "=r"(v[8]), "=r"(v[9]), "=r"(v[10]), "=r"(v[11]), "=r"(v[12]), "=r"(v[13]), "=r"(v[14]), "=r"(v[15]),
          "=r"(v[16]), "=r"(v[17]), "=r"(v[18]), "=r"(v[19]), "=r"(v[20]), "=r"(v[21]), "=r"(v[22]), "=r"(v[23]),
          "=r"(v[24]), "=r"(v[25]), "=r"(v[26]), "=r"(v[27]), "=r"(v[28]), "=r"(v[29]), "=r"(v[30]), "=r"(v[31])
        : "r"(address));
}
__device__ __forceinline__ void tmem_wait_loads() { asm volatile("tcgen05.wait::ld.sync.aligned;" ::: "memory"); }

// ---- shared-memory matrix descriptors (64 bits; the sm_100 format) ----
//
// bits  0-13  start address >> 4          bits 16-29  leading-dimension byte offset >> 4
// bits 32-45  stride-dimension byte offset >> 4 (between 8-row groups)
// bits 46-47  version: 1 on sm_100        bits 49-51  base offset (0: tiles start on 1024-byte boundaries)
// bits 61-63  layout: 0 none, 2 128-byte swizzle
// A K-major operand tile written by TMA with the 128-byte swizzle is the Hopper one (hopper.cuh): rows of
// 128 bytes, 8-row atoms of 1024 bytes, so SBO = 1024 and LBO is unused (one atom spans the tile's K).
// Moving along K inside the 128-byte row moves the start address; the hardware applies the swizzle
// to the address it computes, which is why the tile must sit on a 1024-byte boundary.
__device__ __forceinline__ u64 umma_desc(u32 start, u32 lbo, u32 sbo, u32 layout) {
    return (u64)((start & 0x3FFFF) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32) | (1ull << 46) |
           ((u64)layout << 61);
}
#define UMMA_SWIZZLE_128B 2
#define UMMA_NO_SWIZZLE 0
// The descriptor of a K-major, 128-byte-swizzled tile, `k_bytes` into its rows.
__device__ __forceinline__ u64 kmajor_sw128_desc(const void* tile, u32 k_bytes) {
    return umma_desc(smem_u32(tile) + k_bytes, 16, 1024, UMMA_SWIZZLE_128B);
}

// ---- the MMA ----

// D[tmem] (+)= A[smem] x B[smem]^T, bf16 inputs (kind::f16), fp32 D; `accumulate` 0 overwrites D.
// One thread issues it; it runs asynchronously until a later tcgen05.commit's barrier fires.
template <int CTA_GROUP>
__device__ __forceinline__ void umma_bf16(u32 d_tmem, u64 a_desc, u64 b_desc, u32 idesc, u32 accumulate) {
    asm volatile(
        "{\n.reg .pred acc;\n"
        "setp.ne.b32 acc, %4, 0;\n"
        "tcgen05.mma.cta_group::%5.kind::f16 [%0], %1, %2, %3, acc;\n}" ::"r"(d_tmem),
        "l"(a_desc), "l"(b_desc), "r"(idesc), "r"(accumulate), "n"(CTA_GROUP)
        : "memory");
}

// Once every tcgen05 operation this thread issued before has completed, arrive once on `bar` (this
// CTA's), or, for a pair, on the barrier at `bar`'s offset in every CTA of `cta_mask`.
__device__ __forceinline__ void umma_commit(u64* bar) {
    asm volatile("tcgen05.commit.cta_group::1.mbarrier::arrive::one.shared::cluster.b64 [%0];" ::"r"(smem_u32(bar))
                 : "memory");
}
__device__ __forceinline__ void umma_commit_pair(u64* bar, unsigned short cta_mask) {
    asm volatile(
        "tcgen05.commit.cta_group::2.mbarrier::arrive::one.shared::cluster.multicast::cluster.b64 [%0], %1;" ::"r"(
            smem_u32(bar)),
        "h"(cta_mask)
        : "memory");
}

// ---- the epilogue ----

// Two fp32 accumulator cells (as tcgen05.ld returns them, bit patterns) -> a bf16 pair.
__device__ __forceinline__ u32 pack_bits(u32 lo, u32 hi) { return pack_bf16x2(__uint_as_float(lo), __uint_as_float(hi)); }
__device__ __forceinline__ void stg_128(void* p, u32 a, u32 b, u32 c, u32 d) {
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}

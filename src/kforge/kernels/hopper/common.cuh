// Hopper parts, common ground: the integer types, the tensor-map argument, shared-memory access that
// stays in the shared window, the launch check, and the warp-role and cluster instructions every
// warp-specialized kernel uses. The other parts (pipeline, tma, wgmma, scheduler, epilogue, norm_a)
// include this one; each can be included alone. PTX ISA 8.x, sm_90a.
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
__device__ __forceinline__ float2 bf16x2_to_float2(u32 pair) {
    return make_float2(__uint_as_float(pair << 16), __uint_as_float(pair & 0xFFFF0000u));
}

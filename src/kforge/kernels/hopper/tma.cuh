// Hopper parts: TMA, the copy engine. Bulk tensor copies global -> shared (counted on an mbarrier as
// bytes, so the consumer waits on the barrier, not on the copy), the multicast form that writes the
// same box into every CTA of a cluster, 1-D bulk copies, and the shared -> global tensor store with its
// bulk groups. Why a part: every Hopper kernel feeds its ring this way; the producer's loop is then a
// list of boxes. Coordinates are (column, row) in elements; boxes outside the tensor read as zeros and
// are not written.
#pragma once
#include "common.cuh"

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

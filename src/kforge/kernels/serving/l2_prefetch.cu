// Bring up to four byte ranges of global memory into L2, asynchronously: one cp.async.bulk.prefetch.L2
// (sm_90) per CHUNK bytes, each thread of the grid issuing its share and exiting. Nothing waits for the
// data: the memory system fills L2 while whatever runs next runs, and a later kernel that reads those
// bytes finds them there (a hint: lines evicted first are read from HBM as usual).
//
// Why: a decode step at batch 1 reads each weight once, but between its weight-streaming GEMVs sit
// kernels that barely touch HBM (attention over a short context, norms, RoPE); the next GEMV's
// bytes can arrive in L2 during them instead of after its own ramp. l2_prefetch.py says what it buys.
//
// Ranges must start on 16 bytes and be multiples of 16 bytes long (the instruction's rule; the
// wrapper rounds the length down) and under 2 GiB. A range of 0 bytes issues nothing.

typedef unsigned long long u64;

__device__ __forceinline__ void prefetch_range(const char* base, u64 bytes, u64 first, u64 step, u64 chunk) {
    for (u64 offset = first * chunk; offset < bytes; offset += step * chunk) {
        const unsigned size = static_cast<unsigned>(bytes - offset < chunk ? bytes - offset : chunk);
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(base + offset), "r"(size) : "memory");
    }
}

extern "C" __global__ void l2_prefetch(const char* a, const char* b, const char* c, const char* d, int a_bytes,
                                       int b_bytes, int c_bytes, int d_bytes, int chunk) {
    const u64 first = blockIdx.x * static_cast<u64>(blockDim.x) + threadIdx.x;
    const u64 step = static_cast<u64>(gridDim.x) * blockDim.x;
    prefetch_range(a, a_bytes, first, step, chunk);
    prefetch_range(b, b_bytes, first, step, chunk);
    prefetch_range(c, c_bytes, first, step, chunk);
    prefetch_range(d, d_bytes, first, step, chunk);
}

// A read-only stream: every 16-byte word of a buffer loaded once (no L1 allocation), CHUNK
// loads in flight per thread, folded with xor so nothing is dead code. gemv_sweep.py times it
// on the bytes of each W as the best any one-pass reader of that many bytes can do in one
// launch (launch, first-byte latency and tail included), beside a copy of the same bytes.
#ifndef CHUNK
#define CHUNK 8
#endif

extern "C" __global__ void __launch_bounds__(256) read_stream(const uint4* __restrict__ src, long long words,
                                                              unsigned int* __restrict__ sink) {
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    unsigned int folded = 0;
    for (; i + stride * (CHUNK - 1) < words; i += stride * CHUNK) {
        uint4 v[CHUNK];
#pragma unroll
        for (int c = 0; c < CHUNK; ++c)
            asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                         : "=r"(v[c].x), "=r"(v[c].y), "=r"(v[c].z), "=r"(v[c].w) : "l"(src + i + stride * c));
#pragma unroll
        for (int c = 0; c < CHUNK; ++c) folded ^= v[c].x ^ v[c].y ^ v[c].z ^ v[c].w;
    }
    for (; i < words; i += stride) {
        uint4 v = src[i];
        folded ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (folded == 0x9E3779B9u) sink[0] = folded;  // almost never: keeps the loads alive
}

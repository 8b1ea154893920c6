// Programmatic dependent launch (kforge/runtime/pdl.py): what a kernel built with PDL=1 runs.
// Under PDL the kernel may start while the kernel before it in the stream is finishing, so:
// before pdl_wait it may only prefetch its own weights (read-only for the whole step), and it
// reads or writes nothing else; pdl_wait returns once the kernels before it have completed and
// their writes are visible. No kernel signals its dependents early (griddepcontrol.
// launch_dependents): the next one launches as this one's blocks exit (runtime/pdl.py says why).
// In a build without PDL these are empty.
#pragma once

#ifndef PDL
#define PDL 0
#endif
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 2048  // of each weight row, into L2 before the wait: a warp's first step of a row
#endif
#define PDL_ON (PDL && __CUDA_ARCH__ >= 900)

__device__ __forceinline__ void pdl_wait() {
#if PDL_ON
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// The first min(bytes, PREFETCH_BYTES) bytes at p (16-byte aligned; a multiple of 16 is asked) into L2:
// one bulk prefetch, the copy engine's work, no registers held.
__device__ __forceinline__ void pdl_prefetch_row(const void* p, unsigned bytes) {
#if PDL_ON
    const unsigned asked = (bytes < PREFETCH_BYTES ? bytes : PREFETCH_BYTES) & ~15u;
    if (asked) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(asked) : "memory");
#endif
}

// One line at p (any alignment) into L2: for a row's scales.
__device__ __forceinline__ void pdl_prefetch_line(const void* p) {
#if PDL_ON
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p) : "memory");
#endif
}

// Hopper building blocks for the bf16 GEMM rungs, the FP8 GEMM (quant/fp8_block_gemm.cu) and the
// kernels built on them: all of ../hopper/, one header. Each part there is small and can be included
// alone; this header stays for the includers that want every instruction wrapper at once.
//   common.cuh    types, the tensor map, shared-memory access, the launch check, warp roles, clusters
//   tma.cuh       TMA loads (plain, multicast, 1-D bulk) and stores, bulk groups
//   pipeline.cuh  mbarriers and the stage ring (full/empty barriers, phase tracking)
//   wgmma.cuh     wgmma (bf16 from shared memory or registers, e4m3) and the matrix descriptors
//   scheduler.cuh the persistent tile scheduler: grouped order, whole tiles, split-K, stream-K
//   epilogue.cuh  bias, activations, residual, row scale; swizzled stores, the slice buffers, overlap
//   norm_a.cuh    RMSNorm on A through registers (ldmatrix fragments, gamma, sums of squares)
// PTX ISA 8.x, sm_90a.
#pragma once

#include "../hopper/common.cuh"
#include "../hopper/tma.cuh"
#include "../hopper/pipeline.cuh"
#include "../hopper/wgmma.cuh"
#include "../hopper/scheduler.cuh"
#include "../hopper/epilogue.cuh"
#include "../hopper/norm_a.cuh"

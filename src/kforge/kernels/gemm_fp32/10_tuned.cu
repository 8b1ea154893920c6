// Rung 10: tuned. Rung 9's kernel with the parameters a sweep picked: every (rung, shape)
// in kforge.kernels.gemm_fp32.SWEEP, timed at 4096^3 on an H100 by
//     kforge ladder gemm --dtype fp32 --size 4096 --sweep
// (results in benchmarks/results/<device>/ladder-gemm-fp32-sweep.jsonl).
// What changed: only numbers. Why: the best tile shape trades registers per thread
// (more reuse) against warps per SM (more latency hiding), and the ring's depth and
// tile length trade barriers against shared memory; the balance depends on the GPU.
// Predicted: a few % over rung 9. Measured on the H100 at 4096^3 (two sweeps, 29 shapes,
// 71-93% of cuBLAS): 8 warps of 64 x 64, 8 x 16 per thread (~225 registers, one block
// per SM), k-tiles of 32 in a 3-deep ring (149 KB of shared memory) won at 93.1%. The
// same shape with BK = 16 made 88.4%, and with BK = 32 but 2 stages 82.5%: half the
// barriers only pay when the copies are two tiles ahead. cuBLAS's own kernel (seen in
// ncu) is the same idea: 256 x 128 x 8, 3 stages, 8 warps, 8 x 16 per thread.
#define BM 128
#define BN 256
#define BK 32
#define WM 64
#define WN 64
#define WNITER 4
#define TM 4
#define TN 4
#define NUM_THREADS 256
#define STAGES 3
#define GROUP_M 1
#define MIN_BLOCKS 1
#include "09_async_copy.cu"

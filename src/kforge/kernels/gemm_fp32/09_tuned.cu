// Rung 9: tuned. Rung 8's kernel with the parameters a sweep picked: every shape in
// kforge.kernels.gemm_fp32.SWEEP, timed at 4096^3 on an H100 by
//     kforge ladder gemm --dtype fp32 --size 4096 --sweep
// (results in benchmarks/results/<device>/gemm_fp32_sweep.jsonl).
// What changed: only numbers. Why: the best tile shape trades registers per thread
// (more reuse) against blocks per SM (more latency hiding), and it depends on the GPU.
// Predicted: a few % over rung 8.
#define BM 128
#define BN 256
#define BK 8
#define WM 64
#define WN 64
#define WNITER 4
#define TM 4
#define TN 4
#define NUM_THREADS 256
#define GROUP_M 1
#define MIN_BLOCKS 1
#include "08_warptiling.cu"

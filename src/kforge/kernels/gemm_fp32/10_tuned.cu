// Rung 10: tuned. Rung 9's kernel with the parameters a sweep picked: every (rung, shape)
// in kforge.kernels.gemm_fp32.SWEEP, timed at 4096^3 on an H100 by
//     kforge ladder gemm --dtype fp32 --size 4096 --sweep
// (results in benchmarks/results/<device>/ladder-gemm-fp32-sweep.jsonl).
// What changed: only numbers. Why: the best tile shape trades registers per thread
// (more reuse) against blocks per SM (more latency hiding), and it depends on the GPU.
// Predicted: a few % over rung 9. Measured: PENDING (the sweep has not run on rung 9 yet;
// these are rung 8's best shape with a 3-deep ring).
#define BM 128
#define BN 256
#define BK 16
#define WM 64
#define WN 32
#define WNITER 2
#define TM 4
#define TN 4
#define NUM_THREADS 512
#define STAGES 3
#define GROUP_M 1
#define MIN_BLOCKS 1
#include "09_async_copy.cu"

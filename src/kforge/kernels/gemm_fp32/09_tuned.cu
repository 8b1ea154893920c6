// Rung 9: tuned. Rung 8's kernel with the parameters a sweep picked: every shape in
// kforge.kernels.gemm_fp32.SWEEP, timed at 4096^3 on an H100 by
//     kforge ladder gemm --dtype fp32 --size 4096 --sweep
// (results in benchmarks/results/<device>/gemm_fp32_sweep.jsonl).
// What changed: only numbers. Why: the best tile shape trades registers per thread
// (more reuse) against blocks per SM (more latency hiding), and it depends on the GPU.
// Predicted: a few % over rung 8. Measured on the H100 at 4096^3: the sweep's shapes
// span 78-87% of cuBLAS; the 128 x 256 x 16 block of 16 warps, 8 x 8 per thread, won
// (86.5%). It caps registers at 128 (512 threads fill the register file), so ptxas
// spills 12 bytes; shapes with 8 x 16 per thread need ~245 registers and ran no faster.
#define BM 128
#define BN 256
#define BK 16
#define WM 64
#define WN 32
#define WNITER 2
#define TM 4
#define TN 4
#define NUM_THREADS 512
#define GROUP_M 1
#define MIN_BLOCKS 1
#include "08_warptiling.cu"

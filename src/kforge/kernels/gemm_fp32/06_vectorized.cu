// Rung 6: vectorized 16-byte loads, A transposed in shared memory.
// What changed: global loads and C stores move float4s (LDG.128/STG.128: a quarter of the
// instructions); A's tile is stored transposed (As[k][m]), so a thread's TM values of A
// for one k are contiguous and, like its TN values of B, come in as float4 shared loads.
// Why: rung 5 issued one instruction per float everywhere; instruction issue, not
// bandwidth, was what the warps waited on. Tails (sizes not multiples of 4, or of the
// tile) take checked scalar loads in load4/store4.
// Predicted: 1.3-1.6x over rung 5.
#include "common.cuh"

#ifndef BM
#define BM 128
#endif
#ifndef BN
#define BN 128
#endif
#ifndef BK
#define BK 8
#endif
#ifndef TM
#define TM 8
#endif
#ifndef TN
#define TN 8
#endif
#define NUM_THREADS (BM * BN / (TM * TN))
static_assert((BM * BK / 4) % NUM_THREADS == 0 && (BN * BK / 4) % NUM_THREADS == 0, "tiles load in whole rounds");

extern "C" __global__ void __launch_bounds__(NUM_THREADS)
sgemm(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C, int M, int N, int K) {
    __shared__ __align__(16) float As[BK][BM];  // transposed: As[k][m]
    __shared__ __align__(16) float Bs[BK][BN];
    const int t = threadIdx.x;
    const int row0 = blockIdx.y * BM, col0 = blockIdx.x * BN;
    const int trow = (t / (BN / TN)) * TM, tcol = (t % (BN / TN)) * TN;
    const bool a_aligned = K % 4 == 0 && reinterpret_cast<size_t>(A) % 16 == 0;
    const bool b_aligned = N % 4 == 0 && reinterpret_cast<size_t>(B) % 16 == 0;
    const bool c_aligned = N % 4 == 0 && reinterpret_cast<size_t>(C) % 16 == 0;

    float acc[TM][TN] = {{0.f}};
    float a[TM], b[TN];
    static_assert(TM % 4 == 0 && TN % 4 == 0, "fragments load as float4s");
    for (int k0 = 0; k0 < K; k0 += BK) {
#pragma unroll
        for (int i = t; i < BM * BK / 4; i += NUM_THREADS) {
            const int r = i / (BK / 4), c = (i % (BK / 4)) * 4;
            const float4 v = load4(A, row0 + r, k0 + c, M, K, K, a_aligned);
            As[c + 0][r] = v.x; As[c + 1][r] = v.y; As[c + 2][r] = v.z; As[c + 3][r] = v.w;
        }
#pragma unroll
        for (int i = t; i < BK * BN / 4; i += NUM_THREADS) {
            const int r = i / (BN / 4), c = (i % (BN / 4)) * 4;
            *reinterpret_cast<float4*>(&Bs[r][c]) = load4(B, k0 + r, col0 + c, K, N, N, b_aligned);
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < BK; ++k) {
#pragma unroll
            for (int i = 0; i < TM; i += 4) {
                const float4 v = lds4(&As[k][trow + i]);
                a[i] = v.x; a[i + 1] = v.y; a[i + 2] = v.z; a[i + 3] = v.w;
            }
#pragma unroll
            for (int j = 0; j < TN; j += 4) {
                const float4 v = lds4(&Bs[k][tcol + j]);
                b[j] = v.x; b[j + 1] = v.y; b[j + 2] = v.z; b[j + 3] = v.w;
            }
#pragma unroll
            for (int i = 0; i < TM; ++i)
#pragma unroll
                for (int j = 0; j < TN; ++j) acc[i][j] += a[i] * b[j];
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; j += 4)
            store4(C, make_float4(acc[i][j], acc[i][j + 1], acc[i][j + 2], acc[i][j + 3]),
                   row0 + trow + i, col0 + tcol + j, M, N, N, c_aligned);
}

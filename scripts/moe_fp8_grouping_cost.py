"""What grouping costs the CUDA FP8 GEMM: DeepGEMM's contiguous 4 x 8192 rows, N 4096, K 7168.

    PYTHONPATH=src:scripts python scripts/moe_fp8_grouping_cost.py

What the grouped build (`fp8_grouped_gemm_contiguous`, no clusters) loses against the same
kernel ungrouped, and where it stands against the loops of `_scaled_mm`: on the same rows and
the same block scales (every expert's run a whole number of tiles: no padding), kernel-alone
(device_timing.median_ms: L2 flushed, events around the call): the grouped build; the plain
build (`fp8_block_gemm`) once per expert, with and without its 2-CTA cluster; the plain build
on all 32768 rows against one expert's weights (the ungrouped bound: the same tiles, no
expert lookups, one launch); and the `_scaled_mm` loops. Prints ms and TFLOP/s.
Measured: benchmarks/results/nvidia-h200/moe-fp8-grouping-cost.txt.
"""

import kforge  # noqa: F401  (before triton)

import torch

from device_timing import median_ms
from kforge.kernels.quant.fp8_block_gemm import fp8_block_gemm, fp8_grouped_gemm_contiguous

G, M, N, K, BLOCK = 4, 8192, 4096, 7168, 128


def e4m3(*shape):
    return (64 * torch.randn(*shape, device="cuda")).clamp_(-448, 448).to(torch.float8_e4m3fn)


def main():
    x, weight = e4m3(G * M, K), e4m3(G, N, K)
    x_scale = torch.full((G * M, K // BLOCK), 2.0**-6, device="cuda")
    w_scale = torch.full((G, N // BLOCK, K // BLOCK), 2.0**-13, device="cuda")
    m_indices = torch.arange(G, dtype=torch.int32, device="cuda").repeat_interleave(M)
    out = torch.empty(G * M, N, dtype=torch.bfloat16, device="cuda")
    row_a, row_b = torch.full((M, 1), 2.0**-6, device="cuda"), torch.full((1, N), 2.0**-13, device="cuda")
    rows = [slice(g * M, (g + 1) * M) for g in range(G)]
    scale_t = [x_scale[r].t().contiguous().t() for r in rows]  # M-major, as cuBLAS's block scaling reads it

    def per_expert(cluster):
        return lambda: [fp8_block_gemm(x[r], weight[g], x_scale[r], w_scale[g], cluster=cluster)
                        for g, r in enumerate(rows)]

    def scaled_mm(block):
        def run():
            for g, r in enumerate(rows):
                if block:
                    torch._scaled_mm(x[r], weight[g].t(), scale_a=scale_t[g], scale_b=w_scale[g].t(),
                                     out_dtype=torch.bfloat16, out=out[r])
                else:
                    torch._scaled_mm(x[r], weight[g].t(), scale_a=row_a, scale_b=row_b, out_dtype=torch.bfloat16,
                                     out=out[r])
        return run

    fns = {
        "grouped CUDA (contiguous, no cluster)": lambda: fp8_grouped_gemm_contiguous(x, weight, m_indices, x_scale,
                                                                                      w_scale),
        "plain CUDA per expert, cluster 2": per_expert(2),
        "plain CUDA per expert, cluster 1": per_expert(1),
        "plain CUDA, all rows, one expert, cluster 2": lambda: fp8_block_gemm(x, weight[0], x_scale, w_scale[0]),
        "plain CUDA, all rows, one expert, cluster 1": lambda: fp8_block_gemm(x, weight[0], x_scale, w_scale[0],
                                                                              cluster=1),
        "_scaled_mm loop, block scales": scaled_mm(True),
        "_scaled_mm loop, row-wise": scaled_mm(False),
    }
    grouped = fns["grouped CUDA (contiguous, no cluster)"]()
    for g, r in enumerate(rows):  # the study is worth nothing if the grouped rows are not each expert's product
        expected = fp8_block_gemm(x[r], weight[g], x_scale[r], w_scale[g])
        torch.testing.assert_close(grouped[r], expected, atol=1e-2, rtol=1e-2)
    for fn in fns.values():
        fn()
    flops = 2 * G * M * N * K
    for trial in (1, 2):  # two runs: the spread between them is the noise
        times = median_ms(fns, rounds=30)
        print(f"run {trial}: {G} x {M} rows, N {N}, K {K}; median of 30 rounds")
        for name, ms in times.items():
            print(f"  {name:46s} {ms:7.3f} ms  {flops / ms / 1e9:6.0f} TFLOP/s")


if __name__ == "__main__":
    main()

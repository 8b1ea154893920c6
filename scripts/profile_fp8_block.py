"""The block-scaled FP8 GEMM under Nsight Compute, beside cuBLAS's rowwise FP8 GEMM, one launch
each at issue 8's shape (M=4096, N=7168, K=16384):

    ncu --clock-control none --profile-from-start off --set full -o fp8 \\
        env PYTHONPATH=src python scripts/profile_fp8_block.py [ours] [rowwise]

Compiled and warmed up first; only the launches between cudaProfilerStart and Stop are
profiled: ours with 128 x 256 tiles, then torch._scaled_mm rowwise (or only those named). Run by
scripts/gpu_check.sh (PARTS=profile-fp8), which prints the report's key sections; with only
"ours", scripts/ncu_sass_stalls.py reads its per-instruction stall samples.
"""

import sys

import kforge  # noqa: F401  (before triton)
import torch

from device_timing import profile_once
from kforge.kernels.quant.formats import quantize_fp8_blockwise, quantize_fp8_rowwise
from kforge.kernels.quant.fp8_block_gemm import fp8_block_gemm


def main():
    m, n, k = 4096, 7168, 16384
    x, w = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda") / k**0.5
    (a, sa), (b, sb) = quantize_fp8_blockwise(x, (1, 128)), quantize_fp8_blockwise(w, (128, 128))
    (ra, rsa), (rb, rsb) = quantize_fp8_rowwise(x), quantize_fp8_rowwise(w)
    calls = {
        "ours": lambda: fp8_block_gemm(a, b, sa, sb, block_n=256),
        "rowwise": lambda: torch._scaled_mm(ra, rb.t(), scale_a=rsa, scale_b=rsb.reshape(1, n),
                                            out_dtype=torch.bfloat16),
    }
    names = sys.argv[1:] or list(calls)
    if any(name not in calls for name in names):
        sys.exit(f"profile_fp8_block.py: calls are {', '.join(calls)}, got {' '.join(names)}")
    profile_once({name: calls[name] for name in names})


if __name__ == "__main__":
    main()

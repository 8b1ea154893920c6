"""The GEMM kernels under Nsight Compute: ours next to cuBLAS at 4096^3, one launch each.

    ncu --clock-control none --profile-from-start off --set full -o gemm \\
        env PYTHONPATH=src python scripts/profile_gemm.py

Every kernel is compiled and warmed up first; only the launches between
cudaProfilerStart and cudaProfilerStop are profiled: fp32 rung 8's best shape, the
tuned fp32 rung, cuBLAS SGEMM (TF32 off), bf16 rung 5 and cuBLAS bf16. Run by
scripts/gpu_check.sh (PARTS=profile-gemm), which prints the report's key metrics.
"""

import kforge  # noqa: F401  (before triton)
import torch

from device_timing import profile_once
from kforge.kernels import gemm_bf16, gemm_fp32

N = 4096


def main():
    torch.backends.cuda.matmul.allow_tf32 = False
    a32, b32 = torch.randn(N, N, device="cuda"), torch.randn(N, N, device="cuda")
    a16, b16 = a32.bfloat16(), b32.bfloat16()
    rung8, rung8_shape = gemm_fp32.SWEEP[0]
    calls = {
        "fp32 rung 8 (best shape)": lambda: gemm_fp32.sgemm(a32, b32, rung8, rung8_shape),
        f"fp32 {gemm_fp32.BEST.label}": lambda: gemm_fp32.sgemm(a32, b32, gemm_fp32.BEST),
        "cuBLAS SGEMM": lambda: torch.matmul(a32, b32),
        "bf16 rung 5": lambda: gemm_bf16.gemm(a16, b16, 5),
        "cuBLAS bf16": lambda: torch.matmul(a16, b16),
    }
    profile_once(calls)


if __name__ == "__main__":
    main()

"""RMSNorm + QKV at prefill under Nsight Compute: the fused variants beside the plain GEMM and
cuBLAS at M = 4096, N = 6144, K = 4096 (Llama-3-8B), one launch each.

    ncu --clock-control none --profile-from-start off --set full -o norm-qkv \\
        env PYTHONPATH=src python scripts/profile_norm_qkv.py

Every kernel is compiled and warmed up first; only the launches between cudaProfilerStart and
cudaProfilerStop are profiled (`device_timing.profile_once`).
"""

import kforge  # noqa: F401  (before triton)
import torch

from device_timing import profile_once
from kforge.kernels import gemm_bf16

M, N, K = 4096, 6144, 4096


def main():
    x = torch.randn(M, K, device="cuda").bfloat16()
    gamma = (1 + 0.1 * torch.randn(K, device="cuda")).bfloat16()
    w = (torch.randn(N, K, device="cuda") / K**0.5).bfloat16()
    fused = lambda method, **extra: lambda: gemm_bf16.gemm(  # noqa: E731
        x, w, 4, b_layout="nk", defines={"NORM_A": method, **extra}, norm_weight=gamma)
    profile_once({
        "rung 4 alone": lambda: gemm_bf16.gemm(x, w, 4, b_layout="nk"),
        "cuBLAS alone": lambda: torch.nn.functional.linear(x, w),
        "rung 4 NORM_A 1": fused(1),
        "rung 4 NORM_A 2": fused(2, **gemm_bf16.EPILOGUE_AFTER_KLOOP),
    })


if __name__ == "__main__":
    main()

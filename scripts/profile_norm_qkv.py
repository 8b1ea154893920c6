"""RMSNorm + QKV at prefill under Nsight Compute: the fused variants beside the plain GEMM and
cuBLAS at M = 4096, N = 6144, K = 4096 (Llama-3-8B), one launch each.

    ncu --clock-control none --profile-from-start off --set full -o norm-qkv \\
        env PYTHONPATH=src python scripts/profile_norm_qkv.py [NAME ...]

NAME picks calls to profile (default: all): "alone" (rung 4 without the norm), "cublas", "fused".
With only "fused", `ncu -i norm-qkv.ncu-rep --page source --csv --print-source sass` lists the
fused kernel's SASS with its stall samples per instruction.

Every kernel is compiled and warmed up first; only the launches between cudaProfilerStart and
cudaProfilerStop are profiled (`device_timing.profile_once`).
"""

import sys

import kforge  # noqa: F401  (before triton)
import torch

from device_timing import profile_once
from kforge.kernels import gemm_bf16

M, N, K = 4096, 6144, 4096


def main():
    x = torch.randn(M, K, device="cuda").bfloat16()
    gamma = (1 + 0.1 * torch.randn(K, device="cuda")).bfloat16()
    w = (torch.randn(N, K, device="cuda") / K**0.5).bfloat16()
    calls = {
        "alone": lambda: gemm_bf16.gemm(x, w, 4, b_layout="nk"),
        "cublas": lambda: torch.nn.functional.linear(x, w),
        "fused": lambda: gemm_bf16.gemm(x, w, 4, b_layout="nk", norm_weight=gamma),
    }
    names = sys.argv[1:] or list(calls)
    unknown = [name for name in names if name not in calls]
    if unknown:
        sys.exit(f"profile_norm_qkv.py: unknown call {unknown[0]!r} (calls: {', '.join(calls)})")
    profile_once({name: calls[name] for name in names})


if __name__ == "__main__":
    main()

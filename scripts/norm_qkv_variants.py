"""Device time of RMSNorm fused into the QKV projection at prefill, variant by variant (H100),
against the unfused pairs it must beat.

    PYTHONPATH=src python scripts/norm_qkv_variants.py [ROUNDS] [M ...]

y = rmsnorm(x; gamma) @ W^T at the Llama-3 8B and 70B QKV widths, M = 4096 tokens (or the Ms
given). Timed after a reading L2 flush, interleaved, medians of CUDA event times (the kernels
alone, no host time):
- "compiled pair": torch.compile of the problem's eager Model (a fused Triton norm, then cuBLAS);
- "cuBLAS alone": the GEMM without the norm, the floor a fused kernel works against;
- rung 4 without the norm (its own floor) on 128 x 256 and 128 x 192 tiles;
- `rms_norm_qkv` itself, and rung 4 with the norm fused (`gemm_bf16.gemm(norm_weight=)`, its
  NORM_A build) on the two tile widths it picks between (`norm_qkv.prefill_tile_width`).
Each fused variant is checked against float64 first; a wrong one is reported and not timed.
"""

import sys

import kforge  # noqa: F401  (before triton)
import torch

from device_timing import median_ms
from kforge.kernels import gemm_bf16
from kforge.kernels.serving import norm_qkv
from kforge.problems.level2 import rms_norm_qkv_bf16 as problem

SHAPES = [(4096, 6144, 4096), (4096, 10240, 8192)]  # Llama-3 8B and 70B QKV, 4096 tokens
FUSED = [("rung 4 NORM_A 128 x 256 GROUP_M 16", 4, {"GROUP_M": 16}), ("rung 4 NORM_A 128 x 192", 4, {"BN": 192})]


def time_shape(m: int, n: int, k: int, rounds: int) -> None:
    x = torch.randn(m, k, device="cuda").bfloat16()
    gamma = (1 + 0.1 * torch.randn(k, device="cuda")).bfloat16()
    w = (torch.randn(n, k, device="cuda") / k**0.5).bfloat16()
    r = torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + problem.EPS)
    want = ((x.double() * gamma.double()).bfloat16().double() * r) @ w.double().t()
    compiled = torch.compile(problem.Model())
    fns = {"compiled pair": lambda: compiled(x, gamma, w), "cuBLAS alone": lambda: torch.nn.functional.linear(x, w),
           "rung 4 alone": lambda: gemm_bf16.gemm(x, w, 4, b_layout="nk"),
           "rung 4 alone 128 x 192": lambda: gemm_bf16.gemm(x, w, 4, b_layout="nk", defines={"BN": 192}),
           "rms_norm_qkv (the op: one of the two below)": lambda: norm_qkv.rms_norm_qkv(x, gamma, w, problem.EPS)}
    for name, number, defines in FUSED:
        call = lambda number=number, defines=defines: gemm_bf16.gemm(  # noqa: E731
            x, w, number, b_layout="nk", defines=defines, norm_weight=gamma, norm_eps=problem.EPS)
        got = call().double()
        err = ((got - want).abs().max() / want.abs().max()).item()
        if not (err < 2e-2 and got.isfinite().all()):
            print(f"{name}: WRONG, max error {err:.3g} of the largest value")
            continue
        print(f"{name}: max error {err:.2e} of the largest value against float64")
        fns[name] = call
    fns["compiled pair"]()  # compiled before the timing
    times = median_ms(fns, rounds)
    base = times["compiled pair"]
    print(f"\n# M={m} N={n} K={k}: device time, median of {rounds} interleaved rounds after an L2 flush")
    print(f"{'':48s} {'us':>8s} {'TFLOP/s':>8s} {'x pair':>7s} {'x cuBLAS alone':>15s}")
    for name, ms in sorted(times.items(), key=lambda item: item[1]):
        print(f"{name:48s} {ms * 1e3:8.1f} {2 * m * n * k / ms / 1e9:8.0f} {base / ms:7.3f} "
              f"{times['cuBLAS alone'] / ms:15.3f}")


if __name__ == "__main__":
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    tokens = [int(m) for m in sys.argv[2:]]  # other prefill lengths than 4096, at both widths
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for m, n, k in SHAPES:
        for m in tokens or [m]:
            time_shape(m, n, k, rounds)

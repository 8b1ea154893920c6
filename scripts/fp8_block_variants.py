"""The block-scaled FP8 GEMM's CUDA variants (tile width x ring depth) beside the Triton kernel
and torch._scaled_mm, kernel-alone device time (device_timing.median_ms: reading L2 flush,
interleaved rounds, medians), at issue 8's shape unless given:

    PYTHONPATH=src python scripts/fp8_block_variants.py [M N K] [rounds]

Every variant is first checked against the Triton kernel's output (same numbers, both
promoted every 128 K: they agree to a bf16 step or two). The tile variants run with the
default promotion scheduling (fp8_block_gemm.PROMOTION); beside them, the default tile with
every other style of `runtime/sass_control.py` ("ptxas": as compiled), other raster groups
(GROUP_M), and timing-only builds that replace the promotion (PROMOTE_TIMING in the .cu: wrong
results, a bound on what the promotion costs).
"""

import itertools
import sys

import kforge  # noqa: F401  (before triton)
import torch

from device_timing import median_ms
from kforge.kernels.quant.formats import quantize_fp8_blockwise, quantize_fp8_rowwise
from kforge.kernels.quant.fp8_block_gemm import PROMOTION, fp8_block_gemm
from kforge.kernels.quant.fp8_gemm import fp8_gemm
from kforge.runtime import sass_control

VARIANTS = [(128, 6, 1), (128, 6, 2), (256, 4, 1), (256, 4, 2), (256, 3, 2)]  # block_n, stages, cluster
STYLED = [(256, 4, 2)]  # also built with the promotion's control bits rewritten (runtime/sass_control.py)


def main():
    m, n, k = (int(v) for v in sys.argv[1:4]) if len(sys.argv) >= 4 else (4096, 7168, 16384)
    rounds = int(sys.argv[4]) if len(sys.argv) >= 5 else 30
    x, w = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda") / k**0.5
    (a, sa), (b, sb) = quantize_fp8_blockwise(x, (1, 128)), quantize_fp8_blockwise(w, (128, 128))
    (ra, rsa), (rb, rsb) = quantize_fp8_rowwise(x), quantize_fp8_rowwise(w)
    del x, w
    want = fp8_gemm(a, b, sa, sb, "block", prefer_cuda=False).float()
    fns = {"Triton block": lambda: fp8_gemm(a, b, sa, sb, "block", prefer_cuda=False)}

    def checked(name, call):  # timed only if it agrees with the Triton kernel
        error = ((call().float() - want).abs().max() / want.abs().max()).item()
        print(f"{name}: max |CUDA - Triton| / max |C| = {error:.1e}")
        if error < 2e-2:
            fns[name] = call

    for block_n, stages, cluster in VARIANTS:
        checked(f"CUDA block BN={block_n} stages={stages} cluster={cluster} (promotion {PROMOTION})",
                lambda block_n=block_n, stages=stages, cluster=cluster: fp8_block_gemm(
                    a, b, sa, sb, block_n=block_n, stages=stages, cluster=cluster))
    for (block_n, stages, cluster), style in itertools.product(STYLED, sass_control.STYLES):
        if style != PROMOTION:  # (the default is timed above)
            checked(f"CUDA block BN={block_n} stages={stages} cluster={cluster} promotion {style}",
                    lambda block_n=block_n, stages=stages, cluster=cluster, style=style: fp8_block_gemm(
                        a, b, sa, sb, block_n=block_n, stages=stages, cluster=cluster, promotion=style))
    # The default tile built with other defines: raster groups, and timing-only builds (wrong results) that
    # bound what the promotion's form costs (PROMOTE_TIMING)
    from kforge.kernels.quant import fp8_block_gemm as module
    from kforge.runtime.cuda import CudaKernel, compile_cuda

    def built(defines):
        cubin = compile_cuda(module.SOURCE, defines={"STAGES": 4, "BN": 256, "CLUSTER_M": 2, **defines})
        kernel = CudaKernel(sass_control.rewrite_promotion(cubin, "fp8_block_gemm", PROMOTION), "fp8_block_gemm")
        plan = module._Plan(kernel, 4, 256, 2, m, n, k, torch.cuda.current_device())

        def call():
            c = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            plan(a, b, c, sa, sb)
            return c

        return call

    for group_m in (4, 16):
        checked(f"CUDA block BN=256 stages=4 cluster=2 GROUP_M={group_m}", built({"GROUP_M": group_m}))
    fns["TIMING ONLY BN=256 cluster=2, promotion as acc += p"] = built({"PROMOTE_TIMING": 1})
    fns["TIMING ONLY BN=256 cluster=2, promotion as acc += p * constant"] = built({"PROMOTE_TIMING": 3})
    for fast in (False, True):
        fns[f"_scaled_mm rowwise{' fast' if fast else ''}"] = lambda fast=fast: torch._scaled_mm(
            ra, rb.t(), scale_a=rsa, scale_b=rsb.reshape(1, n), out_dtype=torch.bfloat16, use_fast_accum=fast)
    for fn in fns.values():
        fn()
    flops = 2 * m * n * k
    times = median_ms(fns, rounds)
    base = times["_scaled_mm rowwise"]
    print(f"M={m} N={n} K={k}, {rounds} rounds, device time medians")
    for name, ms in sorted(times.items(), key=lambda item: item[1]):
        print(f"  {ms:8.3f} ms  {flops / ms / 1e9:7.1f} TFLOP/s  {base / ms:5.2f}x rowwise  {name}")


if __name__ == "__main__":
    main()

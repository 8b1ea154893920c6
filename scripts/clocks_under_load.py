"""SM clock and board power while one kernel runs back to back: is it power-bound?

    PYTHONPATH=src python scripts/clocks_under_load.py [seconds]

Runs the block-scaled FP8 GEMM at issue 8's shape (4096 x 7168 x 16384) and torch._scaled_mm
rowwise, alternating, each twice for `seconds` (default 5), while `nvidia-smi` samples the SM clock, power draw
and the throttle reasons every 100 ms; prints the medians. A GEMM that holds the board at its
power limit with the clock below its maximum is power-bound: there, SMs idle in a last round
of tiles give the others clock, so the round's idle time costs less than its share.
"""

import kforge  # noqa: F401  (before triton)
import statistics
import subprocess
import sys
import time

import torch

from kforge.kernels.quant.formats import quantize_fp8_blockwise, quantize_fp8_rowwise
from kforge.kernels.quant.fp8_block_gemm import fp8_block_gemm

QUERY = "clocks.sm,clocks.max.sm,power.draw,power.limit,clocks_event_reasons.active"


def sampled(run, seconds):
    sampler = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", "100"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    end = time.time() + seconds
    calls = 0
    while time.time() < end:
        for _ in range(20):
            run()
        torch.cuda.synchronize()
        calls += 20
    sampler.terminate()
    output = sampler.communicate()[0]
    rows = [line.split(", ") for line in output.strip().splitlines()[5:]]  # past the ramp
    if not rows or len(rows[0]) != 5:
        sys.exit(f"nvidia-smi gave no samples: {output[:300]!r}")
    sm, top, power, limit = (statistics.median(float(r[i]) for r in rows) for i in range(4))
    reasons = sorted({r[4] for r in rows})
    return calls / seconds, sm, top, power, limit, reasons


def main():
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 5.0
    m, n, k = 4096, 7168, 16384
    x, w = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda") / k**0.5
    (a, sa), (b, sb) = quantize_fp8_blockwise(x, (1, 128)), quantize_fp8_blockwise(w, (128, 128))
    (ra, rsa), (rb, rsb) = quantize_fp8_rowwise(x), quantize_fp8_rowwise(w)
    runs = {"fp8_block_gemm": lambda: fp8_block_gemm(a, b, sa, sb),
            "_scaled_mm rowwise": lambda: torch._scaled_mm(ra, rb.t(), scale_a=rsa, scale_b=rsb.reshape(1, n),
                                                           out_dtype=torch.bfloat16)}
    for name, run in [*runs.items(), *runs.items()]:  # each twice, alternating: drift shows
        run()
        rate, sm, top, power, limit, reasons = sampled(run, seconds)
        print(f"{name:>20}: {rate:7.1f} calls/s ({2 * m * n * k * rate / 1e12:6.0f} TFLOP/s), SM clock {sm:.0f} of "
              f"{top:.0f} MHz, {power:.0f} of {limit:.0f} W, throttle reasons {reasons}")


if __name__ == "__main__":
    main()

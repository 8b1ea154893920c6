"""The examples on the GPU: the roofline, each example against eager and compiled PyTorch.

    PYTHONPATH=src python scripts/gpu_check.py --out DIR

Run by scripts/gpu_check.sh (which also runs the GPU tests and the GEMM ladder).
Writes DIR/ceilings.json and DIR/examples.jsonl (one EvalRecord per evaluation), and
prints a short table last. Each example is
evaluated twice against eager PyTorch (the spread of the two speedups is the noise
floor of a claim) and once against torch.compile.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import kforge  # noqa: F401  (before triton)
from kforge.device import current_device
from kforge.harness.evaluate import evaluate
from kforge.harness.record import append_record
from kforge.harness.roofline import get_ceilings

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ["matmul_bf16", "softmax", "linear_bias_gelu"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--size", default="full", help="problem size (tiny: a quick dry run on a CPU)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.chdir(ROOT)  # records name the examples by their paths in the repository
    started = time.time()

    device = current_device()
    ceilings = get_ceilings(device)  # measured moments ago by `kforge roofline`, else now
    (args.out / "ceilings.json").write_text(json.dumps(ceilings.to_dict(), indent=2) + "\n")
    print(f"[roofline] copy {ceilings.copy_gbps:.0f} GB/s, matmul "
          + ", ".join(f"{k} {v:.1f}" for k, v in ceilings.matmul_tflops.items()) + " TFLOP/s", flush=True)

    results = args.out / "examples.jsonl"
    rows = []
    for name in EXAMPLES:
        problem, candidate = f"examples/problems/{name}.py", f"examples/triton/{name}.py"
        for run, baseline in enumerate(["eager", "eager", "compile"], start=1):
            command = f"kforge eval {problem} {candidate} --baseline {baseline}"
            record = evaluate(problem, candidate, baseline=baseline, ceilings=ceilings, command=command,
                              size=args.size)
            append_record(results, record)
            rows.append((name, run, record))
            print(f"[eval] {name} #{run} ({baseline}): {record.status} {record.reason or ''}", flush=True)

    print()
    print(f"{'example':18} {'run':>3} {'base':>7} {'status':>20} {'speedup':>8} {'ref ms':>8} {'cand ms':>8} "
          f"{'ref TF/s':>8} {'cand TF/s':>9} {'cand GB/s':>9} {'% roof':>7}")
    for name, run, record in rows:
        g2, roof = record.gate2, record.roofline
        if not g2:
            print(f"{name:18} {run:>3} {record.baseline:>7} {record.status:>20}  {record.reason}")
            continue
        ref, cand = roof["reference"], roof["candidate"]
        tf = lambda p: f"{p['tflops']:.1f}" if p["tflops"] is not None else "-"  # noqa: E731
        print(f"{name:18} {run:>3} {record.baseline:>7} {record.status:>20} {g2['speedup']:>8.3f} "
              f"{ref['time_ms']:>8.4f} {cand['time_ms']:>8.4f} {tf(ref):>8} {tf(cand):>9} {cand['gbps']:>9.0f} "
              f"{cand['pct_of_roof']:>6.1f}%")

    checks = []
    matmul = [r for n, _, r in rows if n == "matmul_bf16" and r.baseline == "eager" and r.roofline]
    if matmul and "bf16" in ceilings.matmul_tflops:
        rate = ceilings.matmul_tflops["bf16"]
        worst = max(abs(r.roofline["reference"]["tflops"] / rate - 1) for r in matmul)
        checks.append(f"bf16 matmul reference vs roofline bf16 rate ({rate:.0f} TFLOP/s): worst gap {100 * worst:.1f}% "
                      f"({'OK' if worst <= 0.05 else 'OVER 5%'})")
    for name in EXAMPLES:
        pair = [r.speedup for n, _, r in rows if n == name and r.baseline == "eager" and r.speedup]
        if len(pair) == 2:
            spread = abs(pair[0] / pair[1] - 1)
            checks.append(f"{name}: speedups {pair[0]:.3f}x / {pair[1]:.3f}x, spread {100 * spread:.2f}% "
                          f"({'OK' if spread <= 0.02 else 'OVER 2%'})")
    print()
    for line in checks:
        print("[check]", line)
    print(f"[done] {device.name}, {time.time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where a persistent bf16 GEMM's time goes, tile by tile (H100): rung 4 or 5 built with
TIMELINE=1 writes clock64 readings per CTA and job (04_persistent.cu), and this script turns
them into a breakdown beside the kernel's device time and cuBLAS's.

    PYTHONPATH=src python scripts/gemm_timeline.py [M N K] [VARIANT ...]

VARIANT is a name of `VARIANTS` below (default: rung4 rung5). For each, per job (the CTA's
first, second, ... tile), medians over CTAs in SM cycles:
  wait    from the previous job's last store issued (or kernel entry) to its first k-tile landed
  k-loop  first k-tile landed to last wgmma finished; "ideal" is k_tiles x BM*BN*BK*2 / 4096
          (an H100 SM's dense bf16 tensor rate: 4096 FLOP a cycle)
  epi     last wgmma finished to the last TMA store issued
  lead    how long before the first k-tile landed the producer had issued its load
then the whole kernel: span (first entry to last exit, %globaltimer), the SM clock it implies,
and the share of the span each phase takes on the CTAs that ran the most jobs.
"""

import sys

import kforge  # noqa: F401  (before triton)
import numpy as np
import torch

from device_timing import _flush, median_ms
from kforge.kernels import gemm_bf16

JOBS, SLOTS = 16, 8 + 4 * 16  # TIMELINE_JOBS, TIMELINE_SLOTS in 04_persistent.cu
TENSOR_FLOP_PER_CYCLE = 4096  # one H100 SM, dense bf16 (989 TFLOP/s = 132 SMs x 4096 x 1.83 GHz)
VARIANTS = {"rung4": (4, {}), "rung5": (5, {}), "rung4-tall": (4, gemm_bf16.TALL_TILE),
            "rung4-after": (4, gemm_bf16.EPILOGUE_AFTER_KLOOP),
            "rung4-spread1": (4, {"EPI_SPREAD": 1}), "rung4-spread4": (4, {"EPI_SPREAD": 4})}


def breakdown(t: np.ndarray, k_loop_ideal: float) -> list[str]:
    """Text lines from the (CTAs, SLOTS) uint64 readings of one launch."""
    entry_ns, exit_ns = t[:, 1].astype(np.int64), t[:, 4].astype(np.int64)
    entry_clk, exit_clk = t[:, 2].astype(np.int64), t[:, 5].astype(np.int64)
    jobs = t[:, 3].astype(np.int64)
    span_ns = int(exit_ns.max() - entry_ns.min())
    ghz = float(np.median((exit_clk - entry_clk) / np.maximum(exit_ns - entry_ns, 1)))
    lines = [f"span {span_ns / 1e3:.1f} us at {ghz:.3f} GHz ({span_ns * ghz / 1e3:.1f} K cycles); "
             f"CTAs {len(t)}, jobs per CTA {jobs.min()}-{jobs.max()}; "
             f"entry spread {(entry_ns.max() - entry_ns.min()) / 1e3:.2f} us, "
             f"exit spread {(exit_ns.max() - exit_ns.min()) / 1e3:.2f} us"]
    lines.append(f"{'job':>4s} {'CTAs':>5s} {'wait':>8s} {'k-loop':>8s} {'x ideal':>8s} {'epi':>7s} {'lead':>8s}")
    for j in range(min(int(jobs.max()), JOBS)):
        rows = t[jobs > j]
        issue, landed, loop_end, epi_end = (rows[:, 8 + 4 * j + i].astype(np.int64) for i in range(4))
        before = rows[:, 2].astype(np.int64) if j == 0 else rows[:, 8 + 4 * (j - 1) + 3].astype(np.int64)
        med = lambda x: float(np.median(x))  # noqa: E731
        lines.append(f"{j:4d} {len(rows):5d} {med(landed - before):8.0f} {med(loop_end - landed):8.0f} "
                     f"{med(loop_end - landed) / k_loop_ideal:8.3f} {med(epi_end - loop_end):7.0f} "
                     f"{med(landed - issue):8.0f}")
    full = t[jobs == jobs.max()]
    total = (full[:, 5] - full[:, 2]).astype(np.float64)
    k_loop = sum((full[:, 10 + 4 * j] - full[:, 9 + 4 * j]).astype(np.float64) for j in range(min(jobs.max(), JOBS)))
    epi = sum((full[:, 11 + 4 * j] - full[:, 10 + 4 * j]).astype(np.float64) for j in range(min(jobs.max(), JOBS)))
    ideal = k_loop_ideal * min(jobs.max(), JOBS)
    lines.append(f"CTAs with {jobs.max()} jobs, share of their lifetime ({np.median(total) / 1e3:.1f} K cycles): "
                 f"ideal MMA {np.median(ideal / total):.1%}, k-loop {np.median(k_loop / total):.1%}, "
                 f"epilogue {np.median(epi / total):.1%}, rest {np.median(1 - (k_loop + epi) / total):.1%}")
    return lines


def run(m: int, n: int, k: int, names: list[str]) -> None:
    a = torch.randn(m, k, device="cuda").bfloat16()
    b = torch.randn(k, n, device="cuda").bfloat16()
    want = a.float() @ b.float()
    fns = {"cuBLAS": lambda: torch.matmul(a, b)}
    reports = {}
    for name in names:
        step, defines = VARIANTS[name]
        plain = gemm_bf16._Plan(gemm_bf16.rung(step), "kn", defines, m, n, k, torch.cuda.current_device())
        timed = gemm_bf16._Plan(gemm_bf16.rung(step), "kn", dict(defines, TIMELINE=1), m, n, k,
                                torch.cuda.current_device())
        readings = torch.zeros(1024 * SLOTS, dtype=torch.int64, device="cuda")  # CTAs <= SMs
        timed.tail = timed.tail[:4] + (readings.data_ptr(), 0)
        for label, plan in ((name, plain), (name + " TIMELINE", timed)):
            c = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            plan(a, b, c)
            err = ((c.float() - want).abs().max() / want.abs().max()).item()
            if not err < 1e-2:
                print(f"{label}: WRONG, max error {err:.3g}")
                continue
            fns[label] = lambda plan=plan: plan(a, b, torch.empty(m, n, dtype=torch.bfloat16, device="cuda"))
        p = gemm_bf16.prepared(gemm_bf16.rung(step), "kn", defines)[1]
        reports[name] = (timed, readings, p["BM"] * p["BN"] * p["BK"] * 2 / TENSOR_FLOP_PER_CYCLE * -(-k // p["BK"]))
    times = median_ms(fns, 20)
    print(f"# {m} x {n} x {k} (kn), device time, median of 20 rounds after an L2 flush")
    for label, ms in sorted(times.items(), key=lambda item: item[1]):
        print(f"{label:24s} {ms * 1e3:8.1f} us {2 * m * n * k / ms / 1e9:6.0f} TFLOP/s {times['cuBLAS'] / ms:6.3f}x cuBLAS")
    for name, (timed, readings, ideal) in reports.items():
        launches = []
        for _ in range(5):  # five launches after a flush each; the median-span one is shown
            _flush()
            readings.zero_()
            timed(a, b, torch.empty(m, n, dtype=torch.bfloat16, device="cuda"))
            torch.cuda.synchronize()
            t = readings.view(-1, SLOTS).cpu().numpy().astype(np.uint64)
            t = t[t[:, 1] != 0]
            launches.append((int(t[:, 4].max() - t[:, 1].min()), t))
        launches.sort(key=lambda x: x[0])
        print(f"\n## {name} timeline (spans of 5 launches: "
              f"{', '.join(f'{s / 1e3:.1f}' for s, _ in launches)} us; the median shown)")
        print("\n".join(breakdown(launches[2][1], ideal)))


if __name__ == "__main__":
    args = sys.argv[1:]
    shape = [int(x) for x in args[:3]] if len(args) >= 3 and args[0].isdigit() else [4096, 4096, 4096]
    names = [x for x in args if not x.isdigit()] or ["rung4", "rung5"]
    run(*shape, names)

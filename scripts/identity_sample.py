"""Gate 2's bias check: every problem against itself, as `kforge eval` judges a candidate.

    python scripts/identity_sample.py KERNELBENCH_DIR OUT [--every 4] [--offset 0] [--levels 1,2,3] [--budget 2]
                                      [--only 21_Sigmoid,89_cumsum] [--worker-cpu auto|none|N]

For every `--every`-th problem file of each KernelBench level (KERNELBENCH_DIR/level1...,
files unchanged), the candidate is the same file with `Model` renamed `ModelNew`: the
same code on both sides. An unbiased gate 2 calls none of them faster and measures each
within +-1% (the verdict's noise floor). Records go to OUT/identity-sample.jsonl (sealed,
one per problem); a table and the counts are printed last.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

from kforge.cli import worker_cpu_setting
from kforge.errors import KforgeError
from kforge.harness.isolation import evaluate_isolated
from kforge.harness.judge import StageLimits
from kforge.harness.record import append_record
from kforge.harness.timing import TimingConfig


def sample(root: Path, levels: list[int], every: int, only: set[str] | None = None,
           offset: int = 0) -> list[tuple[int, Path]]:
    picked = []
    for level in levels:
        files = sorted((root / f"level{level}").glob("*.py"), key=lambda p: int(p.name.split("_")[0]))
        picked += [(level, path) for path in files[offset::every] if not only or path.stem in only]
    return picked


def identity_candidate(problem: Path, folder: Path) -> Path:
    """The problem file with its `Model` class renamed `ModelNew` (and every use of the name)."""
    path = folder / problem.name
    path.write_text(re.sub(r"\bModel\b", "ModelNew", problem.read_text()))
    return path


def _worker_cpu(text: str) -> int | str | None:
    try:
        return worker_cpu_setting(text)
    except KforgeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kernelbench", type=Path, help="the folder holding level1, level2, level3")
    parser.add_argument("out", type=Path)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--offset", type=int, default=0, help="start at this file of each level (0: the first)")
    parser.add_argument("--levels", default="1,2,3")
    parser.add_argument("--budget", type=float, default=2.0, help="gate 2's time budget per problem (s)")
    parser.add_argument("--only", default="", help="only these problems of the sample (file names without .py)")
    parser.add_argument("--worker-cpu", default="auto", type=_worker_cpu,
                        help="the CPU both workers are held to: auto, none or N")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    store = args.out / "identity-sample.jsonl"
    levels = [int(x) for x in args.levels.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        only = {name for name in args.only.split(",") if name}
        for level, problem in sample(args.kernelbench, levels, args.every, only, args.offset):
            started = time.perf_counter()
            record = evaluate_isolated(problem, identity_candidate(problem, Path(folder)),
                                       timing=TimingConfig(budget_s=args.budget, worker_cpu=args.worker_cpu),
                                       remeasure_above=None,
                                       limits=StageLimits(load_s=180, gate1_s=180, gate2_s=args.budget + 120),
                                       command=f"identity sample: level{level}/{problem.name}")
            append_record(store, record)
            verdict = (record.gate2 or {}).get("verdict") or {}
            rows.append((level, problem.stem, record.status, record.speedup, verdict.get("low"), verdict.get("high"),
                         verdict.get("noise_floor"), (record.gate2 or {}).get("rounds"),
                         ((record.gate2 or {}).get("stats") or {}).get("reference", {}).get("median_ms"),
                         time.perf_counter() - started, record.reason))
            print(f"level{level} {problem.stem}: {record.status} {record.speedup or float('nan'):.4f}x "
                  f"({rows[-1][-2]:.0f} s)", flush=True)

    def num(value, fmt):
        return format(value, fmt) if isinstance(value, (int, float)) else "-"

    print(f"\n{'level':5} {'problem':48} {'status':10} {'speedup':>8} {'95% interval':>17} {'floor':>6} "
          f"{'rounds':>6} {'ref ms':>9}")
    for level, name, status, speedup, low, high, floor, rounds, ref_ms, _secs, reason in rows:
        interval = f"{num(low, '.4f')}-{num(high, '.4f')}"
        print(f"{level:<5} {name[:48]:48} {status:10} {num(speedup, '.4f'):>8} {interval:>17} "
              f"{num(100 * floor if floor else None, '.1f'):>6} {num(rounds, 'd'):>6} {num(ref_ms, '.4g'):>9}")
        if status not in ("tie", "slower", "passed"):
            print(f"      {reason}")
    timed = [r for r in rows if r[3] is not None]
    within = sum(abs(r[3] - 1) <= 0.01 for r in timed)
    faster = sum(r[2] == "passed" for r in rows)
    print(f"\n{len(rows)} problems, {len(timed)} timed: {within} within +-1%, {faster} called faster; statuses: "
          + ", ".join(f"{s} {sum(r[2] == s for r in rows)}" for s in sorted({r[2] for r in rows})))
    return 0 if faster == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

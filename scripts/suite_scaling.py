"""Does a suite run N times faster on N GPUs, and does every pair keep its verdict?

    PYTHONPATH=src python scripts/suite_scaling.py --out DIR [--gpus 2] [--executors local,ray]
    PYTHONPATH=src python scripts/suite_scaling.py --out DIR --cpu-dry-run --copies 1 [--executors local,ray]

Builds a suite of distinct pairs (copies of the examples, each copy a different file so a
different pair in the store), measures the ceilings first so no worker does, then, for each
executor, times `kforge suite` on one GPU and on `--gpus` of them, each into a fresh store:
the local executor through `--gpus 0` and `--gpus 0,1,...`, Ray through a Ray instance the
suite starts on this machine seeing one GPU and then all of them (CUDA_VISIBLE_DEVICES).

Prints each run's wall time and pairs per minute, the speedup over the same executor's one-GPU
run against the target 0.9 N, then every pair's speedup in every run, its spread across the
runs (max / min) and whether its status was the same everywhere: timing on a shared host must
not drift when the host runs N judges at once. `--cpu-dry-run` runs each executor once on the
CPU, as a check of the script.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ["matmul_bf16", "softmax"]
TARGET = 0.9  # of N: the bar for N GPUs


def build_suite(folder: Path, copies: int) -> None:
    (folder / "problems").mkdir(parents=True)
    (folder / "solutions").mkdir()
    for name in EXAMPLES:
        for i in range(copies):
            marker = f"\n# copy {i}: a distinct file, so a distinct pair in the store\n"
            for kind, source in (("problems", "problems"), ("solutions", "triton")):
                text = (ROOT / "examples" / source / f"{name}.py").read_text() + marker
                (folder / kind / f"{name}_{i}.py").write_text(text)


def suite_command(work: Path, store: Path, budget: str, executor: str, gpus: int | None) -> tuple[list[str], dict]:
    """The `kforge suite` command line and environment of one run (gpus None: the CPU)."""
    command = [sys.executable, "-m", "kforge", "suite", str(work / "problems"), "--solutions", str(work / "solutions"),
               "--results", str(store), "--time-budget", budget]
    env = dict(os.environ)
    if executor == "ray":
        command += ["--executor", "ray"] + (["--ray-resources", "CPU=1"] if gpus is None else [])
        if gpus is not None:  # the Ray instance the suite starts sees these GPUs only
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(gpus))
    elif gpus is not None:
        command += ["--gpus", ",".join(str(i) for i in range(gpus))]
    return command, env


def pair_rows(stores: dict[str, Path]) -> list[tuple[str, dict[str, tuple[str, float | None]]]]:
    """(pair, {run: (status, speedup)}) for every pair in any store, in name order."""
    pairs: dict[str, dict[str, tuple[str, float | None]]] = {}
    for run, store in stores.items():
        for line in store.read_text().splitlines() if store.is_file() else []:
            record = json.loads(line)
            name = f"{record['problem'].get('name')} / {record['candidate'].get('name')}"
            verdict = (record.get("gate2") or {}).get("verdict") or {}  # a tie's speedup is the verdict's
            pairs.setdefault(name, {})[run] = (record["status"], record.get("speedup") or verdict.get("speedup"))
    return sorted(pairs.items())


def report(seconds: dict[str, float], stores: dict[str, Path], pairs: int, gpus: int) -> list[str]:
    lines = [f"{'run':18} {'wall s':>8} {'pairs/min':>10} {'vs 1 GPU':>9}"]
    for run, wall in seconds.items():
        executor, count = run.rsplit("-", 1)
        one = seconds.get(f"{executor}-1")
        scaling = ""
        if one and count != "1" and count != "cpu":
            ratio = one / wall
            scaling = f"{ratio:.2f}x" + ("" if ratio >= TARGET * gpus else f" (under {TARGET * gpus:.1f}x)")
        lines.append(f"{run:18} {wall:8.1f} {60 * pairs / wall:10.1f} {scaling:>9}")
    runs = list(stores)
    lines.append("")
    lines.append(f"{'pair':44} " + " ".join(f"{run:>14}" for run in runs) + f" {'max/min':>8} {'same status':>11}")
    drift, changed = [], 0
    for name, seen in pair_rows(stores):
        cells, speedups = [], []
        for run in runs:
            status, speedup = seen.get(run, ("-", None))
            cells.append(f"{status[:6]} {speedup:.3f}" if speedup else status[:14])
            if speedup:
                speedups.append(speedup)
        spread = max(speedups) / min(speedups) if len(speedups) > 1 else None
        same = len({seen.get(run, ("missing",))[0] for run in runs}) == 1
        changed += not same
        if spread:
            drift.append(spread)
        lines.append(f"{name[:44]:44} " + " ".join(f"{cell:>14}" for cell in cells)
                     + f" {spread and f'{spread:.4f}' or '-':>8} {'yes' if same else 'NO':>11}")
    if drift:
        lines.append(f"\nspread of a pair's speedup across the runs: median {sorted(drift)[len(drift) // 2]:.4f}, "
                     f"max {max(drift):.4f}; pairs whose status changed: {changed}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--copies", type=int, default=4, help="copies of each example (pairs = 2 x copies)")
    parser.add_argument("--gpus", type=int, default=2, help="N: the second run's GPUs")
    parser.add_argument("--executors", default="local", help="comma list of local, ray")
    parser.add_argument("--time-budget", default="3")
    parser.add_argument("--cpu-dry-run", action="store_true", help="each executor once on the CPU: checks the script")
    args = parser.parse_args()
    executors = [name.strip() for name in args.executors.split(",") if name.strip()]
    if any(name not in ("local", "ray") for name in executors):
        parser.error(f"--executors takes local and ray, not {args.executors!r}")
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp())
    build_suite(work, args.copies)
    subprocess.run([sys.executable, "-m", "kforge", "roofline"], check=True, stdout=subprocess.DEVNULL)

    seconds, stores = {}, {}
    for executor in executors:
        for gpus in [None] if args.cpu_dry_run else [1, args.gpus]:
            run = f"{executor}-{'cpu' if gpus is None else gpus}"
            store = args.out / f"suite-{run}.jsonl"
            store.unlink(missing_ok=True)
            command, env = suite_command(work, store, args.time_budget, executor, gpus)
            start = time.perf_counter()
            result = subprocess.run(command, capture_output=True, text=True, env=env)
            seconds[run], stores[run] = time.perf_counter() - start, store
            (args.out / f"suite-{run}.txt").write_text(result.stdout + result.stderr)
            print(f"[suite] {run}: {seconds[run]:.1f} s, exit {result.returncode}", flush=True)
    shutil.rmtree(work)
    lines = report(seconds, stores, 2 * args.copies, args.gpus)
    (args.out / "scaling.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

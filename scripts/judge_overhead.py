"""What the judge's process separation costs, against the tree before it, in one run.

    python scripts/judge_overhead.py OLD_SRC OUT_DIR [REPEATS]

OLD_SRC is the `src` folder of the kforge to compare with (e.g. `git archive <commit> src`
unpacked). Both trees evaluate the same pairs, interleaved repeat by repeat so drift falls
on both alike: the example suite (`kforge suite examples/problems --solutions
examples/triton`, wall clock of the whole command) and the ~10 us vector add alone
(`kforge eval`, its medians, rounds and timed-loop wall time), each with a 5 s timing
budget. Writes
OUT_DIR/judge-overhead.json and prints a table last.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def kforge(src: Path, *args: str) -> tuple[float, dict | None]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "kforge", *args], cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    try:
        return wall, json.loads(done.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        print(done.stdout[-2000:], done.stderr[-2000:], file=sys.stderr)
        return wall, None


def main() -> None:
    old_src, out = Path(sys.argv[1]).resolve(), Path(sys.argv[2])
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    trees = {"before": old_src, "after": ROOT / "src"}
    rows: dict[str, dict[str, list]] = {name: {"suite_s": [], "pairs": [], "vector_add": []} for name in trees}
    for repeat in range(repeats):
        for name, src in trees.items():
            store = out / f"suite-{name}-{repeat}.jsonl"
            wall, summary = kforge(src, "suite", "examples/problems", "--solutions", "examples/triton", "--results",
                                   str(store), "--force", "--json", "--time-budget", "5")
            rows[name]["suite_s"].append(wall)
            if summary:
                rows[name]["pairs"].append({r["name"]: [r["status"], r["speedup"]] for r in summary["rows"]})
            wall, record = kforge(src, "eval", "examples/problems/vector_add.py", "examples/triton/vector_add.py",
                                  "--json", "--no-save", "--time-budget", "5")
            if record and record.get("gate2"):
                g = record["gate2"]
                rows[name]["vector_add"].append({
                    "status": record["status"], "wall_s": wall, "speedup": g["speedup"], "rounds": g["rounds"],
                    "timed_loop_s": g["wall_s"], "reference_ms": g["stats"]["reference"]["median_ms"],
                    "candidate_ms": g["stats"]["candidate"]["median_ms"], "claims": g.get("claims")})
    (out / "judge-overhead.json").write_text(json.dumps(rows, indent=1))
    print(f"{'tree':8} {'suite s':>9} {'add ref us':>11} {'add cand us':>12} {'rounds':>7} {'loop s':>7} "
          f"{'ms/round':>9} {'gap excess us':>14}")
    for name, r in rows.items():
        va = r["vector_add"] or [{}]
        med = lambda key: statistics.median(v[key] for v in va if key in v) if va[0] else float("nan")  # noqa: E731
        excess = [v["claims"]["excess_ms"] * 1e3 for v in va if v.get("claims")]
        print(f"{name:8} {statistics.median(r['suite_s']):9.1f} {1e3 * med('reference_ms'):11.2f} "
              f"{1e3 * med('candidate_ms'):12.2f} {med('rounds'):7.0f} {med('timed_loop_s'):7.2f} "
              f"{1e3 * med('timed_loop_s') / med('rounds'):9.3f} "
              f"{(statistics.median(excess) if excess else float('nan')):14.1f}")


if __name__ == "__main__":
    main()

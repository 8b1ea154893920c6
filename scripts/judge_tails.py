"""The judge's raw clocks on a GPU, per call: the timed stream's time, the tail of the device-wide
end past it, and the host's time; for the null calls and each side's two calls a round
(reference, candidate, reference_aa, candidate_bb). The add problem's runs take a 0.5 s budget
(under the default minimum time, so they stop on the budget: ~15 rounds are enough here).

    PYTHONPATH=src python scripts/judge_tails.py OUT.json

Why `device_sync` fired on honest host-heavy candidates: a call that leaves the GPU idle before
its end pays more for the closing synchronize than the null calls, which wait behind the judge's
cover (timing._sync_cost). Writes every call's clocks to OUT.json; prints their percentiles.
Measured: benchmarks/results/nvidia-h200/judge-tails.txt.
"""

import json
import sys
import time
from pathlib import Path

import kforge.harness.judge as judge_module
from kforge.harness.isolation import evaluate_isolated
from kforge.harness.timing import TimingConfig

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
ADD, VECTOR_ADD = FIXTURES / "problems" / "add.py", ROOT / "examples" / "problems" / "vector_add.py"
RUNS = [(ADD, "judge_moves_reference")] * 2 + [(ADD, "host_work_before_launch"), (ADD, "host_work_after_launch")] \
    + [(ADD, "judge_zero_claims")] * 2 + [(VECTOR_ADD, "identity_vector_add")] * 3

captured = {}
call_profiles = judge_module.call_profiles


def keep_raw(raw, names, trusted=()):
    captured["raw"] = {name: [list(c) for c in clocks] for name, clocks in raw.items()}
    return call_profiles(raw, names, trusted)


def pct(values, p):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))]


def main(out: Path) -> None:
    judge_module.call_profiles = keep_raw
    dump = []
    for problem, candidate in RUNS:
        t0 = time.time()
        record = evaluate_isolated(problem, FIXTURES / "candidates" / f"{candidate}.py", size="full",
                                   timing=TimingConfig(budget_s=0.5 if problem == ADD else 2.0), remeasure_above=None)
        raw = captured.pop("raw", {})
        print(f"== {candidate} on {problem.stem}: {record.status} x{record.speedup} defences={record.defences} "
              f"({time.time() - t0:.1f} s)")
        for name, clocks in raw.items():
            stream, tail = [c[0] for c in clocks], [c[1] - c[0] for c in clocks]
            print(f"   {name:12s} n={len(clocks):4d} stream p5/50/95 " + " ".join(f"{pct(stream, p):.4f}" for p in
                  (.05, .5, .95)) + " | tail p5/50/95 " + " ".join(f"{pct(tail, p):.4f}" for p in (.05, .5, .95))
                  + f" | host p50 {pct([c[2] for c in clocks], .5):.4f}")
        dump.append({"problem": problem.name, "candidate": candidate, "status": record.status,
                     "speedup": record.speedup, "defences": record.defences, "raw": raw})
    out.write_text(json.dumps(dump))


if __name__ == "__main__":
    main(Path(sys.argv[1]))

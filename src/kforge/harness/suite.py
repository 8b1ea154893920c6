"""Suites: many (problem, candidate) pairs, each in a fresh worker, scored by fast_p.

    pairs = discover(problems_dir, solutions_dir)     # matched by file name
    summary = run_suite(pairs, store, slots=[0, 1], device_name=name)   # one worker per GPU at a time
    summary = run_suite(pairs, store, executor=RayExecutor(address))    # one judge per GPU of a Ray cluster

fast_p (KernelBench's, with gate 2's statistics): the share of ALL problems whose candidate
is correct and measurably more than p times faster than the reference: for p >= 1 its
status is "passed" and the lower end of its speedup's 95% interval is above p (a "tie",
not measurably different, never counts). fast_0 is the share of correct candidates. A
problem without a solution, and a candidate that crashed, timed out or was caught by a
defence, count as failures. The geometric-mean speedup is over the correct candidates.

The store is a JSONL file of EvalRecords, appended and fsynced as each pair ends, so a
suite killed at any moment (SIGKILL too) loses only the pairs in flight. A pair is
identified by its key: problem and candidate content hashes, baseline, size and device.
Running again skips pairs the store has, unless forced, but for a pair recorded as needing
more GPUs than its machine had: that one is tried again, in case this machine has them.
The table is always computed from the store, so a resumed run prints the table an
uninterrupted one would. Whatever executor evaluates the pairs, this process alone writes
the store.

One fast_p scores one kind of device: a suite whose records name several devices is
refused unless `mix_devices` is given (the rows then say which device each ran on).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kforge.errors import KforgeError
from kforge.harness.evaluate import identity, pair_key
from kforge.harness.executors import Executor, Job, LocalExecutor, Placement, was_placed
from kforge.harness.problem import declared_gpus
from kforge.harness.record import EvalRecord, append_record, gpus_used, read_records

FAST_P = (0.0, 1.0, 1.5, 2.0)
CORRECT_STATUSES = ("passed", "slower", "tie")  # gate 1 passed and no defence fired against it


@dataclass(frozen=True)
class Pair:
    name: str
    problem: Path
    candidate: Path | None  # None: no solution for this problem


def discover(problems_dir: Path, solutions_dir: Path) -> list[Pair]:
    """Every problem file (*.py, not starting with '_'), with the solution of the same name."""
    for folder, what in ((problems_dir, "problems"), (solutions_dir, "solutions")):
        if folder.is_file():
            raise KforgeError(f"{folder} is a file: a suite takes a {what} folder (`kforge eval` takes one file)")
        if not folder.is_dir():
            raise KforgeError(f"no {what} folder: {folder}")
    problems = sorted(p for p in problems_dir.glob("*.py") if not p.name.startswith("_"))
    if not problems:
        raise KforgeError(f"no problem files in {problems_dir}")
    return [Pair(p.stem, p, solutions_dir / p.name if (solutions_dir / p.name).is_file() else None)
            for p in problems]


class ResultStore:
    """The suite's JSONL file: appended to, never rewritten; the latest record per key wins."""

    def __init__(self, path: Path):
        self.path = path
        self.lock = threading.Lock()

    def latest(self) -> dict[str, dict]:
        if not self.path.is_file():
            return {}
        return {r["pair_key"]: r for r in read_records(self.path) if r.get("pair_key")}

    def append(self, record: EvalRecord) -> None:
        with self.lock:
            append_record(self.path, record)


@dataclass
class SuiteRow:
    name: str
    status: str  # a record's status, or "missing" (no solution)
    speedup: float | None = None
    speedup_low: float | None = None  # the lower end of the speedup's 95% interval
    reference_ms: float | None = None
    candidate_ms: float | None = None
    pct_of_roof: float | None = None
    defences: list[str] = field(default_factory=list)
    reason: str | None = None
    device: str | None = None  # the device its record ran on (None: no record, or none known)
    gpus: int | None = None  # how many GPUs its record's pair held (record.gpus_used)

    @property
    def correct(self) -> bool:
        return self.status in CORRECT_STATUSES and self.speedup is not None


@dataclass
class SuiteSummary:
    rows: list[SuiteRow]
    fast_p: dict[float, float]
    geomean_speedup: float | None
    ran: int = 0  # pairs evaluated by this run (the rest came from the store)
    devices: list[str] = field(default_factory=list)  # the devices its records ran on

    @property
    def correct(self) -> int:
        return sum(row.correct for row in self.rows)


def keys_for(pairs: Sequence[Pair], options: dict, device_name: str) -> dict[str, str]:
    """Each pair's store key (pairs without a solution have none)."""
    return {
        pair.name: pair_key(identity(pair.problem)["sha256"], identity(pair.candidate)["sha256"],
                            options.get("baseline", "eager"), options.get("size"), device_name)
        for pair in pairs if pair.candidate is not None
    }


def run_suite(
    pairs: Sequence[Pair],
    store: ResultStore,
    *,
    slots: Sequence[int | None] | None = None,
    device_name: str | None = None,
    executor: Executor | None = None,
    force: bool = False,
    options: dict | None = None,
    on_start: Callable[[Pair, Placement], None] | None = None,
    on_done: Callable[[Pair, EvalRecord], None] | None = None,
    mix_devices: bool = False,
) -> SuiteSummary:
    """Evaluate every pair the store lacks (all of them with `force`), then summarize.

    `executor` evaluates the pairs (executors.py); by default a LocalExecutor on `slots`,
    the GPUs to use (None: the CPU), each running one worker at a time. `device_name` keys
    the pairs (default: the executor's). `options` go to evaluate_isolated (baseline,
    timing, size, limits...). Records reach the store here, one at a time, as each pair ends.
    """
    options = dict(options or {})
    executor = executor or LocalExecutor(slots if slots is not None else [None], device_name)
    device_name = device_name or executor.device_name
    keys = keys_for(pairs, options, device_name)
    done = store.latest()
    todo = [p for p in pairs if p.candidate is not None
            and (force or keys[p.name] not in done or not was_placed(done[keys[p.name]]))]
    by_name = {pair.name: pair for pair in todo}

    def started(job: Job, where: Placement) -> None:
        on_start(by_name[job.name], where)

    def finished(job: Job, record: EvalRecord) -> None:
        store.append(record)
        if on_done:
            on_done(by_name[job.name], record)

    # every declaration read before any pair runs: a malformed GPUS stops the suite at once
    jobs = [Job(pair.name, pair.problem, pair.candidate, keys[pair.name], declared_gpus(pair.problem))
            for pair in todo]
    if jobs:
        executor.run(jobs, options=options, device_name=device_name, on_start=started if on_start else None,
                     on_record=finished)
    summary = summarize(pairs, keys, store.latest())
    summary.ran = len(todo)
    check_devices(summary, mix_devices)
    return summary


def check_devices(summary: SuiteSummary, mix_devices: bool) -> None:
    """Refuse a summary whose records ran on several devices, unless mixing was asked for."""
    if len(summary.devices) > 1 and not mix_devices:
        where = "; ".join(f"{device}: {', '.join(row.name for row in summary.rows if row.device == device)}"
                          for device in summary.devices)
        raise KforgeError(f"this suite's records ran on several devices ({where}): their speedups do not belong "
                          "in one fast_p. Run the pairs on one kind of device, or pass --mix-devices")


def summarize(pairs: Sequence[Pair], keys: dict[str, str], records: dict[str, dict]) -> SuiteSummary:
    """The table and the scores, from the stored records alone."""
    rows = []
    for pair in pairs:
        record = records.get(keys.get(pair.name, ""))
        if pair.candidate is None:
            rows.append(SuiteRow(pair.name, "missing", reason="no solution file"))
        elif record is None:
            rows.append(SuiteRow(pair.name, "not_run", reason="not evaluated yet"))
        else:
            gate2, roof = record.get("gate2"), record.get("roofline")
            rows.append(SuiteRow(
                name=pair.name,
                status=record["status"],
                speedup=gate2["speedup"] if gate2 else None,
                speedup_low=_low(gate2),
                reference_ms=gate2["stats"]["reference"]["median_ms"] if gate2 else None,
                candidate_ms=gate2["stats"]["candidate"]["median_ms"] if gate2 else None,
                pct_of_roof=roof["candidate"]["pct_of_roof"] if roof else None,
                defences=record.get("defences") or [],
                reason=record.get("reason"),
                device=_device(record),
                gpus=gpus_used(record),
            ))
    total = len(rows)
    fast_p = {p: sum(fast(row, p) for row in rows) / total for p in FAST_P}
    speedups = [row.speedup for row in rows if row.correct and row.speedup > 0]
    geomean = math.exp(sum(math.log(s) for s in speedups) / len(speedups)) if speedups else None
    devices = sorted({row.device for row in rows if row.device is not None})
    return SuiteSummary(rows=rows, fast_p=fast_p, geomean_speedup=geomean, devices=devices)


def fast(row: SuiteRow, p: float) -> bool:
    """Does this row count towards fast_p? (See the module's docstring.)"""
    if p < 1.0:
        return row.correct and row.speedup > p
    low = row.speedup_low if row.speedup_low is not None else row.speedup
    return row.status == "passed" and low > p


def _low(gate2: dict | None) -> float | None:
    verdict = (gate2 or {}).get("verdict")
    return verdict.get("low") if isinstance(verdict, dict) else None


def _device(record: dict) -> str | None:
    """The device a record ran on; None where its evaluation never reached one."""
    device = record.get("device")
    if not isinstance(device, dict) or device.get("kind") in (None, "unknown"):
        return None
    return device.get("name")

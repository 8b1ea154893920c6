"""pass@k and fast_p@k of a model's attempts: what share of problems it solves in k tries.

    pass_at_k(n=10, c=3, k=1)                 # 0.3
    table = estimate(attempts, ks=(1, 5))     # per problem, and the mean over problems
    curve = turn_curve(attempts)              # success by turn t

The estimator is Chen et al. 2021 (HumanEval): with n samples of which c are correct,
pass@k = 1 - C(n - c, k) / C(n, k), the chance that at least one of k samples drawn
without replacement is correct. It is unbiased for every k <= n; k > n has no unbiased
estimate and is refused. fast_p@k is the same estimator with f, the samples that are
correct and faster than p (KernelBench's fast_p, turned into a per-sample event).

A sample is one independent try at a problem: a chain of turns, each turn one attempt
record (`kforge machine`), each turn told what the previous one got. A sample counts as
correct (or fast_p) if ANY of its turns is, the standard for multi-turn runs: the model
gets to fix its mistakes, and the sample's outcome is the best it reached. An attempt
whose request failed got no reply: it says nothing about the model, so it is no turn, and
a sample made only of them is no sample (loop.py counts them the same way).

Whether one turn is correct or fast_p is the harness's own rule (suite.py), on the row the
suite would build from its EvalRecord: correct is gate 1 passed and no defence fired
(status passed, slower or tie); fast_p for p >= 1 is status "passed" with the lower end of
the speedup's 95% interval above p; for p < 1 correct with a speedup above p. An attempt
with no record (no code, two candidate files, a failed request) is neither.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kforge.harness.suite import FAST_P, SuiteRow, fast

DEFAULT_K = (1, 5, 10)
ATTEMPT_KIND = "machine_attempt"
REQUEST_FAILED = "request_failed"


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n - c, k) / C(n, k) for n samples of which c are correct (module docstring).

    Computed as 1 - prod_{i = n-c+1}^{n} (1 - k / i), which never forms a binomial
    coefficient (C(200, 100) overflows a float).
    """
    for name, value in (("n", n), ("c", c), ("k", k)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    if not 0 <= c <= n:
        raise ValueError(f"c must be within 0..n ({n}), got {c}")
    if not 1 <= k <= n:
        raise ValueError(f"k must be within 1..n ({n}): pass@{k} has no unbiased estimate from {n} samples")
    if n - c < k:  # every draw of k holds a correct sample
        return 1.0
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product


def fast_p_at_k(n: int, f: int, k: int) -> float:
    """fast_p@k: pass_at_k with f, the samples correct and faster than p."""
    return pass_at_k(n, f, k)


# --- from attempt records to samples ----------------------------------------------------


def attempt_row(attempt: dict) -> SuiteRow:
    """The row suite.summarize would build from the attempt's EvalRecord (its status alone
    where there is none), so that `fast` and `SuiteRow.correct` judge it."""
    record = attempt.get("record")
    name = (attempt.get("problem") or {}).get("name") or "?"
    if not record:
        return SuiteRow(name, attempt.get("status") or "unknown", reason=attempt.get("reason"))
    gate2, roof = record.get("gate2"), record.get("roofline")
    stats = (gate2 or {}).get("stats") or {}
    verdict = (gate2 or {}).get("verdict")
    return SuiteRow(
        name=name,
        status=record["status"],
        speedup=gate2.get("speedup") if gate2 else None,
        speedup_low=verdict.get("low") if isinstance(verdict, dict) else None,
        reference_ms=(stats.get("reference") or {}).get("median_ms"),
        candidate_ms=(stats.get("candidate") or {}).get("median_ms"),
        pct_of_roof=((roof or {}).get("candidate") or {}).get("pct_of_roof"),
        defences=record.get("defences") or [],
        reason=record.get("reason"),
    )


def is_correct(attempt: dict) -> bool:
    return attempt_row(attempt).correct


def is_fast(attempt: dict, p: float) -> bool:
    row = attempt_row(attempt)
    return row.speedup is not None and fast(row, p)


@dataclass
class Sample:
    """One chain of turns at one problem, in turn order."""

    run: str
    problem: str  # the problem's label (problem_labels)
    sample: int
    turns: list[dict] = field(default_factory=list)

    def upto(self, turn: int | None) -> list[dict]:
        return self.turns if turn is None else [a for a in self.turns if a["turn"] <= turn]

    def correct(self, turn: int | None = None) -> bool:
        """Whether any turn (up to `turn`, when given) is correct."""
        return any(is_correct(a) for a in self.upto(turn))

    def fast(self, p: float, turn: int | None = None) -> bool:
        return any(is_fast(a, p) for a in self.upto(turn))


def attempts_of(records: Iterable[dict]) -> list[dict]:
    """The machine attempts among records, one per id (the last wins: a file copied into
    the store twice counts once)."""
    by_id: dict[str, dict] = {}
    for record in records:
        if record.get("kind") == ATTEMPT_KIND:
            by_id[record["id"]] = record
    return list(by_id.values())


def problem_labels(attempts: Sequence[dict]) -> dict[tuple[str, str], str]:
    """(name, sha256) -> label: the name, or name@sha prefix where one name has two contents
    (an edited problem file is another problem)."""
    keys = {((a.get("problem") or {}).get("name") or "?", (a.get("problem") or {}).get("sha256") or "")
            for a in attempts}
    names = [name for name, _ in keys]
    return {(name, sha): name if names.count(name) == 1 else f"{name}@{sha[:8]}" for name, sha in keys}


def samples(attempts: Iterable[dict]) -> list[Sample]:
    """The answered attempts grouped into samples: by run, problem and sample number."""
    attempts = [a for a in attempts_of(attempts) if a.get("status") != REQUEST_FAILED]
    labels = problem_labels(attempts)
    grouped: dict[tuple, Sample] = {}
    for a in attempts:
        problem = a.get("problem") or {}
        label = labels[(problem.get("name") or "?", problem.get("sha256") or "")]
        key = (a["run"], label, a["sample"])
        grouped.setdefault(key, Sample(a["run"], label, a["sample"])).turns.append(a)
    for sample in grouped.values():
        sample.turns.sort(key=lambda a: a["turn"])
    return sorted(grouped.values(), key=lambda s: (s.problem, s.run, s.sample))


# --- tables -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ProblemEstimate:
    problem: str
    n: int  # samples
    c: int  # samples with a correct turn
    f: dict[float, int]  # p -> samples with a fast_p turn
    pass_at: dict[int, float | None]  # k -> pass@k (None: k > n)
    fast_at: dict[float, dict[int, float | None]]  # p -> k -> fast_p@k


@dataclass(frozen=True)
class SuiteEstimate:
    problems: list[ProblemEstimate]
    ks: tuple[int, ...]
    ps: tuple[float, ...]
    pass_at: dict[int, float | None]  # the mean over problems (None: some problem has fewer than k samples)
    fast_at: dict[float, dict[int, float | None]]


def _at(n: int, hits: int, ks: Sequence[int]) -> dict[int, float | None]:
    return {k: pass_at_k(n, hits, k) if k <= n else None for k in ks}


def _mean(values: list[float | None]) -> float | None:
    return None if not values or any(v is None for v in values) else sum(values) / len(values)


def estimate(attempts: Iterable[dict], ks: Sequence[int] = DEFAULT_K, ps: Sequence[float] = FAST_P) -> SuiteEstimate:
    """pass@k and fast_p@k per problem, and their mean over problems (each problem weighs
    the same, however many samples it has)."""
    by_problem: dict[str, list[Sample]] = {}
    for sample in samples(attempts):
        by_problem.setdefault(sample.problem, []).append(sample)
    rows = []
    for problem, group in sorted(by_problem.items()):
        n, c = len(group), sum(s.correct() for s in group)
        f = {p: sum(s.fast(p) for s in group) for p in ps}
        rows.append(ProblemEstimate(problem, n, c, f, _at(n, c, ks), {p: _at(n, f[p], ks) for p in ps}))
    return SuiteEstimate(
        problems=rows, ks=tuple(ks), ps=tuple(ps),
        pass_at={k: _mean([r.pass_at[k] for r in rows]) for k in ks},
        fast_at={p: {k: _mean([r.fast_at[p][k] for r in rows]) for k in ks} for p in ps},
    )


@dataclass(frozen=True)
class TurnPoint:
    turns: int  # the first `turns` turns of each sample (1: the first try alone)
    correct: float  # the share of samples with a correct turn among them, mean over problems
    fast: dict[float, float]  # p -> the share with a fast_p turn among them


def turn_curve(attempts: Iterable[dict], ps: Sequence[float] = FAST_P) -> list[TurnPoint]:
    """Success by turn t: per problem, the share of its samples that succeeded within their
    first t turns (pass@1 given t turns), averaged over problems. A sample that stopped
    before turn t keeps the outcome it had when it stopped."""
    all_samples = samples(attempts)
    by_problem: dict[str, list[Sample]] = {}
    for sample in all_samples:
        by_problem.setdefault(sample.problem, []).append(sample)
    numbers = sorted({a["turn"] for s in all_samples for a in s.turns})  # as recorded (loop.py counts from 0)

    def share(test) -> float:
        return sum(sum(map(test, group)) / len(group) for group in by_problem.values()) / len(by_problem)

    return [TurnPoint(i + 1, share(lambda s, t=t: s.correct(t)), {p: share(lambda s, t=t, p=p: s.fast(p, t))
                                                                  for p in ps})
            for i, t in enumerate(numbers)]

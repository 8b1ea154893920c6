"""The loop: k independent samples, each up to n turns of reply -> extraction -> judge -> feedback.

    store = AttemptStore(Path("kforge-results/machine-softmax.jsonl"))
    run = run_machine(settings, client, store, facts=facts, messages=first, slots=[0, 1], device_name=...)

Each turn of a sample: the conversation so far goes to the model; the one code block
defining ModelNew is taken from its reply (extract.py) and checked statically (checks.py);
the file is judged by `evaluate_isolated`, the same judge as `kforge eval` (the model's code
never runs in this process); the outcome becomes the next turn's user message (prompt.py).
A sample stops once an attempt passes both gates, unless told to keep going; a sample
whose request fails (the endpoint is gone) or whose reply a person has not written yet
(manual mode) stops there, to be picked up by the next run.

Samples run in parallel: their requests concurrently (a thread each, up to
MAX_CONCURRENT_SAMPLES), their evaluations over a pool of slots, one evaluation per GPU
at a time (one slot on a CPU), the way `kforge suite` shares GPUs.

Every attempt is one sealed line in the store (kforge.harness.record's format), appended
and fsynced as it ends; nothing is rewritten. The run id is a hash of what defines the
experiment (the first prompt, the model, the endpoint, the sampling settings), so running
the same command again finds its attempts and skips them (key: run, sample, turn and the
problem's hash); a request that failed is asked again; --force asks everything again,
appending, and the latest attempt of an id counts.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from kforge.harness.profile import ProfileSummary, profile_lines
from kforge.harness.record import EvalRecord, canonical_json, read_records, sealed_line
from kforge.machine.checks import static_flags
from kforge.machine.client import RequestFailed, Waiting
from kforge.machine.extract import extract_code
from kforge.machine.prompt import ProblemFacts, feedback_text

KIND = "machine_attempt"
SCHEMA = 1
MAX_CONCURRENT_SAMPLES = 8
CANDIDATE_FILE = "candidate.py"
PROFILED = ("passed", "slower", "tie")  # gate 1 passed: what is worth profiling
Profile = Callable[[Path, Path, "int | None"], "ProfileSummary | str"]


@dataclass(frozen=True)
class Settings:
    problem: Path
    backend: str  # "triton" or "cuda"
    model: str
    samples: int = 1
    turns: int = 1
    temperature: float = 0.7
    max_tokens: int = 8192
    keep_going: bool = False  # go on after a sample passed, for a faster kernel
    force: bool = False  # ask and judge again what the store has


class AttemptStore:
    """The JSONL store of attempts: appended to, never rewritten."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.lock = threading.Lock()

    def attempts(self) -> list[dict]:
        """Every verified attempt, in file order (a rejected line warns: read_records)."""
        if not self.path.is_file():
            return []
        return [r for r in read_records(self.path) if r.get("kind") == KIND]

    def append(self, attempt: dict) -> None:
        """One sealed line, fsynced; a torn last line is ended first, never glued to this one."""
        data = (sealed_line(attempt) + "\n").encode("utf-8")
        with self.lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a+b") as handle:
                end = handle.seek(0, os.SEEK_END)
                if end:
                    handle.seek(end - 1)
                    if handle.read(1) != b"\n":
                        data = b"\n" + data
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())


def run_id(facts: ProblemFacts, settings: Settings, endpoint: str, messages: list[dict]) -> str:
    """Names the experiment: the same prompt, model, endpoint and sampling give the same id.
    The counts of samples and turns are left out, so a larger --samples extends a run."""
    identity = {"messages": messages, "model": settings.model, "endpoint": endpoint, "backend": settings.backend,
                "temperature": settings.temperature, "max_tokens": settings.max_tokens}
    digest = hashlib.sha256(canonical_json(identity).encode("utf-8")).hexdigest()
    return f"{facts.name}-{settings.backend}-{digest[:10]}"


@dataclass
class MachineRun:
    run: str
    attempts: list[dict]  # the run's attempts from the store, the latest per id, by sample then turn
    ran: int = 0  # attempts this call made
    waiting: list[Waiting] = field(default_factory=list)  # manual mode: replies still to write
    failures: list[str] = field(default_factory=list)  # this call's failed requests, one line each


Evaluate = Callable[[Path, Path, "int | None"], EvalRecord]


def run_machine(settings: Settings, client, store: AttemptStore, *, facts: ProblemFacts, messages: list[dict],
                slots: list[int | None], device_name: str, options: dict | None = None,
                candidates: Path | None = None, evaluate: Evaluate | None = None,
                on_attempt: Callable[[dict], None] | None = None, profile: Profile | None = None) -> MachineRun:
    """Run every sample and turn the store lacks (module docstring).

    `client` has .endpoint and .complete(messages, attempt_id) (client.py). `options` go to
    evaluate_isolated (timing, limits, ceilings...), unless `evaluate(problem, candidate,
    gpu)` replaces it. Candidate files go to `candidates`/<run>/s<k>/t<n>/candidate.py
    (default: beside the store, in a folder named after it). With `profile(problem,
    candidate, gpu)` (kforge.harness.profile), each attempt that passed gate 1 is profiled on
    the GPU it was judged on, still holding it, and the profile's lines join its feedback.
    """
    from kforge.harness.evaluate import identity
    from kforge.harness.isolation import evaluate_isolated

    if evaluate is None:
        def evaluate(problem: Path, candidate: Path, gpu: int | None) -> EvalRecord:
            return evaluate_isolated(problem, candidate, gpu=gpu, device_name=device_name, **(options or {}))

    run = run_id(facts, settings, client.endpoint, messages)
    problem = identity(settings.problem)
    candidates = candidates or store.path.with_suffix("")
    done = {} if settings.force else {
        a["id"]: a for a in store.attempts()
        if a.get("run") == run and a["problem"]["sha256"] == problem["sha256"] and a["status"] != "request_failed"}
    free: queue.Queue[int | None] = queue.Queue()
    for slot in slots:
        free.put(slot)
    result = MachineRun(run, [])
    lock = threading.Lock()

    def attempt(sample: int, turn: int, parent: str | None, prompt: list[dict]) -> dict | None:
        aid = f"{run}/s{sample}/t{turn}"
        started = time.monotonic()
        base = {"kind": KIND, "schema": SCHEMA, "id": aid, "run": run, "problem": problem, "sample": sample,
                "turn": turn, "parent": parent, "model": settings.model, "backend": settings.backend,
                "endpoint": client.endpoint, "prompt": prompt}
        try:
            reply = client.complete(prompt, aid)
        except Waiting as waiting:
            with lock:
                result.waiting.append(waiting)
            return None
        except RequestFailed as exc:
            with lock:
                result.failures.append(f"{aid}: {exc.reason}")
            return {**base, "reply": None, "code": None, "code_sha256": None, "status": "request_failed",
                    "reason": exc.reason, "record": None, "static_flags": [], "feedback": "", "usage": None,
                    "elapsed_s": time.monotonic() - started, "created": _now()}
        extraction = extract_code(reply.text)
        code, record, flags, profiled = extraction.code, None, [], None
        status, reason = extraction.status, extraction.reason
        if code is not None:
            flags = [f.to_dict() for f in static_flags(code, facts.forbidden_ops)]
            path = candidates / run / f"s{sample}" / f"t{turn}" / CANDIDATE_FILE
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(code)
            gpu = free.get()
            try:
                record = evaluate(settings.problem, path, gpu).to_dict()
                if profile is not None and record["status"] in PROFILED:
                    found = profile(settings.problem, path, gpu)
                    profiled = found if isinstance(found, str) else found.to_dict()
            finally:
                free.put(gpu)
            status, reason = record["status"], record["reason"]
        copy_gbps = ((((record or {}).get("roofline") or {}).get("ceilings")) or {}).get("copy_gbps")
        lines = profile_lines(profiled, copy_gbps) if profiled is not None else None
        return {**base, "reply": reply.text, "code": code,
                "code_sha256": hashlib.sha256(code.encode("utf-8")).hexdigest() if code is not None else None,
                "status": status, "reason": reason, "record": record, "static_flags": flags, "profile": profiled,
                "feedback": feedback_text(status, reason, record, flags, CANDIDATE_FILE, lines), "usage": reply.usage,
                "elapsed_s": time.monotonic() - started, "created": _now()}

    def run_sample(sample: int) -> None:
        prompt, parent = list(messages), None
        for turn in range(settings.turns):
            made = done.get(f"{run}/s{sample}/t{turn}")
            if made is None:
                made = attempt(sample, turn, parent, prompt)
                if made is None:
                    return
                store.append(made)
                with lock:
                    result.ran += 1
                if on_attempt:
                    on_attempt(made)
                if made["status"] == "request_failed":
                    return
            if made["status"] == "passed" and not settings.keep_going:
                return
            # the conversation goes on from what was sent and said, as stored
            prompt = [*made["prompt"], {"role": "assistant", "content": made["reply"] or ""},
                      {"role": "user", "content": made["feedback"]}]
            parent = made["id"]

    with ThreadPoolExecutor(max_workers=max(1, min(settings.samples, MAX_CONCURRENT_SAMPLES))) as pool:
        for future in [pool.submit(run_sample, s) for s in range(settings.samples)]:
            future.result()
    result.attempts = run_attempts(store.attempts(), run, problem["sha256"])
    return result


def run_attempts(attempts: list[dict], run: str, problem_sha: str) -> list[dict]:
    """A run's attempts, the latest per id, ordered by sample then turn."""
    latest = {a["id"]: a for a in attempts if a.get("run") == run and a["problem"]["sha256"] == problem_sha}
    return sorted(latest.values(), key=lambda a: (a["sample"], a["turn"]))


@dataclass
class Scores:
    samples: int  # samples with an answered attempt (a failed request is no answer of the model's)
    correct: int  # samples with a correct turn: gate 1 passed and no defence fired
    fast: int  # samples with a fast_1 turn: passed, the speedup's 95% interval above 1
    pass_at: dict[int, float]  # k -> pass@k
    fast_1_at: dict[int, float]  # k -> fast_1@k


def scores(attempts: list[dict]) -> Scores:
    """pass@k and fast_1@k over a run's samples (estimators.py's rules), for k = 1 and k = n."""
    from kforge.machine.estimators import is_correct, is_fast, pass_at_k

    by_sample: dict[int, list[dict]] = {}
    for a in attempts:
        if a["status"] != "request_failed":
            by_sample.setdefault(a["sample"], []).append(a)
    n = len(by_sample)
    correct = sum(any(is_correct(a) for a in turns) for turns in by_sample.values())
    fast = sum(any(is_fast(a, 1.0) for a in turns) for turns in by_sample.values())
    ks = sorted({1, n}) if n else []
    return Scores(n, correct, fast, {k: pass_at_k(n, correct, k) for k in ks},
                  {k: pass_at_k(n, fast, k) for k in ks})


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")

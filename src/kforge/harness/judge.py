"""The judge: one evaluation across three processes, the candidate's code in none of its own.

    judge (this process)  seed, re-check draws, stage deadlines, statistics, the record
     ├─ reference worker  the problem file: inputs, the reference, every comparison
     └─ warden            a subreaper; kills all the candidate starts (warden.py)
         └─ candidate's worker, confined: the candidate file, its calls, its own timings

The reference worker starts first and never imports the candidate. The candidate's
worker sees only what the arena lends it (the constructor's arguments, the current input
set, the mailbox for its outputs) and is stopped (SIGSTOP, with everything it started)
whenever it is not being asked something, so nothing of it runs while the reference
runs or while its outputs are compared. What it replies are claims:

- correctness: the reference worker reads the outputs from the mailbox and compares
  them; the worker's description of them can only make it fail;
- timings: every call is also timed here, from the command to the reply plus a GPU
  probe from this process, which cannot finish before work the candidate left on the
  GPU (contexts of different processes take turns): the judge's clock cannot be
  shortened by the candidate. The claimed time of a call is trusted only as far as the
  gap between this clock and the claim matches the reference's gap (`ClaimsCheck`);
- which rounds are re-checked is drawn here, after the candidate's reply, from the
  operating system's random source.

See docs/harness.md for the threat model: what this defends and what it does not.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kforge.errors import KforgeError
from kforge.harness import containment
from kforge.harness.channel import Channel, ChannelError
from kforge.harness.evaluate import (AA, BB, STATUS_OF_DEFENCE, TRUSTED, derive_seed, exposed_seeds, gate2_fields,
                                     gate2_verdict, host_bound, identity, pair_key, roofline_fields, speed_verdict)
from kforge.harness.record import EvalRecord
from kforge.harness.roofline import Ceilings, get_ceilings, roofline_for
from kforge.harness.shared import scratch_root
from kforge.harness.timing import (Clocks, StopRule, TimingConfig, TimingRun, TimingStats, call_profiles, per_call_ms,
                                   scripted, sync_costs)

LOG_TAIL = 4000  # characters of a worker's output kept in a crash record
HARNESS = Path(__file__).resolve().parent
BOOT_S = 120.0  # for both workers to start (importing torch takes seconds, more on a busy machine)
WARDEN_WAIT_S = 30.0  # to start the candidate's worker, or to kill and reap its tree
# The judge's cover before each timed call (ms): twice the reference's host time, within
# these bounds. Long enough for a stopped worker to wake and launch (a 0.5 ms cover left a
# 10 us add's candidate at 0.51x its reference, its launch inside the window); short
# enough that the GPU never hands the worker a time slice mid-cover (a 4 ms sleep of the
# judge's grew a matmul's window by 0.38 ms, a 2 ms one by under 1%; H100, 2026-11-27).
COVER_MS = (1.0, 1.5)
# Passes of gate 2 on which the claims check must fire before it rejects (the second, on
# fresh draws, runs only when the first fired).
CLAIMS_PASSES = 2
NOISE_Z = 4.0  # the claims check's allowance grows by this many standard errors of the gaps' noise


@dataclass
class StageLimits:
    """Seconds each stage may take before its worker is killed."""

    load_s: float = 600.0  # import and build: a CUDA extension may compile here
    gate1_s: float = 600.0  # includes the first calls' JIT compilation and autotuning
    gate2_s: float | None = None  # default: 3x the timing budget + 300 s (warm-up, roofline)

    def for_stage(self, stage: str, timing: TimingConfig) -> float:
        if stage == "boot":  # the workers import torch and kforge: no user code yet
            return BOOT_S
        if stage == "gate2":
            return self.gate2_s if self.gate2_s is not None else 3 * timing.budget_s + 300.0
        if stage == "gate1":
            return self.gate1_s
        return self.load_s


@dataclass(frozen=True)
class ClaimsCheck:
    """How far the candidate's claimed call times may sit under the judge's own clock.

    For each call, gap = the judge's time for it minus the claimed whole-device time. The
    judge's time is the wall clock of the `prepare` command (the worker holds the round's
    inputs from then on: work done there on the answer would be on no other clock), plus,
    on a GPU, `held_ms` on the judge's own CUDA events, from the end of its cover to the
    worker's reply (on a CPU, the `time` command's wall clock). An honest gap is the
    protocol (the input copy, the copy into the mailbox, the pipes), the same for both
    workers, which run the same kforge code; launches the cover hid are before its end,
    and launches it did not hide are inside the claimed window as the device waiting. A
    claim shortened by d ms, or d ms of the call's work done in `prepare`, widens the gap
    by d. The check fires when the candidate's median gap differs from the reference's by
    more than `abs_ms + rel * the candidate's median claimed time + NOISE_Z * noise`, where
    noise is the standard error of a difference of two medians of the reference's own gaps
    (its two timings a round; the candidate's gaps cannot widen it): a host the scheduler
    keeps busy moves every gap by milliseconds, and the check loosens only as far as the
    reference shows. The workers' host clocks decide nothing.
    """

    abs_ms: float
    rel: float

    @classmethod
    def for_device(cls, is_cuda: bool) -> ClaimsCheck:
        # GPU: honest candidates' median gaps sat 0.01-0.31 ms above the reference's (H100,
        # 2026-11-27: the vector add, its identity, softmax and the row-sum fixtures, ~1.6 ms
        # gaps); CPU: a shared 2-core machine's scheduler moves them by milliseconds.
        return cls(abs_ms=0.5, rel=0.02) if is_cuda else cls(abs_ms=5.0, rel=0.5)

    def excess_ms(self, gaps: dict[str, list[float]], claimed_ms: float) -> tuple[float, float, float]:
        """(the candidate's median gap minus the reference's, the allowance, its noise term),
        each side's median over both its calls of every round."""
        candidate, reference = gaps["candidate"] + gaps.get(BB, []), gaps["reference"] + gaps.get(AA, [])
        excess = statistics.median(candidate) - statistics.median(reference)
        noise = median_difference_error(reference, len(candidate))
        return excess, self.abs_ms + self.rel * claimed_ms + NOISE_Z * noise, noise


def median_difference_error(samples: list[float], n: int) -> float:
    """The standard error of the difference of two medians of n draws each, from the
    samples' interquartile range: sigma ~ IQR / 1.349, a median's error ~ 1.2533 sigma / sqrt(n)
    (robust to the few calls a busy scheduler delays by far more)."""
    if len(samples) < 4 or n < 1:
        return 0.0
    q1, _, q3 = statistics.quantiles(samples, n=4)
    return math.sqrt(2.0 / n) * 1.2533 * (q3 - q1) / 1.349


def worker_cpus(setting: int | str | None, gpu: int | None, on_gpu: bool, gpus: int = 1) -> list[int] | None:
    """The CPU both workers are held to (`TimingConfig.worker_cpu`), or None.

    A launch-bound call is as fast as the CPU that launches it, and the CPUs of a virtual
    machine are not alike: two processes of the same network, free to move or on two
    CPUs, timed 0.6-1.7x each other; on one shared CPU 0.96-1.05x (H200 VM, 16 vCPUs,
    2026-11-28). The workers never run at once (each is stopped outside its commands), so
    one CPU serves both without contention. The judge pins them when gate 2 starts (boot,
    builds and gate 1 keep every CPU); a seccomp filter from their start keeps either from
    moving. "auto" takes one per GPU index from the top of
    this process's CPUs (the lowest are where a host keeps its housekeeping), none on a
    CPU device, whose problems want every core they can get, nor for a problem on several
    GPUs (`gpus`), whose libraries (NCCL) place their own threads."""
    allowed = sorted(os.sched_getaffinity(0))
    if setting is None or (setting == "auto" and (not on_gpu or gpus > 1 or len(allowed) < 2)):
        return None
    if setting == "auto":  # judges of other GPUs on this host get other CPUs (Ray's too: by physical id)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
        slot = gpu if isinstance(gpu, int) else int(visible) if visible.isdigit() else 0
        if slot >= len(allowed) - 1:  # more GPUs than CPUs to give: sharing one would be worse than none
            return None
        return [allowed[len(allowed) - 1 - slot]]
    if setting not in allowed:
        raise KforgeError(f"worker CPU {setting} is not one this process may use ({_ranges(allowed)})")
    return [setting]


def _ranges(cpus: list[int]) -> str:
    spans: list[list[int]] = []
    for cpu in cpus:
        if spans and cpu == spans[-1][1] + 1:
            spans[-1][1] = cpu
        else:
            spans.append([cpu, cpu])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


class Ended(Exception):
    """The evaluation ends early with this record's status and reason."""

    def __init__(self, status: str, reason: str, details: str | None = None, defences: tuple[str, ...] = (),
                 **fields):
        super().__init__(reason)
        self.status, self.reason, self.details, self.defences, self.fields = status, reason, details, defences, fields


@dataclass
class _Worker:
    channel: Channel
    process: subprocess.Popen
    log: Path
    name: str

    def tail(self) -> str | None:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return None
        return text[-LOG_TAIL:] or None


@dataclass
class Judge:
    problem: Path
    candidate: Path
    baseline: str = "eager"
    trials: int = 5
    timing: TimingConfig = field(default_factory=TimingConfig)
    size: str | None = None
    ceilings: Ceilings | None = None
    command: str | None = None
    gpu: int | None = None
    gpus: tuple[int | str, ...] = ()  # the workers' GPUs when several; the first is the judge's own (`gpu`)
    device_name: str | None = None
    limits: StageLimits = field(default_factory=StageLimits)
    on_stage: Callable[[str], None] | None = None
    min_speedup: float | None = None  # the bar for "passed" (default: 1 + the measured noise floor)

    def run(self) -> EvalRecord:
        self.cpus = worker_cpus(self.timing.worker_cpu, self.gpu, _cuda_available(), len(self.gpus))
        self.seed = secrets.randbits(63)
        self.rng = secrets.SystemRandom()
        self.stage = "start"
        self.warnings: list[str] = []
        self.defences: list[str] = []
        self.hello: dict = {}
        self.setup: dict = {}  # the reference's, once it is built
        self.reference = self.warden = self.worker = self.gate1 = self.worker_pid = None
        self._probe_tensor = self._rest_timer = None  # the judge's own CUDA context, on a GPU
        self.held_ms = None  # the last timed call's turn on the GPU, on the judge's events (_reply_seen)
        self.scratch = Path(tempfile.mkdtemp(prefix="kforge-", dir=scratch_root()))
        # The arena's file (used on a CPU) exists before either worker starts, in a folder the
        # candidate cannot write: it can write the file's bytes, never swap it for a link.
        (self.scratch / "shared").mkdir()
        self.arena_file = self.scratch / "shared" / "arena"
        self.arena_file.touch(mode=0o600, exist_ok=False)
        try:
            record = self._evaluate()
        except Ended as ended:
            record = self._record(ended.status, ended.reason, details=ended.details,
                                  defences=list(ended.defences), **ended.fields)
        finally:
            survivors = self._shut_down()
            shutil.rmtree(self.scratch, ignore_errors=True)
        if survivors:  # SIGKILL could not end them (a process stuck in the kernel, say)
            record.defences.append("process_leak")
            record.warnings.append(f"processes the candidate started outlived the kill: {survivors}")
        return record

    # --- the stages ------------------------------------------------------------------------

    def _evaluate(self) -> EvalRecord:
        # Both workers boot (import torch: kforge's own code, on its own limit) at once; the
        # candidate's file is imported only once the reference is built and fingerprinted.
        self._enter("boot")
        self.reference = self._start_reference()
        self.worker = self._start_candidate()
        self._await_reference_hello()
        self._await_candidate_hello()
        self._enter("load")
        setup = self._ask_reference({"op": "setup", "init_seed": derive_seed(self.seed, "init"),
                                     "probe_seed": derive_seed(self.seed, "probe")})
        self.setup = setup
        self.problem_meta = setup["problem"]
        self._ask_candidate({"op": "setup", **self._candidate_job(setup)})
        self._ask_candidate({"op": "load"})
        self._check_reference_state()

        self._enter("gate1")
        gate1 = self.gate1 = self._gate1()
        self._check_reference_state()
        if not gate1["passed"]:
            fired = {"output_type": "plain_tensor", "mutated_inputs": "input_clones", "poison": "poison",
                     "late_output": "late_output"}.get(gate1["failure"])
            raise Ended("incorrect", f"gate 1 failed: {gate1['reason']}", gate1=gate1,
                        defences=(fired,) if fired else ())

        self._enter("gate2")
        # A claims check that fires is confirmed on a second pass of fresh draws before it
        # rejects: a forger's gap is there on every pass, a busy host's moment is not.
        fired = []
        for attempt in range(CLAIMS_PASSES):
            if attempt:  # the confirming pass has the stage's time limit of its own
                self.deadline = time.monotonic() + self._limit()
            run, gaps, check = self._gate2(attempt)
            self._check_reference_state()
            claimed = run.stats["candidate"].median_ms
            if claimed <= 0:
                raise Ended("rejected", "the candidate's worker claimed calls that took no time: its timings were "
                                        "forged", defences=("timing_claims",))
            cuda = self._device_info().is_cuda
            verdict = speed_verdict(run.per_call, self.min_speedup, cuda and host_bound(run.profile),
                                    cpu_device=not cuda)
            excess, allowed, noise = check.excess_ms(gaps, claimed)
            claims = {"median_gap_ms": {name: statistics.median(g) for name, g in gaps.items()},
                      "excess_ms": excess, "allowed_ms": allowed, "noise_ms": noise, "passes": attempt + 1}
            if abs(excess) <= allowed:
                break
            fired.append(excess)
        if len(fired) == CLAIMS_PASSES:
            direction = "shorter" if excess > 0 else "longer"
            each = " and ".join(f"{abs(e):.3g}" for e in fired)
            raise Ended("rejected", f"the candidate's worker claimed calls {each} ms {direction} than the judge's own "
                                    f"clock allows (more than {allowed:.3g} ms) on each of {CLAIMS_PASSES} passes: "
                                    "its timings were forged",
                        gate1=gate1, gate2=gate2_fields("rejected", run, verdict, claims=claims),
                        defences=("timing_claims",))
        if fired:
            self.warnings.append(f"the claims check fired on a first pass ({fired[0]:+.3g} ms against "
                                 f"{allowed:.3g} ms allowed) and not on the second, whose timings are the record's")

        ceilings = self.ceilings or get_ceilings(self._device_info())
        roof = roofline_for(flops=setup["flops"], nbytes=setup["bytes"], compute_dtype=setup["compute_dtype"],
                            ceilings=ceilings)
        status, reason = gate2_verdict(run, roof, ceilings, self.baseline, self.warnings, self.defences, verdict)
        return self._record(status, reason, gate1=gate1, gate2=gate2_fields(status, run, verdict, claims=claims),
                            roofline=roofline_fields(roof, run, ceilings))

    def _gate1(self) -> dict:
        # the problem's own draws, then the exposing ones (problem.expose), all drawn here
        exposed = exposed_seeds(self.seed, int(self.setup.get("exposed_trials", 0)))
        seeds = [derive_seed(self.seed, "trial", i) for i in range(self.trials)] + exposed
        worst, passed, skipped = None, 0, 0
        report = dict(atol=self.setup["tolerance"][0], rtol=self.setup["tolerance"][1],
                      rel_l2_bound=self.setup.get("rel_l2_bound"), seeds=seeds, exposed_trials=len(exposed))
        for trial, seed in enumerate(seeds, start=1):
            is_exposed = trial > self.trials
            self._ask_reference({"op": "draw", "seed": seed, "exposed": is_exposed})
            reply = self._ask_candidate({"op": "call"})
            forbidden = sorted(set(self.setup["forbidden_ops"]) & set(_strings(reply.get("ops"))))
            if forbidden:
                raise Ended("rejected", f"the candidate called {', '.join(forbidden)}, which the problem forbids",
                            defences=("forbidden_op",))
            finite = self._ask_reference({"op": "reference"}).get("finite", True)
            if is_exposed and not finite:
                skipped += 1
                continue
            result = self._ask_reference({"op": "compare", **_claims(reply)})["comparison"]
            worst = result if worst is None else _worse(worst, result)
            if not result["ok"]:
                where = "an exposing draw" if is_exposed else "trial"
                return _gate1_report(report, False, trial, passed, skipped, worst,
                                     f"{where} {trial}: {result['reason']}", result["failure"])
            passed += 1
        return _gate1_report(report, True, len(seeds), passed, skipped, worst, None, None)

    def _gate2(self, attempt: int = 0) -> tuple[TimingRun, dict[str, list[float]], ClaimsCheck]:
        """One pass of gate 2: warm-up, then rounds until decided. `attempt` > 0 is a pass
        that confirms a fired claims check, on draws of its own."""
        config = self.timing
        t0 = time.perf_counter()
        if self.cpus:  # both trees stopped, so no thread starts while they are walked
            self._stop_tree(self._reference_tree)
            containment.pin([*self._reference_tree(), *self._candidate_tree()], self.cpus)
        self._ask_reference({"op": "draw", "seed": derive_seed(self.seed, f"pool{attempt or ''}", 0)})
        warm = self._ask_reference({"op": "warm", "min_calls": config.min_warmup_calls, "seconds": config.warmup_s})
        cand_warm = self._ask_candidate({"op": "warm", "min_calls": config.min_warmup_calls,
                                         "seconds": config.warmup_s})
        candidate_warmup_calls = _count(cand_warm.get("calls"), "candidate")
        # The GPU's rest before each call is sized from the reference alone, and queued
        # from the judge's own process, with the L2 flush: neither can be skipped.
        cover = None
        if self._rest_timer is not None:
            low, high = COVER_MS
            self._rest_timer.set_cover(min(max(2 * _number(warm.get("host_ms")), low), high))
            cover = self._rest_timer.cover_ms

        # Each round times both sides twice, alternating: the reference's second call (AA)
        # against its first is the noise floor (verdict.py), and the candidate's second (BB)
        # gives its worker the reference's rhythm. Timed once a round beside the reference's
        # three commands, the candidate's worker ran colder: an identity read 0.53-0.66x on a
        # 2-core CPU, and Level 3's launch-bound networks 0.85-0.97x on the H200s.
        names = ["reference", "candidate", AA, BB]
        raw: dict[str, list[Clocks]] = {name: [] for name in [*names, "null"]}
        gaps: dict[str, list[float]] = {name: [] for name in names}
        cuda = self._device_info().is_cuda

        def decided(calls: dict[str, list[float]]) -> bool:
            bounded = cuda and host_bound(call_profiles(raw, ["reference", "candidate"], TRUSTED))
            return speed_verdict(calls, self.min_speedup, bounded, cpu_device=not cuda).decided

        stopper = StopRule(config, names, host=False, decided=decided, trusted=TRUSTED)
        mutates = bool(self.setup.get("mutates_inputs"))
        rounds = rechecked = 0
        while True:
            # The candidate's worker is woken first, on the last round's inputs, as the
            # reference's is by the draw: both sides start the round just active, and the
            # new inputs reach the arena only after the candidate's command.
            self._ask_candidate({"op": "prepare"})
            self._ask_reference({"op": "draw", "seed": derive_seed(self.seed, f"round{attempt or ''}", rounds)})
            null = self._ask_reference({"op": "time", "null": True})
            raw["null"].append(scripted(config, "null", rounds, _clocks(null.get("clocks"), "null")))
            order = (["reference", "candidate", AA, BB] if self.rng.random() < 0.5
                     else ["candidate", "reference", BB, AA])
            claims: list[dict] = []
            for name in order:
                if name in ("candidate", BB):
                    if claims and mutates:  # its first call changed the arena's inputs
                        self._ask_reference({"op": "restore"})
                    self._ask_candidate({"op": "prepare"})
                    prepared_ms = self.wall_ms
                    reply = self._ask_candidate({"op": "time", "box": len(claims)}, timed=True)
                    claims.append(_claims(reply))
                else:
                    self._ask_reference({"op": "prepare"})
                    prepared_ms = self.wall_ms
                    reply = self._ask_reference({"op": "time"}, timed=True)
                clocks = _clocks(reply.get("clocks"), name)
                if name in ("candidate", BB) and max(clocks) <= 0:
                    raise Ended("rejected", "the candidate's worker claimed a call that took no time: its timings "
                                            "were forged", defences=("timing_claims",))
                # the judge's clock for the call against the device time it claims: `prepare`
                # included, where the round's inputs are in the worker's hands
                gaps[name].append(prepared_ms + (self.wall_ms if self.held_ms is None else self.held_ms) - clocks[1])
                raw[name].append(scripted(config, name, rounds, clocks))
            rounds += 1
            stop_reason = stopper.check(raw, rounds)
            # Which of the round's two candidate calls are re-checked is drawn now, after both
            # replies, from a source its process cannot read; each output waits in a mailbox
            # of its own. Inputs the reference changes in place are checked as each call left
            # them: the first call's as the reference's `restore` kept them.
            for box, claim in enumerate(claims):
                if rounds == 1 or stop_reason or self.rng.random() < config.recheck_fraction:
                    rechecked += 1
                    result = self._ask_reference({"op": "compare", **claim, "box": box,
                                                  "restored": mutates and box < len(claims) - 1})["comparison"]
                    if not result["ok"]:
                        name = result["failure"] if result["failure"] in ("poison", "late_output") else "recheck"
                        raise Ended(STATUS_OF_DEFENCE[name], f"a timed call's output was wrong: {result['reason']}",
                                    defences=(name,))
            if stop_reason:
                break
        per_call = per_call_ms(raw, names, host=False, trusted=TRUSTED)
        run = TimingRun(
            stats={name: TimingStats.from_samples(per_call[name]) for name in names},
            clock="cuda_events" if cuda else "host", rounds=rounds, stop_reason=stop_reason, pool_sets=1,
            pool_bytes=0, flush_bytes=self._rest_timer.flush_bytes if cuda else 0,
            cover_ms=cover, rechecked_rounds=rechecked,
            sync_overhead_ms=statistics.median(sync_costs(raw)) if cuda else None,
            profile=call_profiles(raw, names, TRUSTED),
            warmup_calls={"reference": int(_number(warm.get("calls"))),
                          "candidate": candidate_warmup_calls},
            wall_s=time.perf_counter() - t0,
            worker_cpus=self.cpus,
            per_call=per_call,
        )
        return run, gaps, ClaimsCheck.for_device(cuda)

    # --- talking to the workers ------------------------------------------------------------

    def _enter(self, stage: str) -> None:
        self.stage = stage
        self.deadline = time.monotonic() + self.limits.for_stage(stage, self.timing)
        if self.on_stage and stage != "boot":  # the user's stages: load, gate1, gate2
            self.on_stage(stage)

    def _ask_reference(self, message: dict, timed: bool = False) -> dict:
        # In gate 2 the reference worker is handled between commands as the candidate's is:
        # its process tree walked, continued, stopped and walked again, the GPU probed. The
        # same host work around both sides' calls leaves their caches alike (with only the
        # candidate's tree walked, an identity read 0.53-0.66x on a 2-core CPU).
        pause = self.stage == "gate2"
        try:
            tree = self._reference_tree() if pause else []
            if timed:
                self._rest()
            elif pause:
                self._probe()
            started = time.perf_counter()
            containment.signal_all(tree, signal.SIGCONT)
            reply = self.reference.channel.request(message, self.deadline)
            self._reply_seen(timed)
            if pause:  # and probed after every command, as the candidate's worker is: the same clock for both
                containment.signal_all(tree, signal.SIGSTOP)
            if timed or pause:
                self._probe()
            self.wall_ms = (time.perf_counter() - started) * 1e3
            if pause:
                self._stop_tree(self._reference_tree)
        except ChannelError as exc:
            if exc.kind == "timeout":
                raise Ended("timeout", f"{self.stage} ran past its {self._limit():g} s limit in the reference "
                                       "worker (the problem's code); the workers were killed",
                            details=self.reference.tail()) from None
            if shrunk := self._arena_shrunk():  # the reference's worker died of reading past its end (SIGBUS)
                raise Ended("rejected", f"the candidate's worker cut the shared arena short ({shrunk}): the "
                                        f"reference worker died reading it during {self.stage}",
                            details=self.reference.tail(), defences=("arena_length",)) from None
            raise Ended("crash", f"the reference worker failed during {self.stage}: {exc.reason}",
                        details=self.reference.tail()) from None
        if "error" in reply:
            error = reply["error"]
            raise Ended(error["kind"], error["reason"], details=error.get("details"))
        return reply

    def _ask_candidate(self, message: dict, timed: bool = False) -> dict:
        """Wake the candidate's tree, ask, stop the tree the moment it replies, then wait for
        the GPU: nothing of it runs between its reply and its next command, and whatever it
        left queued on the GPU finishes inside the judge's clock. In gate 2 only the worker's
        own process is woken: a process it started before stays stopped (on a CPU device one
        had done a call's work on another core during `prepare`, judge_helper_process.py);
        one it starts during a command runs until the reply."""
        tree = self._candidate_tree()
        awake = [pid for pid in tree if pid == self.worker_pid] if self.stage == "gate2" else tree
        try:
            self._rest() if timed else self._probe()
            if self.worker.channel.pending():
                raise Ended("crash", f"the candidate's worker replied to {message['op']!r} before it was asked: "
                                     "something of it ran while it was stopped")
            started = time.perf_counter()
            containment.signal_all(awake, signal.SIGCONT)
            reply = self.worker.channel.request(message, self.deadline)
            self._reply_seen(timed)
            containment.signal_all(tree, signal.SIGSTOP)
            self._probe()
            self.wall_ms = (time.perf_counter() - started) * 1e3
        except ChannelError as exc:
            raise self._candidate_failed(exc) from None
        finally:  # and whatever it started during the call
            self._stop_candidate()
        if "error" in reply:
            self._raise_candidate_error(reply["error"])
        if timed:
            self._check_cpus()
        return reply

    def _arena_shrunk(self) -> str | None:
        """How the CPU arena's file was cut short, or None: the candidate's worker may write its
        bytes but not truncate it (Landlock), and fallocate's collapse-range, which Landlock does
        not cover, is caught here, after the fact (a file shortened under a mapping kills its
        reader). Only the candidate's worker writes the file besides the reference's."""
        arena = self.setup.get("arena") or {}
        if arena.get("kind") != "file":
            return None
        try:
            size = os.stat(self.arena_file).st_size
        except OSError:
            return "its file is gone"
        return f"from {arena['nbytes']:,} bytes to {size:,}" if size < arena["nbytes"] else None

    def _check_cpus(self) -> None:
        """Both workers still on the CPU they were given: a faster CPU is a faster
        launch-bound call. The candidate's worker cannot call sched_setaffinity (the
        warden's seccomp filter); this catches a kernel without seccomp, or a way around it."""
        if self.cpus is None:
            return
        for tree, whose in ((self._candidate_tree(), "the candidate's worker"),
                            (self._reference_tree(), "the reference's worker")):
            moved = containment.strays(tree, self.cpus)
            if moved:
                raise Ended("rejected", f"{whose} was moved off CPU {self.cpus[0]}, where the judge holds both "
                                        f"workers (threads {', '.join(map(str, moved[:5]))}): a call's speed "
                                        "depends on its CPU", defences=("cpu_affinity",))

    def _raise_candidate_error(self, error) -> None:
        if not isinstance(error, dict) or error.get("kind") not in ("candidate_error", "oom", "cuda_error"):
            raise Ended("crash", f"the candidate's worker sent an unknown error: {str(error):.200}")
        raise Ended(error["kind"], str(error.get("reason"))[:2000], details=_text(error.get("details")))

    def _candidate_failed(self, exc: ChannelError) -> Ended:
        if exc.kind == "timeout":
            return Ended("timeout", f"{self.stage} ran past its {self._limit():g} s limit; the candidate's worker "
                                    "and everything it started were killed", details=self.worker.tail())
        if exc.kind == "malformed":
            return Ended("crash", f"the candidate's worker broke the protocol during {self.stage}: {exc.reason}",
                         details=self.worker.tail())
        status = self._kill_candidate()
        if status is not None and status < 0:
            name = signal.Signals(-status).name if -status in signal.valid_signals() \
                else str(-status)
            reason = f"the worker died on {name} during {self.stage}"
        else:
            reason = f"the worker exited with status {status} during {self.stage} without a result"
        return Ended("crash", reason, details=self.worker.tail())

    def _candidate_tree(self) -> list[int]:
        if self.warden is None:
            return []
        return containment.descendants(self.warden.pid)

    def _reference_tree(self) -> list[int]:
        pid = self.reference.process.pid
        return [pid, *containment.descendants(pid)]

    def _stop_candidate(self) -> None:
        self._stop_tree(self._candidate_tree)

    @staticmethod
    def _stop_tree(walk: Callable[[], list[int]]) -> None:
        """SIGSTOP a whole process tree, walking it again until no new process shows up
        (a process that forks while it is walked)."""
        stopped: set[int] = set()
        for _ in range(20):
            new = [pid for pid in walk() if pid not in stopped]
            if not new:
                return
            containment.signal_all(new, signal.SIGSTOP)
            stopped.update(new)

    def _limit(self) -> float:
        return self.limits.for_stage(self.stage, self.timing)

    def _rest(self) -> None:
        """Before a timed call of either worker, from the judge's own CUDA context: flush the
        L2 and wait for it, then queue the GPU's sleep (the cover) and do not wait for it.
        The worker's context cannot run while the judge's has work (contexts take turns on
        the GPU), so the worker launches its call during the cover and its window starts
        when the cover ends: the launch latency stays out of the window, and no stream of
        the worker's can start before it. (A flush still running when the worker's launches
        came let the GPU switch to the worker between the flush and the sleep: a 10 us add's
        medians read 35 us on both sides, 10.4 us with the wait; H100, 2026-11-27.) The
        worker was idle since its `prepare`."""
        if self._rest_timer is not None:
            with self._torch.cuda.device(self._probe_tensor.device):
                self._rest_timer.flush()
                self._torch.cuda.synchronize()
                self._rest_timer.sleep()
                self._cover_end.record()

    def _reply_seen(self, timed: bool) -> None:
        """The GPU's time from the end of the cover to the worker's reply, on the judge's
        own events (`held_ms`): the worker's whole turn on the GPU, its call and the
        protocol after it, which its claimed device time must account for."""
        self.held_ms = None
        if timed and self._rest_timer is not None:
            with self._torch.cuda.device(self._probe_tensor.device):
                self._reply_event.record()
                self._reply_event.synchronize()
                self.held_ms = self._cover_end.elapsed_time(self._reply_event)

    def _probe(self) -> None:
        """Wait until the GPU has finished everything queued on it, by any process: work in
        another process's context keeps this one's kernel waiting (up to a time slice)."""
        if self._probe_tensor is not None:
            self._probe_tensor.add_(1)
            self._torch.cuda.synchronize(self._probe_tensor.device)

    def _check_reference_state(self) -> None:
        changed = self._ask_reference({"op": "state"}).get("changed")
        if changed:
            raise Ended("rejected", f"the reference's state changed while the candidate ran: {', '.join(changed)}",
                        defences=("reference_state",))

    # --- starting and stopping the workers -------------------------------------------------

    def _environment(self) -> dict:
        env = dict(os.environ)
        workers_gpus = self.gpus or (() if self.gpu is None else (self.gpu,))
        if workers_gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(gpu) for gpu in workers_gpus)
        return env

    def _pipes(self) -> tuple[Channel, int, int]:
        command_read, command_write = os.pipe()
        reply_read, reply_write = os.pipe()
        return Channel(reply_read, command_write, "?"), command_read, reply_write

    def _start_reference(self) -> _Worker:
        channel, command_fd, reply_fd = self._pipes()
        channel.name = "reference"
        log = self.scratch / "reference.log"
        device_kind = "cuda" if _cuda_available() else "cpu"
        job = dict(problem=str(self.problem), size=self.size or ("full" if device_kind == "cuda" else "auto"),
                   device=device_kind, baseline=self.baseline, arena_file=str(self.arena_file),
                   command_fd=command_fd, reply_fd=reply_fd, lock_affinity=bool(self.cpus))
        with open(log, "wb") as out:
            process = subprocess.Popen([sys.executable, "-m", "kforge.harness.reference_worker"],
                                       stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
                                       pass_fds=(command_fd, reply_fd), env=self._environment(),
                                       start_new_session=True)
        os.close(command_fd)
        os.close(reply_fd)
        process.stdin.write((json.dumps(job) + "\n").encode())
        process.stdin.close()
        return _Worker(channel, process, log, "reference")

    def _await_reference_hello(self) -> None:
        try:
            self.hello = self.reference.channel.receive(self.deadline)["hello"]
        except (ChannelError, KeyError, TypeError) as exc:
            raise Ended("crash", f"the reference worker did not start: {getattr(exc, 'reason', exc)}",
                        details=self.reference.tail()) from None
        if self.hello["device"]["kind"] == "cuda":
            import torch

            from kforge.device import DeviceInfo
            from kforge.harness.timing import call_timer

            self._torch = torch
            self._probe_tensor = torch.zeros(1, device=torch.device("cuda", self.gpu or 0))
            self._cover_end = torch.cuda.Event(enable_timing=True)
            self._reply_event = torch.cuda.Event(enable_timing=True)
            mine = DeviceInfo(**{**self.hello["device"], "index": self.gpu or 0})
            with torch.cuda.device(mine.torch_device):  # its sleeps run on the current device
                self._rest_timer = call_timer(mine, self.timing.flush_l2)

    def _start_candidate(self) -> _Worker:
        channel, command_fd, reply_fd = self._pipes()
        channel.name = "candidate's"
        work = self.scratch / "candidate"
        (work / "tmp").mkdir(parents=True)
        from kforge.harness.loading import file_sha256

        cache = _cache_root() / "candidates" / file_sha256(Path(self.candidate))[:16]
        cache.mkdir(parents=True, exist_ok=True)
        env = self._environment()
        # Every cache the candidate's libraries write is its own: it cannot plant a kernel
        # the reference, or another candidate, would load.
        env.update(TMPDIR=str(work / "tmp"), TRITON_CACHE_DIR=str(cache / "triton"),
                   TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"), TORCH_EXTENSIONS_DIR=str(cache / "extensions"),
                   XDG_CACHE_HOME=str(cache / "xdg"))
        log = self.scratch / "candidate.log"
        # The GPU's device files and the worker's own /proc entry: the CUDA driver opens the
        # former for writing and writes under /proc/self (without either, cudaGetDeviceCount
        # fails: H100, 2026-11-27); /dev/shm, where torch keeps the reference counts of the
        # CUDA IPC memory it opens (without it, opening the arena fails). The evaluations'
        # own folders are elsewhere (shared.scratch_root).
        # The arena's file (a CPU's): its bytes, not its length; the reference's worker maps it, and a file
        # cut short under a mapping kills the process that reads it (SIGBUS), blamed on the reference.
        writable = [str(work), str(cache), "/proc/self", "/dev/shm", *_device_files()]
        warden_job = dict(argv=[sys.executable, "-m", "kforge.harness.candidate_worker"], env=env, writable=writable,
                          fixed_size=[str(self.arena_file)],
                          pass_fds=[command_fd, reply_fd], log=str(log), lock_affinity=bool(self.cpus),
                          worker_job={"command_fd": command_fd, "reply_fd": reply_fd})
        self.warden = subprocess.Popen([sys.executable, str(HARNESS / "warden.py")], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, pass_fds=(command_fd, reply_fd), env=env,
                                       start_new_session=True)
        os.close(command_fd)
        os.close(reply_fd)
        # The warden is kforge's own code, but it is read with a deadline like any worker.
        self.warden_channel = Channel(self.warden.stdout.fileno(), self.warden.stdin.fileno(), "warden")
        try:
            self.warden_channel.send(warden_job)
            spawned = self.warden_channel.receive(time.monotonic() + WARDEN_WAIT_S)
        except ChannelError as exc:
            raise Ended("crash", f"the candidate's worker could not be started: {exc.reason}") from None
        self.confinement = spawned.get("confinement") or None
        self.worker_pid = spawned.get("spawned")  # the warden's word (kforge's code), not the worker's
        if self.cpus and not spawned.get("affinity_locked"):
            self.warnings.append("the candidate's worker can change CPU affinities (no seccomp filter here): the "
                                 "judge can only check both workers' CPU after each timed call")
        missing = containment.Confinement(**self.confinement).missing() if self.confinement else ["everything"]
        if missing:
            self.warnings.append(f"the candidate's worker is not contained against: {', '.join(missing)} "
                                 "(this kernel offers no Landlock, or not this version)")
        return _Worker(channel, self.warden, log, "candidate's")

    def _await_candidate_hello(self) -> None:
        try:
            self.worker.channel.receive(self.deadline)
        except ChannelError as exc:
            raise self._candidate_failed(exc) from None
        finally:
            self._stop_candidate()

    def _candidate_job(self, setup: dict) -> dict:
        return dict(candidate=str(self.candidate), device=self.hello["device"]["kind"], arena=setup["arena"],
                    init=setup["init"], inputs=setup["inputs"], mailboxes=setup["mailboxes"],
                    init_seed=derive_seed(self.seed, "init"),
                    forbidden_ops=setup["forbidden_ops"], own_inputs=not setup.get("mutates_inputs", False))

    def _kill_candidate(self) -> int | None:
        """Kill the candidate's worker and all it started; its exit status (negative: a signal)."""
        if self.warden is None or self.warden.poll() is not None:
            return None
        try:
            reply = self.warden_channel.request({"op": "kill"}, time.monotonic() + WARDEN_WAIT_S)
        except ChannelError:
            self.warden.kill()  # its worker dies with it (PR_SET_PDEATHSIG)
            return None
        self.survivors = reply.get("survivors") or []
        return reply.get("exit")

    def _shut_down(self) -> list[int]:
        self.survivors = getattr(self, "survivors", [])
        if self.warden is not None:
            self._kill_candidate()
            try:
                self.warden.stdin.close()
                self.warden.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.warden.kill()
                self.warden.wait()
            self.worker and self.worker.channel.close()
        if self.reference is not None:
            containment.signal_all([self.reference.process.pid], signal.SIGCONT)  # stopped in gate 2
            try:
                self.reference.channel.request({"op": "exit"}, time.monotonic() + 5)
            except ChannelError:
                pass
            if self.reference.process.poll() is None:
                containment.kill_tree(self.reference.process.pid, also_orphans=False)
            self.reference.process.wait()
            self.reference.channel.close()
        return self.survivors

    # --- the record ------------------------------------------------------------------------

    def _device_info(self):
        from kforge.device import DeviceInfo

        return DeviceInfo(**self.hello["device"])

    def _record(self, status: str, reason: str | None, defences: list[str] | None = None, **fields) -> EvalRecord:
        if getattr(self, "gate1", None) is not None:
            fields.setdefault("gate1", self.gate1)
        problem = identity(self.problem)
        if getattr(self, "problem_meta", None):
            problem.update(size=self.problem_meta["size"], tags=self.problem_meta["tags"])
        device = self.hello.get("device") or {"kind": "unknown", "name": self.device_name or "unknown"}
        device = {**device, "host": socket.gethostname()}  # the node that judged (a cluster's suite names it)
        candidate = identity(self.candidate)
        key = pair_key(problem["sha256"], candidate["sha256"], self.baseline, self.size,
                       self.device_name or device.get("name", "unknown"))
        return EvalRecord(status=status, reason=reason, problem=problem, candidate=candidate, device=device,
                          versions=self.hello.get("versions") or {}, baseline=self.baseline, seed=self.seed,
                          command=self.command, pair_key=key, warnings=self.warnings,
                          defences=self.defences + (defences or []),
                          containment=getattr(self, "confinement", None), **fields)


def _gate1_report(fixed: dict, passed, trials, trials_passed, skipped, worst, reason, failure) -> dict:
    """Gate 1's part of the record, in CorrectnessReport's fields (correctness.py)."""
    worst = worst or {}
    return dict(passed=passed, trials=trials, trials_passed=trials_passed, seeds=list(fixed["seeds"]),
                atol=fixed["atol"], rtol=fixed["rtol"],
                max_abs_err=worst.get("max_abs_err", 0.0), max_rel_err=worst.get("max_rel_err", 0.0),
                mismatch_frac=worst.get("mismatch_frac", 0.0), rel_l2_err=worst.get("rel_l2_err", 0.0),
                rel_l2_bound=fixed["rel_l2_bound"], failure=failure, reason=reason, test=worst.get("test"),
                exposed_trials=fixed["exposed_trials"], exposed_skipped=skipped)


def _worse(a: dict, b: dict) -> dict:
    keys = ("max_abs_err", "max_rel_err", "mismatch_frac", "rel_l2_err")
    return {**b, **{k: max(a.get(k, 0.0), b.get(k, 0.0)) for k in keys}, "ok": a["ok"] and b["ok"]}


def _clocks(value, name: str) -> Clocks:
    """Three finite, non-negative numbers, or the worker broke the protocol."""
    if (not isinstance(value, list) or len(value) != 3
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1e9 for v in value)):
        raise Ended("crash", f"the {name} worker sent malformed clocks: {str(value):.120}")
    return (float(value[0]), float(value[1]), float(value[2]))


def _count(value, name: str) -> int:
    """A whole, non-negative number below 1e12 (JSON's Infinity and NaN are neither), or the
    worker broke the protocol."""
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1e12
            and value == int(value)):
        raise Ended("crash", f"the {name} worker sent a malformed count: {str(value):.120}")
    return int(value)


def _claims(reply: dict) -> dict:
    """The candidate's description of its outputs and the digests of its mailbox, fit to
    forward to the reference worker: strict JSON (no NaN), of a sane size. Whether they are
    right is the reference worker's call."""
    claims = {"claims": reply.get("outputs"), "digests": reply.get("digests")}
    try:
        size = len(json.dumps(claims, allow_nan=False))
    except (TypeError, ValueError, RecursionError):
        raise Ended("crash", "the candidate's worker described its outputs in what is not strict JSON") from None
    if size > 1 << 16:
        raise Ended("crash", f"the candidate's worker described its outputs in {size} bytes")
    return claims


def _number(value) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def _strings(value) -> list[str]:
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []


def _text(value) -> str | None:
    return str(value)[:20000] if value is not None else None


def _device_files() -> list[str]:
    """The device files a CUDA program opens for writing: the driver's, and the harmless ones."""
    names = ("null", "zero", "full", "random", "urandom")
    dev = Path("/dev")
    found = [dev / name for name in names] + (sorted(dev.glob("nvidia*")) if dev.is_dir() else [])
    return [str(path) for path in found if path.exists()]


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _cache_root() -> Path:
    from kforge.device import cache_dir

    return cache_dir()

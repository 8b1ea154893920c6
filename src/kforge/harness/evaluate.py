"""`evaluate(problem, candidate)`: both gates and the roofline, as one EvalRecord.

    load both files ─► build Model and ModelNew under one seed
      ─► gate 1: fresh seeds, candidate first on clones, compare       (correctness.py)
      ─► gate 2: reference and candidate interleaved on fresh inputs,
                 sampled calls re-checked                               (timing.py)
      ─► roofline: achieved TFLOP/s and GB/s, % of roof, physical floor (roofline.py)
      ─► EvalRecord                                                     (record.py)

The defences of defences.py run throughout: the harness's functions are fingerprinted
before the candidate is imported and checked after each stage; threads it starts are
watched; freed reference outputs are poisoned. The seed is secret and random per run
unless given; it is recorded afterwards so a run can be reproduced.

This runs in the caller's process, the candidate with it: for kforge's own kernels (the
benchmarks, the ladder) and for a debugger (`kforge eval --in-process`). What the CLI runs
for a candidate is judge.py, which keeps the candidate's code out of the judge's
processes. Nothing here prints.
"""

from __future__ import annotations

import hashlib
import math
import secrets
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from kforge.device import DeviceInfo, current_device, library_versions
from kforge.errors import CandidateError, KforgeError, ProblemError, error_kind
from kforge.harness.candidate import Candidate, load_candidate
from kforge.harness.correctness import CorrectnessReport, check_correctness, clone_arguments, compare_outputs, \
    poison_outputs
from kforge.harness.defences import DefenceFired, IntegritySnapshot, ThreadWatch, thread_ids
from kforge.harness.loading import call_user, file_sha256
from kforge.harness.problem import SIZES, Problem, load_problem
from kforge.harness.record import EvalRecord
from kforge.harness.roofline import Ceilings, Roofline, get_ceilings, roofline_for
from kforge.harness.timing import CallProfile, TimingConfig, TimingRun, time_interleaved
from kforge.harness.verdict import HOST_BOUND_SHARE, Verdict, judge_speed, paired_ratios, round_ratios
from kforge.runtime.interpreter import interpreter_active, mend_interpreter

BASELINES = ("eager", "compile")
MIN_TRIALS = 5
CPU_NOTE = ("CPU figures: host clock, no cache flush, Triton kernels under the interpreter; "
            "they show the pipeline runs, not how fast anything is")
# Threads the candidate started may use at most this share of its timed time in CPU time.
HOST_THREAD_SHARE = 0.25
# Status of a record when a defence fires.
STATUS_OF_DEFENCE = {
    "recheck": "incorrect",
    "poison": "incorrect",
    "late_output": "incorrect",
    "plain_tensor": "incorrect",
    "input_clones": "incorrect",
    "physical_floor": "faster_than_hardware",
    "host_thread": "rejected",
    "harness_integrity": "rejected",
    "forbidden_op": "rejected",
}
AA = "reference_aa"  # the reference timed again each round: the A/A pair that measures the noise floor
BB = "candidate_bb"  # the candidate timed again each round (the judge's rounds): the two sides' rhythm alike
TRUSTED = ("reference", AA)  # whose device tails set the off-stream allowance (timing._sync_cost)
# `device_sync` names work off the timed stream when most calls had some and their tails ran
# past the allowance (timing._sync_cost) by more than this share of the call: an honest call
# that leaves the GPU idle pays more for the closing synchronize than the null calls, is
# charged that, and is not called hidden work (H200: calls with 2 ms of host work).
OFF_STREAM_SHARE = 0.05
CEILING_DOUBT = 0.9  # a reference faster than 1/0.9 of the measured roof casts doubt on the ceilings
GATE1_FAILURE_DEFENCE = {"output_type": "plain_tensor", "mutated_inputs": "input_clones", "poison": "poison"}

Stage = Callable[[str], None]


def evaluate(
    problem: str | Path | Problem,
    candidate: str | Path | Candidate,
    *,
    baseline: str = "eager",
    trials: int = MIN_TRIALS,
    timing: TimingConfig | None = None,
    device: DeviceInfo | None = None,
    size: str | None = None,
    seed: int | None = None,
    ceilings: Ceilings | None = None,
    command: str | None = None,
    on_stage: Stage | None = None,
    min_speedup: float | None = None,
) -> EvalRecord:
    """Evaluate `candidate` against `problem` on `device` (default: the GPU if any, else CPU).

    size: "full", "tiny" or "auto" (tiny if the problem defines tiny_sizes); default
    "full" on a GPU and "auto" elsewhere. `on_stage(name)` is told when each stage
    begins ("load", "gate1", "gate2"). `min_speedup`: the bar the speedup's 95% interval
    must clear for "passed" (default: 1 + the measured noise floor). Raises KforgeError
    only for arguments that make no sense (a missing file, an unknown baseline); everything
    the problem or the candidate does wrong comes back as a record with an error status.
    """
    check_arguments(problem, candidate, baseline, trials, size, min_speedup)
    device = device or current_device()
    seed = secrets.randbits(63) if seed is None else seed
    stage = on_stage or (lambda _name: None)
    run = _Run(device, seed, baseline, min_speedup)
    run.base.update(problem=identity(problem), candidate=identity(candidate), command=command)
    run.base["pair_key"] = pair_key(run.base["problem"]["sha256"], run.base["candidate"]["sha256"], baseline,
                                    size, device.name)
    size = size or ("full" if device.is_cuda else "auto")
    if not device.is_cuda:
        run.warnings.append(CPU_NOTE)
        if interpreter_active():
            mend_interpreter()
        else:
            run.warnings.append("Triton was imported in compile mode, so Triton kernels cannot run on this "
                                "CPU evaluation: import kforge before triton, or set TRITON_INTERPRET=1")

    try:
        stage("load")
        problem = problem if isinstance(problem, Problem) else load_problem(problem, size)
        run.base["problem"] = {**run.base["problem"], "size": problem.size, "tags": problem.tags}
        integrity, threads_before = IntegritySnapshot(), thread_ids()
        candidate = candidate if isinstance(candidate, Candidate) else load_candidate(candidate)
        return run.evaluate(problem, candidate, trials, timing, ceilings, integrity, threads_before, stage)
    except DefenceFired as fired:
        return run.record(STATUS_OF_DEFENCE[fired.name], fired.reason, defences=[fired.name, *fired.also])
    except (ProblemError, CandidateError) as exc:
        status = "problem_error" if isinstance(exc, ProblemError) else (
            {"oom": "oom", "cuda_error": "cuda_error"}.get(exc.kind, "candidate_error"))
        return run.record(status, exc.reason, details=exc.details or None)
    finally:
        if device.is_cuda:
            try:
                torch.cuda.empty_cache()
            except RuntimeError:
                pass  # after a CUDA error the context is lost; the worker exits anyway


def check_arguments(problem, candidate, baseline: str, trials: int, size: str | None,
                    min_speedup: float | None = None) -> None:
    """Refuse, before any work, arguments that make no sense (KforgeError: exit status 2)."""
    if min_speedup is not None and not (math.isfinite(min_speedup) and min_speedup > 0):
        raise KforgeError(f"--min-speedup must be a positive number, got {min_speedup}")
    if baseline not in BASELINES:
        raise KforgeError(f"unknown baseline {baseline!r} (expected one of {', '.join(BASELINES)})")
    if trials < MIN_TRIALS:
        raise KforgeError(f"gate 1 needs at least {MIN_TRIALS} trials, got {trials}")
    if size is not None and size not in SIZES:
        raise KforgeError(f"unknown size {size!r} (expected one of {', '.join(SIZES)})")
    for what, value in (("problem", problem), ("candidate", candidate)):
        if isinstance(value, (str, Path)) and Path(value).is_dir():
            raise KforgeError(f"{what} {value} is a folder: an evaluation takes one file (kforge suite takes a folder)")
        if isinstance(value, (str, Path)) and not Path(value).is_file():
            raise KforgeError(f"{what} file not found: {value}")


class _Run:
    """One evaluation's fixed facts, and the records it can end in."""

    def __init__(self, device: DeviceInfo, seed: int, baseline: str, min_speedup: float | None = None):
        self.device, self.seed, self.baseline, self.min_speedup = device, seed, baseline, min_speedup
        self.base = dict(device=device.to_dict(), versions=library_versions(), baseline=baseline, seed=seed)
        self.warnings: list[str] = []
        self.defences: list[str] = []

    def record(self, status: str, reason: str | None, **fields) -> EvalRecord:
        defences = self.defences + fields.pop("defences", [])
        return EvalRecord(status=status, reason=reason, warnings=self.warnings, defences=defences,
                          **fields, **self.base)

    def evaluate(self, problem: Problem, candidate: Candidate, trials, timing, ceilings, integrity,
                 threads_before, stage) -> EvalRecord:
        dev = self.device.torch_device
        init_seed = derive_seed(self.seed, "init")
        init_inputs = problem.init_inputs(init_seed, dev)
        reference = problem.build_reference(init_inputs, init_seed, dev)
        candidate_model = candidate.build(clone_arguments(init_inputs), init_seed, dev)
        integrity.check()

        stage("gate1")
        seeds = [derive_seed(self.seed, "trial", i) for i in range(trials)]
        watch = ThreadWatch(candidate.path, threads_before)
        with watch:
            gate1 = check_correctness(problem, reference, candidate, candidate_model, seeds, dev,
                                      probe_seed=derive_seed(self.seed, "probe"),
                                      exposed_seeds=exposed_seeds(self.seed, problem.exposed_trials))
        integrity.check()
        if not gate1.passed:
            fired = [GATE1_FAILURE_DEFENCE[gate1.failure]] if gate1.failure in GATE1_FAILURE_DEFENCE else []
            if watch.started:  # a thread it started was still writing the output: name the cause first
                return self.record("rejected", f"the candidate started {watch.started} thread(s) while it was "
                                   f"checked, and gate 1 failed: {gate1.reason}", gate1=gate1.to_dict(),
                                   defences=["host_thread", *fired])
            return self.record("incorrect", f"gate 1 failed: {gate1.reason}", gate1=gate1.to_dict(), defences=fired)

        stage("gate2")
        run = self._time_both(problem, reference, candidate, candidate_model, timing, threads_before)
        integrity.check()
        ceilings = ceilings or get_ceilings(self.device)
        roof = _roofline(problem, reference, gate1, ceilings)
        verdict = speed_verdict(run.per_call, self.min_speedup)
        status, reason = gate2_verdict(run, roof, ceilings, self.baseline, self.warnings, self.defences, verdict)
        return self.record(status, reason, gate1=gate1.to_dict(), gate2=gate2_fields(status, run, verdict),
                           roofline=roofline_fields(roof, run, ceilings))

    def _time_both(self, problem, reference, candidate, candidate_model, timing, threads_before) -> TimingRun:
        config = timing or TimingConfig()
        dev = self.device.torch_device
        if self.baseline == "compile":
            reference = call_user(torch.compile, reference, error=ProblemError,
                                  stage="torch.compile of the reference failed", user_file=problem.path)

        def check_round(outputs: dict) -> None:
            result = compare_outputs(outputs["reference"], outputs["candidate"], problem)
            if not result.ok:
                name = "poison" if result.failure == "poison" else "recheck"
                raise DefenceFired(name, f"a timed call's output was wrong: {result.reason}")

        watch = ThreadWatch(candidate.path, threads_before)
        try:
            with torch.no_grad(), watch:
                run = time_interleaved(
                    {"reference": lambda inputs: problem.run_reference(reference, inputs),
                     "candidate": lambda inputs: candidate.run(candidate_model, inputs),
                     AA: lambda inputs: problem.run_reference(reference, inputs)},
                    lambda i: problem.make_inputs(derive_seed(self.seed, "pool", i), dev),
                    self.device, config, seed=derive_seed(self.seed, "order"),
                    fresh_inputs=True, check_round=check_round,
                    release={name: lambda out: poison_outputs(out, reference) for name in ("reference", AA)},
                    decided=decided_by(self.min_speedup), trusted=TRUSTED,
                )
        except DefenceFired as fired:
            if watch.started:  # the wrong output came from the thread: name the cause first
                raise DefenceFired("host_thread", f"the candidate started {watch.started} thread(s) while it was "
                                   f"timed, and {fired.reason}", also=(fired.name,)) from None
            raise
        except RuntimeError as exc:  # an error the device raised at a synchronize of the engine's
            if error_kind(exc) == "error":
                raise
            raise CandidateError(f"the device failed while the candidate was timed: {exc}",
                                 kind=error_kind(exc)) from None
        watch.check(timed_s=run.stats["candidate"].mean_ms * run.stats["candidate"].n / 1e3, share=HOST_THREAD_SHARE)
        return run


def speed_verdict(calls: dict[str, list[float]], min_speedup: float | None = None, host_bound: bool = False,
                  cpu_device: bool = False) -> Verdict:
    """Gate 2's statistics on per-call times (a run's `per_call`): the paired per-round
    ratios, their interval, the A/A noise floor (`host_bound`: verdict.HOST_BOUND_FLOOR;
    `cpu_device`: verdict.CPU_DEVICE_FLOOR)."""
    return judge_speed(calls["reference"], calls["candidate"], calls.get(AA), calls.get(BB), min_speedup=min_speedup,
                       host_bound=host_bound, cpu_device=cpu_device)


def decided_by(min_speedup: float | None) -> Callable[[dict[str, list[float]]], bool]:
    """For the timing engine's stop rule: is the verdict on these per-call times decided?"""
    return lambda calls: speed_verdict(calls, min_speedup).decided


def off_stream_work(profile: CallProfile) -> bool:
    """Did most calls leave work past the timed stream's end, past what honest tails reach
    by over OFF_STREAM_SHARE of the call? (It is charged either way: timing._device_ms.)"""
    return profile.off_stream_frac > 0.5 and profile.off_stream_ms > OFF_STREAM_SHARE * profile.median_device_ms


def gate2_verdict(run: TimingRun, roof: Roofline, ceilings: Ceilings, baseline: str, warnings: list[str],
                  defences: list[str], verdict: Verdict) -> tuple[str, str | None]:
    """Gate 2's status and reason from a timing run, its verdict and the roofline; appends
    the warnings and the names of the defences that fired."""
    ref_ms = run.stats["reference"].median_ms
    cand_ms = run.stats["candidate"].median_ms
    status, reason = "passed", None
    if off_stream_work(run.profile["candidate"]):
        defences.append("device_sync")
    floor = roof.physical_floor_ms
    if floor is not None and ref_ms < floor:
        warnings.append(
            f"the reference itself runs under the physical floor ({ref_ms:.4g} ms < {floor:.4g} ms): "
            "the problem's flops/bytes overstate the work, so the floor check was skipped"
        )
    elif floor is not None and cand_ms < floor:
        status = "faster_than_hardware"
        defences.append("physical_floor")
        reason = (f"faster than the hardware allows: candidate {cand_ms:.4g} ms is under the "
                  f"physical floor of {floor:.4g} ms, so the timer was fooled")
    elif roof.floor_ms is not None and ref_ms < CEILING_DOUBT * roof.floor_ms:
        # Possible (the floor is a measured rate, not physics), but by this much it says the
        # ceilings were measured low: a cold or throttled GPU, or one shared with other work.
        warnings.append(
            f"the reference beat the measured roof ({ref_ms:.4g} ms, floor {roof.floor_ms:.4g} ms): the "
            f"ceilings measured on {ceilings.measured_on} look low for this device, and every % of roof "
            "with them; `kforge roofline --remeasure`"
        )
    if status == "passed" and verdict.status != "faster":
        status = "slower" if verdict.status == "slower" else "tie"
        reason = f"gate 2 failed against the {baseline} reference: {verdict.describe()}"
    if status == "passed" and (disagreement := device_disagrees(run, verdict)):
        warnings.append(disagreement)
    if verdict.undecided:
        warnings.append("the time budget ran out before gate 2 could decide: a longer --time-budget may decide it")
    return status, reason


def host_bound(profiles: dict[str, CallProfile]) -> bool:
    """Were either side's calls bounded by its host (the judge: verdict.HOST_BOUND_FLOOR applies)?"""
    return any(profiles[name].host_bound_frac > HOST_BOUND_SHARE for name in ("reference", "candidate")
               if name in profiles)


def device_disagrees(run: TimingRun, verdict: Verdict) -> str | None:
    """The warning for a "faster" verdict on host-bound calls whose device work is the slower.
    Gate 2 judges each call by what an eager caller waits, max(device, host), so a candidate
    with a leaner Python path can pass while its kernels take longer; where only the device
    time counts (a CUDA graph replaying the calls) it is the slower. The verdict stands (it is
    the contract, and the judge's); the record says both (its profile holds each side's
    device time). None when the verdict is not "faster", the clock is not the GPU's, neither
    side was host-bound, or the device times differ by no more than the noise floor."""
    profile = run.profile
    if verdict.status != "faster" or run.clock != "cuda_events" or not {"reference", "candidate"} <= profile.keys():
        return None
    if not host_bound(profile):
        return None
    reference, candidate = profile["reference"].median_device_ms, profile["candidate"].median_device_ms
    if reference <= 0 or candidate <= reference * (1 + verdict.noise_floor):
        return None
    return (f"faster per call ({verdict.speedup:.3f}x) because the calls are bound by their hosts: the "
            f"candidate's device time is {candidate / reference:.2f}x the reference's ({candidate:.4g} against "
            f"{reference:.4g} ms), so where only device time counts (a CUDA graph) it is the slower")


def gate2_fields(status: str, run: TimingRun, verdict: Verdict, **extra) -> dict:
    """The record's gate 2: the verdict (speedup, interval, noise floor), the timing run, and
    the paired per-round ratios (4 significant digits) the verdict came from."""
    calls = run.per_call
    ratios = {"candidate": _rounded(round_ratios(calls["reference"], calls["candidate"], calls.get(AA), calls.get(BB)))}
    if AA in calls:
        ratios[AA] = _rounded(paired_ratios(calls["reference"], calls[AA]))
    if BB in calls:
        ratios[BB] = _rounded(paired_ratios(calls["candidate"], calls[BB]))
    return {"passed": status == "passed", "speedup": verdict.speedup, "verdict": verdict.to_dict(),
            **run.to_dict(), "ratios": ratios, **extra}


def _rounded(values: list[float]) -> list[float]:
    return [float(f"{v:.4g}") for v in values]


def roofline_fields(roof: Roofline, run: TimingRun, ceilings: Ceilings) -> dict:
    return {
        **roof.to_dict(),
        "reference": asdict(roof.point(run.stats["reference"].median_ms)),
        "candidate": asdict(roof.point(run.stats["candidate"].median_ms)),
        "ceilings": ceilings.to_dict(),
    }


def _roofline(problem: Problem, reference, gate1: CorrectnessReport, ceilings: Ceilings) -> Roofline:
    inputs = gate1.last_inputs
    return roofline_for(
        flops=problem.count_flops(inputs),
        nbytes=problem.count_bytes(inputs, gate1.reference_outputs, reference),
        compute_dtype=problem.compute_dtype_for(inputs),
        ceilings=ceilings,
    )


def exposed_seeds(seed: int, count: int) -> list[int]:
    """The seeds of gate 1's exposing draws (problem.expose)."""
    return [derive_seed(seed, "exposed", i) for i in range(count)]


def derive_seed(seed: int, purpose: str, index: int = 0) -> int:
    """Independent, reproducible seeds for each use, all from the one run seed."""
    digest = hashlib.sha256(f"{seed}/{purpose}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def pair_key(problem_sha: str | None, candidate_sha: str | None, baseline: str, size: str | None, device: str) -> str:
    """What makes two evaluations the same experiment (size as asked: None is the default)."""
    text = "/".join(str(part) for part in (problem_sha, candidate_sha, baseline, size, device))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def identity(value) -> dict:
    """Name, path (relative to the working directory when inside it) and content hash."""
    if isinstance(value, (Problem, Candidate)):
        name, path, sha = value.name, value.path, value.sha256
    else:
        path = Path(value).resolve()
        name, sha = path.stem, file_sha256(path)
    if path is None:
        return {"name": name, "path": None, "sha256": sha}
    try:
        shown = str(path.relative_to(Path.cwd().resolve()))
    except ValueError:
        shown = str(path)
    return {"name": name, "path": shown, "sha256": sha}

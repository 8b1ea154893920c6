"""`evaluate_isolated`: what `kforge eval` and `kforge suite` run for every pair.

The candidate's code never runs in the caller's process: judge.py spreads one
evaluation over a reference worker and a confined candidate's worker, with a time limit
on each stage. Whatever the candidate does, the caller gets a record:

    both gates ran                           -> passed, tie, slower, incorrect, rejected...
    a stage runs past its limit              -> "timeout" (the workers are killed)
    the worker dies on a signal (SIGSEGV...) -> "crash"
    the worker exits, or breaks the protocol -> "crash", with the reason

Out-of-memory and CUDA errors come back as "oom" and "cuda_error"; a CUDA error poisons
only the candidate's own context. A speedup above `remeasure_above` is measured again
in fresh workers; the lower of the two stands, and the record says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kforge.harness.evaluate import MIN_TRIALS, check_arguments
from kforge.harness.judge import Judge, StageLimits, worker_cpus
from kforge.harness.record import EvalRecord
from kforge.harness.roofline import Ceilings
from kforge.harness.timing import TimingConfig

REMEASURE_ABOVE = 10.0

__all__ = ["REMEASURE_ABOVE", "StageLimits", "evaluate_isolated"]


def evaluate_isolated(
    problem: str | Path,
    candidate: str | Path,
    *,
    baseline: str = "eager",
    trials: int = MIN_TRIALS,
    timing: TimingConfig | None = None,
    size: str | None = None,
    ceilings: Ceilings | None = None,
    command: str | None = None,
    gpu: int | None = None,
    gpus: Sequence[int | str] = (),
    device_name: str | None = None,
    limits: StageLimits | None = None,
    remeasure_above: float | None = REMEASURE_ABOVE,
    on_stage=None,
    min_speedup: float | None = None,
) -> EvalRecord:
    """Evaluate `candidate` against `problem` across the judge's processes (module docstring).

    `gpu` pins the workers to that GPU; `gpus`, to several (a problem's GPUS), in that order,
    the first being the judge's own (`gpu`, or this process's device 0). `device_name` (the
    GPU's, or the CPU's) keys the record's pair. `on_stage(name)` hears each stage as it
    begins. `min_speedup`: the bar the speedup's 95% interval must clear (default: 1 + the
    measured noise floor).
    """
    check_arguments(problem, candidate, baseline, trials, size, min_speedup)
    worker_cpus((timing or TimingConfig()).worker_cpu, gpu, on_gpu=False)  # a CPU it may not use: say so now

    def run() -> EvalRecord:
        return Judge(Path(problem).resolve(), Path(candidate).resolve(), baseline=baseline, trials=trials,
                     timing=timing or TimingConfig(), size=size, ceilings=ceilings, command=command, gpu=gpu,
                     gpus=tuple(gpus), device_name=device_name, limits=limits or StageLimits(), on_stage=on_stage,
                     min_speedup=min_speedup).run()

    record = run()
    if remeasure_above and record.status == "passed" and record.speedup > remeasure_above:
        second = run()
        first_speedup = record.speedup
        if second.status != "passed" or second.speedup < first_speedup:
            record = second
        record.defences.append("excessive_speedup")
        record.warnings.append(f"speedup above {remeasure_above:g}x, so measured twice in fresh workers: "
                               f"{first_speedup:.3g}x, then {second.speedup or float('nan'):.3g}x "
                               f"({second.status}); the lower stands")
    return record

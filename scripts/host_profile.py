"""Where a solution's host time goes: per call, host ms (until the call returns) and device
ms (CUDA events) of the reference and of kforge's solution, then cProfile's top functions
of the solution's calls. For problems the harness reports as host-bound.

    python scripts/host_profile.py level3.vit_block_bf16 level3.gpt_small_bf16 [--top 25]
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import pstats
import statistics
import time

import torch


def _times(fn, inputs, calls: int) -> tuple[float, float]:
    """Median host ms (the call alone) and median device ms of `calls` calls."""
    host, device = [], []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(calls):
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000)  # ~1 ms of GPU sleep: the host enqueues ahead of the device
        start.record()
        begin = time.perf_counter_ns()
        fn(*inputs)
        host.append((time.perf_counter_ns() - begin) / 1e6)
        end.record()
        torch.cuda.synchronize()
        device.append(start.elapsed_time(end))
    return statistics.median(host), statistics.median(device)


def profile(name: str, calls: int, top: int) -> None:
    problem = importlib.import_module(f"kforge.problems.{name}")
    solution = importlib.import_module(f"kforge.solutions.{name}")
    models = {}
    for label, factory in (("reference", problem.Model), ("ours", solution.ModelNew)):
        torch.manual_seed(0)
        with torch.device("cuda"):
            models[label] = factory(*problem.get_init_inputs()).cuda()
    inputs = [t.cuda() if isinstance(t, torch.Tensor) else t for t in problem.get_inputs()]
    with torch.no_grad():
        for label, model in models.items():
            peaks = []
            for _ in range(3):  # the first call compiles, autotunes (and captures a graph, where one is used)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                model(*inputs)
                torch.cuda.synchronize()
                peaks.append(f"{torch.cuda.max_memory_allocated() / 1e9:.2f}")
            print(f"{name:32s} {label:10s} peak GB allocated in calls 1-3: {', '.join(peaks)}; "
                  f"held after: {torch.cuda.memory_allocated() / 1e9:.2f} GB", flush=True)
        torch.cuda.synchronize()
        for label, model in models.items():
            host, device = _times(model, inputs, calls)
            print(f"{name:32s} {label:10s} host {host:8.3f} ms   device {device:8.3f} ms", flush=True)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(calls):
            models["ours"](*inputs)
        profiler.disable()
        torch.cuda.synchronize()
    print(f"--- cProfile of {calls} calls of ours ({name}), by own time ---")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("problems", nargs="+", help="dotted names under kforge.problems, e.g. level3.vit_block_bf16")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    for name in args.problems:
        profile(name, args.calls, args.top)


if __name__ == "__main__":
    main()

"""The process Nsight Compute profiles (`profile.py`): the problem's inputs and the candidate's
ModelNew, built as the judge's workers build them (same seeds), warm-up calls, then one call
inside the NVTX range `kforge_profile`, the only one ncu is told to profile.

    python -m kforge.harness.profile_worker PROBLEM CANDIDATE [--size full] [--seed 0] [--warmup 2]

Exit 0 after the profiled call; 1 with one line on stderr if the problem or the candidate fails.
"""

from __future__ import annotations

import argparse
import sys

import torch

from kforge.errors import KforgeError
from kforge.harness.candidate import load_candidate
from kforge.harness.loading import synchronize
from kforge.harness.problem import load_problem
from kforge.harness.profile import RANGE


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kforge.harness.profile_worker", description=__doc__.split("\n")[0])
    parser.add_argument("problem")
    parser.add_argument("candidate")
    parser.add_argument("--size", default="full")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        problem = load_problem(args.problem, args.size)
        candidate = load_candidate(args.candidate)
        model = candidate.build(problem.init_inputs(args.seed, device), args.seed, device)
        inputs = problem.make_inputs(args.seed, device)
        for _ in range(args.warmup):  # compiles, autotuning and first-call costs stay out of the profile
            candidate.run(model, inputs, sync_device=device)
        if device.type == "cuda":
            torch.cuda.nvtx.range_push(RANGE)
        candidate.run(model, inputs, sync_device=device)
        if device.type == "cuda":
            torch.cuda.nvtx.range_pop()
        synchronize(device)
    except KforgeError as exc:
        print(f"kforge profile: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

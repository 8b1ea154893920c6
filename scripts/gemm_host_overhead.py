"""Where the host time of one bf16 GEMM call goes, on the GPU machine.

    PYTHONPATH=src python scripts/gemm_host_overhead.py [SIZE ...]   (default 1024 4096)

Prints microseconds of Python per call with the GPU kept busy by a queued sleep (so the
device never makes the host wait): our gemm() on four operand sets in turn (as the
harness's rotating inputs give it), torch.matmul on the same, and the parts of ours (a
tensor map found, one encoded, the launch alone). Then, per size, one evaluate() of rung 4
against cuBLAS with the harness's per-call profile (device vs host medians).
"""

import sys
import time

import kforge  # noqa: F401  (before triton)
import torch

from kforge.harness.evaluate import evaluate
from kforge.harness.problem import load_problem
from kforge.harness.timing import TimingConfig
from kforge.kernels import gemm_bf16
from kforge.ladder import rung_candidate
from kforge.runtime.driver import TensorMaps


def host_us(fn, calls=200):  # fewer calls than the launch queue holds: a full queue blocks the host
    torch.cuda.synchronize()
    torch.cuda._sleep(int(3e9))  # keeps the GPU busy: the loop below never waits on it
    start = time.perf_counter()
    for i in range(calls):
        fn(i)
    elapsed = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return elapsed


def parts(n: int) -> None:
    pool = [[torch.randn(n, n, device="cuda").bfloat16() for _ in range(2)] for _ in range(4)]
    for a, b in pool:
        gemm_bf16.gemm(a, b, 4), torch.matmul(a, b)
    plan = next(v for k, v in gemm_bf16._PLANS.items() if k[0] == 4 and k[3] == n)
    a, b = pool[0]
    c = torch.empty(n, n, dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    one_slot = TensorMaps("bfloat16", n, n, 2 * n, (128, 64), capacity=1)  # two addresses in turn: every call encodes
    descriptors = [m.address_of(t.data_ptr()) for m, t in zip(plan.maps, (a, b, c))]
    rows = {
        "gemm(a, b, rung 4), 4 operand sets in turn": lambda i: gemm_bf16.gemm(*pool[i % 4], 4),
        "torch.matmul (cuBLAS), same buffers": lambda i: torch.matmul(*pool[i % 4]),
        "  ours: a tensor map found (address seen before)": lambda i: plan.maps[0].address_of(pool[i % 4][0].data_ptr()),
        "  ours: a tensor map encoded (ctypes)": lambda i: one_slot.address_of(pool[i % 2][0].data_ptr()),
        "  ours: the launch alone (ctypes)": lambda i: plan.launch(stream, *descriptors, *plan.tail, 0, 0),
        "  ours: plan(a, b, c) (3 lookups + launch)": lambda i: plan(a, b, c),
        "  torch.empty((n, n)) for C": lambda i: torch.empty((n, n), dtype=torch.bfloat16, device="cuda"),
    }
    print(f"# {n}^3")
    for name, fn in rows.items():
        print(f"{name:48s} {host_us(fn):7.1f} us/call")


def harness(n: int) -> None:
    problem = load_problem(gemm_bf16.HERE.parent.parent / "problems" / "level1" / "matmul_bf16.py", "full",
                           {"M": n, "N": n, "K": n})
    candidate = rung_candidate(gemm_bf16.rung(4))
    evaluate(problem, candidate, timing=TimingConfig(budget_s=0.5))  # warm
    for run in (1, 2):
        r = evaluate(problem, candidate, timing=TimingConfig(budget_s=2.0)).to_dict()
        prof = r["gate2"]["profile"]
        print(f"{n}^3 evaluate run {run}: {r['status']}, speedup {r['gate2']['speedup']:.3f}x over cuBLAS; "
              + "; ".join(f"{side}: device {v['median_device_ms'] * 1e3:.1f} us, host {v['median_host_ms'] * 1e3:.1f} us"
                          for side, v in prof.items()))


if __name__ == "__main__":
    sizes = [int(s) for s in sys.argv[1:]] or [1024, 4096]
    for size in sizes:
        parts(size)
    for size in sizes:
        harness(size)

"""Where the host time of one bf16 GEMM call goes (rung 5 at 4096^3 on the GPU machine).

    PYTHONPATH=src python scripts/gemm_host_overhead.py

Prints microseconds of Python per call (a GPU sleep queued first, so the device never
makes the host wait): our gemm() with cached tensor maps, torch.matmul, the launch alone,
a tensor-map cache miss and its parts; then one evaluate() of rung 5 against cuBLAS with
the harness's per-call profile (device vs host medians, host-bound share).
"""

import time

import kforge  # noqa: F401  (before triton)
import numpy as np
import torch
from cuda.core._tensor_map import TensorMapDataType, TensorMapSwizzle
from cuda.core.utils import StridedMemoryView

from kforge.harness.evaluate import evaluate
from kforge.harness.problem import load_problem
from kforge.harness.timing import TimingConfig
from kforge.kernels import gemm_bf16
from kforge.ladder import rung_candidate
from kforge.runtime import cuda as runtime

N = 4096


def host_us(fn, calls=200):  # fewer calls than the launch queue holds: a full queue blocks the host
    torch.cuda.synchronize()
    torch.cuda._sleep(int(3e9))  # keeps the GPU busy: the loop below never waits on it
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return elapsed


def main():
    a, b = (torch.randn(N, N, device="cuda").bfloat16() for _ in range(2))
    for _ in range(10):
        gemm_bf16.gemm(a, b, 5), torch.matmul(a, b)
    launch, p, _ = next(v for k, v in gemm_bf16._PLANS.items() if k[0] == 5)
    c = torch.empty(N, N, dtype=torch.bfloat16, device="cuda")
    maps = (runtime.tensor_map(a, (p["BM"], p["BK"])), runtime.tensor_map(b, (p["BK"], 64)),
            runtime.tensor_map(c, (64, 64)))
    sizes = (np.int32(N),) * 3
    view = StridedMemoryView.from_cuda_array_interface(runtime._BareArray(a), stream_ptr=-1)

    def miss():
        runtime._TENSOR_MAPS.clear()
        runtime.tensor_map(a, (128, 64))

    rows = {
        "gemm(a, b, rung 5), tensor maps cached": host_us(lambda: gemm_bf16.gemm(a, b, 5)),
        "torch.matmul (cuBLAS)": host_us(lambda: torch.matmul(a, b)),
        "launch alone (prepared, cuda.core)": host_us(lambda: launch(*maps, *sizes)),
        "tensor_map cache miss": host_us(miss),
        "  of which: view of the address": host_us(
            lambda: StridedMemoryView.from_cuda_array_interface(runtime._BareArray(a), stream_ptr=-1)),
        "  of which: encode (as_tensor_map)": host_us(lambda: view.as_tensor_map(
            (128, 64), data_type=TensorMapDataType.BFLOAT16, swizzle=TensorMapSwizzle.SWIZZLE_128B)),
    }
    for name, us in rows.items():
        print(f"{name:45s} {us:7.1f} us/call")

    problem = load_problem(gemm_bf16.HERE.parent.parent / "problems" / "level1" / "matmul_bf16.py", "full",
                           {"M": N, "N": N, "K": N})
    candidate = rung_candidate(gemm_bf16.rung(5))
    evaluate(problem, candidate, timing=TimingConfig(budget_s=0.5))  # warm
    for run in (1, 2):
        r = evaluate(problem, candidate, timing=TimingConfig(budget_s=2.0)).to_dict()
        prof = r["gate2"]["profile"]
        print(f"evaluate run {run}: {r['status']}, speedup {r['gate2']['speedup']:.3f}x over cuBLAS; "
              + "; ".join(f"{side}: device {v['median_device_ms']:.4f} ms, host {v['median_host_ms']:.4f} ms, "
                          f"host-bound {v['host_bound_frac']:.0%}" for side, v in prof.items()))


if __name__ == "__main__":
    main()

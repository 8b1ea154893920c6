"""The Triton GEMM's autotuner configs one by one against cuBLAS at 4096^3 bf16 (H100).

    PYTHONPATH=src python scripts/triton_gemm_sweep.py [ROUNDS]

Each config is timed after a reading L2 flush, interleaved with cuBLAS every round, medians
of CUDA event times; the table gives TFLOP/s and the ratio to cuBLAS per config: what the
autotuner chooses between, and how far apart its choices are.
"""

import statistics
import sys

import kforge  # noqa: F401  (before triton)
import torch

from kforge.kernels.gemm_bf16 import triton_matmul

N = 4096
L2 = torch.cuda.get_device_properties(0).L2_cache_size
FLUSH = torch.zeros(L2, dtype=torch.int32, device="cuda")
SINK = torch.zeros((), dtype=torch.int64, device="cuda")


def main(rounds: int):
    a, b = (torch.randn(N, N, device="cuda").bfloat16() for _ in range(2))
    want = (a.float() @ b.float())
    fns = {"cuBLAS": lambda: torch.matmul(a, b), "autotuned": lambda: triton_matmul.matmul(a, b)}
    for c in triton_matmul.CONFIGS:
        tiles = dict(c.kwargs, num_stages=c.num_stages, num_warps=c.num_warps)
        name = f"{c.kwargs['BM']}x{c.kwargs['BN']} s{c.num_stages} w{c.num_warps}" + (" flat" if c.kwargs["FLATTEN"]
                                                                                    else "")
        assert torch.allclose(triton_matmul.matmul(a, b, config=tiles).float(), want, atol=0.5, rtol=2e-2), name
        fns[name] = lambda tiles=tiles: triton_matmul.matmul(a, b, config=tiles)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            torch.sum(FLUSH, dim=0, dtype=torch.int64, out=SINK)
            torch.cuda._sleep(1_000_000)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end))
    cublas = statistics.median(times["cuBLAS"])
    for name, t in sorted(times.items(), key=lambda item: statistics.median(item[1])):
        ms = statistics.median(t)
        print(f"{name:24s} {ms * 1e3:7.1f} us {2 * N**3 / ms / 1e9:6.0f} TFLOP/s {cublas / ms:6.3f}x cuBLAS")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 100)

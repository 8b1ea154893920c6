"""Does how the timing engine flushes L2 leak into the timed kernel? (H100, run on the GPU.)

    PYTHONPATH=src python scripts/flush_study.py

Two ways to empty L2 before a timed call: write a buffer 4x its size (the dirty lines it
leaves are written back to HBM while the NEXT kernel evicts them: inside its timed
window), or read one (L2 is left holding clean lines that are dropped for free). Times
memory-bound kernels of 8-235 MB after each, interleaved, 300 rounds, medians of CUDA
event times, and prints GB/s over the bytes each kernel must move.
"""

import statistics

import kforge  # noqa: F401  (before triton)
import torch

from kforge.kernels.serving.gemv import gemv

L2 = torch.cuda.get_device_properties(0).L2_cache_size
flush = torch.zeros(4 * L2 // 4, dtype=torch.int32, device="cuda")
sink = torch.zeros((), dtype=torch.int64, device="cuda")
FLUSHES = {"write": lambda: flush.zero_(), "read": lambda: torch.sum(flush, dim=0, dtype=torch.int64, out=sink)}


def case_gemv(n, k):
    x, w = torch.randn(1, k, device="cuda").bfloat16(), torch.randn(n, k, device="cuda").bfloat16()
    return f"gemv bf16 1 x {n} x {k}", (n * k + k + n) * 2, lambda: gemv(x, w)


def case_linear(n, k):
    x, w = torch.randn(1, k, device="cuda").bfloat16(), torch.randn(n, k, device="cuda").bfloat16()
    return f"F.linear (cuBLAS) 1 x {n} x {k}", (n * k + k + n) * 2, lambda: torch.nn.functional.linear(x, w)


def case_copy(mb):
    src = torch.randn(mb * 2**20 // 4, device="cuda")
    dst = torch.empty_like(src)
    return f"copy {mb} MiB", 2 * src.numel() * 4, lambda: dst.copy_(src)


def main():
    cases = [case_copy(8), case_copy(32), case_copy(256), case_gemv(4096, 4096), case_gemv(28672, 4096),
             case_linear(4096, 4096), case_linear(28672, 4096)]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    print(f"L2 {L2 / 2**20:.0f} MiB; flush buffer {flush.numel() * 4 / 2**20:.0f} MiB")
    print(f"{'kernel':34s} {'MB':>7s} {'write flush':>18s} {'read flush':>18s}")
    for name, nbytes, fn in cases:
        for _ in range(5):
            fn()
        times = {mode: [] for mode in FLUSHES}
        for _ in range(300):
            for mode, do_flush in FLUSHES.items():
                do_flush()
                torch.cuda._sleep(1_000_000)  # the host enqueues the call before the device reaches it
                start.record()
                fn()
                end.record()
                end.synchronize()
                times[mode].append(start.elapsed_time(end))
        cells = []
        for mode in FLUSHES:
            ms = statistics.median(times[mode])
            cells.append(f"{ms * 1e3:7.1f} us {nbytes / ms / 1e6:5.0f} GB/s")
        print(f"{name:34s} {nbytes / 1e6:7.1f} {cells[0]:>18s} {cells[1]:>18s}")


if __name__ == "__main__":
    main()

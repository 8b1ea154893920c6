"""The kernel-alone timing loop the study scripts share (gemm_bf16_variants.py, fused_linear_bench.py,
gemv_sweep.py, fp8_block_variants.py), and the one-launch-each window the ncu scripts profile
(profile_gemm.py, profile_fp8_block.py). The timing loop: every round, each function in turn after a reading L2 flush and a GPU sleep
(so the host has queued the call before the device reaches it), CUDA events around the call
only; medians in milliseconds. No host time: the harness (kforge.harness.timing) is the
place for whole-call figures."""

import statistics

import torch

_FLUSH = None


def _flush() -> None:
    """Read a buffer of L2's size (4 bytes an element: four times L2 in bytes): L2 is left
    holding clean lines that are not the next call's (a writing flush leaks its write-back)."""
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = (torch.zeros(torch.cuda.get_device_properties(0).L2_cache_size, dtype=torch.int32, device="cuda"),
                  torch.zeros((), dtype=torch.int64, device="cuda"))
    torch.sum(_FLUSH[0], dim=0, dtype=torch.int64, out=_FLUSH[1])


def median_ms(fns: dict, rounds: int, sleep_cycles: int = 200_000) -> dict[str, float]:
    """{name: median device ms} of `rounds` interleaved rounds over `fns` (name -> callable)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            _flush()
            torch.cuda._sleep(sleep_cycles)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end))
    return {name: statistics.median(t) for name, t in times.items()}


def profile_once(calls: dict) -> None:
    """Warm every call up (compilation, TMA descriptors, cuBLAS's kernel choice), then run each
    once between cudaProfilerStart and Stop, in an NVTX range of its name: what
    `ncu --profile-from-start off` profiles."""
    for call in calls.values():
        for _ in range(3):
            call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for name, call in calls.items():
        torch.cuda.nvtx.range_push(name)
        call()
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print("profiled, in order:", "; ".join(calls))


def checked_variants(variants, run, want: torch.Tensor, tolerance: float = 2e-2) -> dict:
    """{name: call} for each (name, config) of `variants` whose `run(config)` is within
    `tolerance` (max abs) of `want`; one that raises (e.g. out of shared memory) or is wrong
    is printed and left out, so a sweep times the rest."""
    fns = {}
    for name, config in variants:
        try:
            got = run(config)
        except Exception as error:  # noqa: BLE001 - any failure of one variant: say so, keep sweeping
            print(f"  {name}: {type(error).__name__}: {str(error).splitlines()[0][:100]}")
            continue
        error = (got.float() - want.float()).abs().max().item()
        if error > tolerance:
            print(f"  {name}: wrong (max error {error:.3g}), not timed")
            continue
        fns[name] = lambda c=config: run(c)
    return fns

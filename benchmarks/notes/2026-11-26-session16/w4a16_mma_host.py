"""TEMPORARY: where the W4A16 small-batch path's host time goes."""
import cProfile, pstats, time, sys
sys.path.insert(0, "scripts")
import kforge  # noqa
import torch
from kforge.kernels.quant import w4a16
from kforge.kernels.quant.formats import quantize_int4

for b, n, k in ((16, 14336, 4096), (32, 4096, 4096), (1, 14336, 4096)):
    q, s = quantize_int4(torch.randn(n, k, device="cuda") / 64, 128)
    x = torch.randn(b, k, device="cuda").bfloat16()
    f = lambda: w4a16.w4a16_matmul(x, q, s)
    for _ in range(20): f()
    torch.cuda.synchronize()
    hosts = []
    for _ in range(300):
        torch.cuda._sleep(2_000_000)
        t = time.perf_counter_ns(); f(); hosts.append((time.perf_counter_ns() - t) / 1e3)
        torch.cuda.synchronize()
    hosts.sort()
    print(f"B={b} N={n} K={k}: host us median {hosts[len(hosts)//2]:.1f}")
    pr = cProfile.Profile(); pr.enable()
    for _ in range(300):
        f()
    pr.disable(); torch.cuda.synchronize()
    pstats.Stats(pr).sort_stats("cumulative").print_stats(14)

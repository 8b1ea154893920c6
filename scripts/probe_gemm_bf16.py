"""Development probe (first device run of the bf16 rungs): correctness on odd shapes, then quick timings."""
import sys
import statistics

import torch

from kforge.kernels import gemm_bf16 as g

step = g.rung(sys.argv[1])
defines = dict(kv.split("=") for kv in sys.argv[2:] if "=" in kv)
defines = {k: int(v) for k, v in defines.items()}
torch.manual_seed(0)
dev = "cuda"


def operands(m, n, k, layout):
    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=dev, dtype=torch.bfloat16) if layout == "kn" else torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    return a, b


if not defines and "--no-check" not in sys.argv:
    for layout in g.B_LAYOUTS:
        for m, n, k in [(1, 8, 8), (129, 136, 72), (257, 264, 4104), (1000, 520, 1032), (4096, 4096, 4096)]:
            a, b = operands(m, n, k, layout)
            c = g.gemm(a, b, step, b_layout=layout)
            ref = a.double() @ (b.double() if layout == "kn" else b.double().T)
            err = ((c.double() - ref).abs().max() / ref.abs().max()).item()
            torch.cuda.synchronize()
            print(f"{step.label} {layout} {m}x{n}x{k}: max err / max |ref| = {err:.2e} {'OK' if err < 1e-2 else 'WRONG'}", flush=True)

flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)


def bench(fn, reps=30):
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        flush.zero_()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def back_to_back(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / reps


import time
a, b = operands(1024, 1024, 1024, "kn")
g.gemm(a, b, step, defines=defines)
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(200):
    g.gemm(a, b, step, defines=defines)
host_us = (time.perf_counter() - t0) / 200 * 1e6
torch.cuda.synchronize()
print(f"{step.label} host time per call {host_us:.1f} us", flush=True)
import cProfile, pstats
prof = cProfile.Profile()
prof.enable()
for _ in range(200):
    g.gemm(a, b, step, defines=defines)
prof.disable()
torch.cuda.synchronize()
pstats.Stats(prof).sort_stats("tottime").print_stats(12)
if step.persistent:
    kernel, p = g.prepared(step, "kn", defines)
    print("max active clusters", kernel.max_active_clusters(step.threads(p), p.get("CLUSTER_M", 1), step.shared_bytes(p), 0))

for size in (4096, 8192):
    for layout in g.B_LAYOUTS:
        a, b = operands(size, size, size, layout)
        ours = bench(lambda: g.gemm(a, b, step, b_layout=layout, defines=defines))
        lib = bench(lambda: a @ b) if layout == "kn" else bench(lambda: a @ b.T)
        tf = lambda ms: 2 * size**3 / ms / 1e9
        ours_b2b = back_to_back(lambda: g.gemm(a, b, step, b_layout=layout, defines=defines))
        lib_b2b = back_to_back(lambda: a @ b) if layout == "kn" else back_to_back(lambda: a @ b.T)
        print(f"{step.label} {defines} {layout} {size}^3: ours {ours:.3f} ms {tf(ours):.0f} TF | cuBLAS {lib:.3f} ms "
              f"{tf(lib):.0f} TF | ratio {lib / ours:.3f} | back-to-back ours {tf(ours_b2b):.0f} TF cuBLAS {tf(lib_b2b):.0f} TF", flush=True)

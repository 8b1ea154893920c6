"""One GEMV at llama3-8b widths, L2 flushed, with and without an L2 prefetch of its weight before a
sleep (the stand-in for attention): what a prefetched GEMV costs. Device time by events around the
GEMV alone, median of 50."""
import statistics, sys
import torch
from kforge.models.llama import model as M
from kforge.models.llama.quantize import _quantize

dev = torch.device("cuda")
props = torch.cuda.get_device_properties(dev)
print(f"# {props.name}, L2 {props.L2_cache_size / 2**20:.0f} MiB, {props.multi_processor_count} SMs")
flush = torch.empty(512 << 20, dtype=torch.uint8, device=dev)
SHAPES = {"wqkv": (6144, 4096), "wo": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
SLEEP = int(sys.argv[1]) if len(sys.argv) > 1 else 20000  # cycles


def timed(fn, pre, reps=50):
    out = []
    for _ in range(reps):
        flush.random_(0, 255) if False else flush.fill_(1)
        pre()
        torch.cuda._sleep(SLEEP)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) * 1e3)
    return statistics.median(out)


print(f"{'fmt':6} {'weight':8} {'MB':>7} {'cold us':>8} {'pf all':>8} {'pf 8MB':>8} {'pf 16MB':>8} {'pf 32MB':>8}")
for fmt in ("bf16", "w4a16", "fp8"):
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        wq = w if fmt == "bf16" else _quantize(w, fmt)
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        fn = lambda: M.linear(x, wq)
        fn(); torch.cuda.synchronize()
        mb = sum(t.nbytes for t in M.weight_tensors(wq)) / 1e6
        cold = timed(fn, lambda: None)
        res = [timed(fn, lambda b=b: M.prefetch_weights(wq, max_bytes=b)) for b in (None, 8 << 20, 16 << 20, 32 << 20)]
        print(f"{fmt:6} {name:8} {mb:7.1f} {cold:8.2f} " + " ".join(f"{r:8.2f}" for r in res), flush=True)
        del w, wq

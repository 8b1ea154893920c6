"""TEMPORARY (not committed): bulk GEMV copy shapes A/B, three repeats."""
import kforge  # noqa: F401
from pathlib import Path
import numpy as np
import torch
from device_timing import median_ms
from kforge.kernels.quant import w4a16
from kforge.runtime.cuda import CudaKernel
from quant_gemv_sweep import w4a16_inputs, copy_bandwidth_gbps

copy = copy_bandwidth_gbps()
stream = CudaKernel.from_file(Path(__file__).with_name("read_stream.cu"), "read_stream")
sink = torch.zeros(1, dtype=torch.int32, device="cuda")
for n, k in [(28672, 4096), (14336, 4096)]:
    x, q, s = w4a16_inputs(n, k)
    ref = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
    w4a16.launch_cuda_gemv(x, q, s, 128, ref)
    fns = {"default w4a16_gemv.cu": lambda: w4a16.launch_cuda_gemv(x, q, s, 128, ref)}
    for extra in ("w4a16_gemv_bulk_head.cu", "w4a16_gemv_bulk.cu"):
        for rows, cons, st in [(2, 4, 4)]:
            kern = CudaKernel.from_file(w4a16.BULK_SOURCE.with_name(extra), "w4a16_gemv_bulk", defines={"ROWS": rows, "CONSUMERS": cons, "STAGES": st})
            smem = w4a16.bulk_shared_bytes(k, rows, cons, st)
            grid = min(-(-n // (rows * cons)), kern.max_active_clusters(32 * (cons + 1), 1, smem, 0))
            lean = kern.lean(grid, 32 * (cons + 1), 0, kinds=w4a16.BULK_KINDS, shared_bytes=smem)
            y = torch.full((1, n), float("nan"), dtype=torch.bfloat16, device="cuda")
            call = lambda lean=lean, y=y: lean(torch._C._cuda_getCurrentRawStream(0), q.data_ptr(), s.data_ptr(), x.data_ptr(), y.data_ptr(), n, k)
            call()
            assert torch.equal(y, ref), (extra, rows, cons, st)
            fns[f"{extra} ({rows},{cons},{st}) grid {grid}"] = call
    nbytes = q.numel() + s.numel() * 2 + (k + n) * 2
    buf = torch.empty(nbytes // 16 * 16, dtype=torch.uint8, device="cuda")
    fns["read stream"] = lambda: stream.launch(8 * 132, 256, (buf, np.int64(nbytes // 16), sink))
    print(f"N={n} K={k}")
    reps = [median_ms(fns, 200, sleep_cycles=1_000_000) for _ in range(3)]
    for name in sorted(fns, key=lambda nm: reps[0][nm]):
        us = [r[name] * 1e3 for r in reps]
        print(f"  {' '.join(f'{u:6.2f}' for u in us)} us  {100 * nbytes / min(us) / 1e3 / copy:5.1f}% (best)  {name}")

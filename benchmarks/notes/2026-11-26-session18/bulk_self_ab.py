"""Session 18 A/B (one-off): w4a16_gemv_bulk_self.cu (no producer warp: each warp streams its own
rows) in each (ROWS, WARPS, STAGES) variant against the committed one-token kernels (checked bit
for bit against w4a16_gemv.cu, whose sums it copies), cuBLAS's bf16 GEMV on the dequantized W, the
committed bulk kernel's feed alone and the read stream:

    git apply benchmarks/notes/2026-11-26-session18/bulk-self-fed-not-kept.patch
    PYTHONPATH=src:scripts python benchmarks/notes/2026-11-26-session18/bulk_self_ab.py
"""

import lab  # noqa: I001  (first: builds the lab tree, measures the copy bandwidth)
from pathlib import Path

import torch

from kforge.kernels.quant import w4a16
from kforge.runtime.cuda import CudaKernel

SOURCE = Path(w4a16.__file__).with_name("w4a16_gemv_bulk_self.cu")
VARIANTS = [(2, 4, 4), (2, 4, 3), (2, 4, 5), (2, 4, 6), (2, 8, 2), (2, 8, 3), (4, 4, 2), (4, 4, 3), (1, 8, 4),
            (2, 6, 3)]  # ROWS, WARPS, STAGES


def shared_bytes(k, rows, warps, stages):
    return warps * stages * rows * (2048 + 64) + k * 4 + k // 32 * 4 + warps * stages * 8


kernels = {v: CudaKernel.from_file(SOURCE, "w4a16_gemv_bulk_self", defines={"ROWS": v[0], "WARPS": v[1], "STAGES": v[2]})
           for v in VARIANTS}

for n, k in [(28672, 4096), (14336, 4096), (6144, 4096), (4096, 4096), (4096, 14336)]:
    x, q, s, exact, fns = lab.w4a16_baselines(n, k)
    want = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
    w4a16.launch_cuda_gemv(x, q, s, 128, want)
    for (rows, warps, stages), kernel in kernels.items():
        smem = shared_bytes(k, rows, warps, stages)
        if smem > 227 * 1024:
            continue
        y = torch.full((1, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        call = lab.bulk_launch(kernel, 32 * warps, smem, rows * warps, x, q, s, y)
        call()
        torch.cuda.synchronize()
        name = f"self-fed ROWS={rows} WARPS={warps} STAGES={stages}"
        if not torch.equal(y, want):
            print(f"  {name}: not w4a16_gemv.cu's bits, not timed")
            continue
        fns[name] = call
    if k <= 4096:
        fns["TIMING ONLY: the bulk kernel's feed (FEED_ONLY)"] = lab.bulk_feed_launch(x, q, s)
    nbytes = q.numel() + s.numel() * 2 + (k + n) * 2
    lab.add_read_stream(fns, nbytes)
    lab.timed(f"W4A16 N={n} K={k}", fns, nbytes, lab.CUBLAS)

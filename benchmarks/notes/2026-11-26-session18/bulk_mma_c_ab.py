"""Session 18 A/B (one-off): the fourth form of w4a16_bulk_mma.cu (W's 16-row tiles as the mma's A,
each stage PART_BYTES of the tile's rows: 1 KB gives the bulk kernel's 16 KB stages of 16 copies,
two blocks an SM) in each (CONSUMERS, STAGES, PART_BYTES, ROW_STRIDE) variant, against the
committed one-token kernels, cuBLAS's bf16 GEMV on the dequantized W, the committed bulk kernel's
feed alone and the read stream:

    git apply benchmarks/notes/2026-11-26-session18/bulk-mma-parts-not-kept.patch
    PYTHONPATH=src:scripts python benchmarks/notes/2026-11-26-session18/bulk_mma_c_ab.py
"""

import lab  # noqa: I001  (first: builds the lab tree, measures the copy bandwidth)
import torch

from kforge.kernels.quant import w4a16
from kforge.runtime.cuda import CudaKernel

VARIANTS = [(4, 4, 1024, 1024), (4, 5, 1024, 1024), (4, 6, 1024, 1024), (8, 4, 1024, 1024), (8, 6, 1024, 1024),
            (4, 4, 1024, 1088), (16, 3, 1024, 1024), (2, 4, 1024, 1024), (4, 3, 2048, 2048)]
# CONSUMERS, STAGES, PART_BYTES, ROW_STRIDE
kernels = {v: CudaKernel.from_file(w4a16.BULK_MMA_SOURCE, "w4a16_bulk_mma",
                                   defines={"CONSUMERS": v[0], "STAGES": v[1], "PART_BYTES": v[2], "ROW_STRIDE": v[3]})
           for v in VARIANTS}

for n, k in [(28672, 4096), (14336, 4096), (6144, 4096), (4096, 4096)]:
    x, q, s, exact, fns = lab.w4a16_baselines(n, k)
    for (consumers, stages, part, row_stride), kernel in kernels.items():
        smem = w4a16.bulk_mma_shared_bytes(k, consumers, stages) + stages * 16 * (row_stride - 1024)
        y = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
        lab.add_checked(fns, f"bulk_mma CONSUMERS={consumers} STAGES={stages} PART_BYTES={part} ROW_STRIDE={row_stride}",
                        lab.bulk_launch(kernel, 32 * (consumers + 1), smem, 16, x, q, s, y), y, exact)
    fns["TIMING ONLY: the bulk kernel's feed (FEED_ONLY)"] = lab.bulk_feed_launch(x, q, s)
    nbytes = q.numel() + s.numel() * 2 + (k + n) * 2
    lab.add_read_stream(fns, nbytes)
    lab.timed(f"W4A16 N={n} K={k}", fns, nbytes, lab.CUBLAS)

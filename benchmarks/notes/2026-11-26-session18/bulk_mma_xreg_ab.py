"""Session 18 A/B (one-off): the second form of w4a16_bulk_mma.cu (x's fragments in registers, 8 or
16 consumer warps), each (CONSUMERS, STAGES, EXACT_DECODE) variant and rows at a 2048-byte stride
(ROW_STRIDE, 128-byte aligned), against the committed one-token kernels, cuBLAS's bf16 GEMV on the
dequantized W, the committed bulk kernel's feed alone and the read stream:

    git apply benchmarks/notes/2026-11-26-session18/bulk-mma-xreg-not-kept.patch
    PYTHONPATH=src:scripts python benchmarks/notes/2026-11-26-session18/bulk_mma_xreg_ab.py
"""

import lab  # noqa: I001  (first: builds the lab tree, measures the copy bandwidth)
import torch

from kforge.kernels.quant import w4a16
from kforge.runtime.cuda import CudaKernel

VARIANTS = [(8, 6, False), (8, 6, True), (16, 6, False), (8, 3, False), (16, 3, False), (4, 6, False)]

for n, k in [(28672, 4096), (14336, 4096), (4096, 4096)]:
    x, q, s, exact, fns = lab.w4a16_baselines(n, k)
    for consumers, stages, exact_decode in VARIANTS:
        y = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
        lab.add_checked(fns, f"bulk_mma CONSUMERS={consumers} STAGES={stages} EXACT_DECODE={int(exact_decode)}",
                        lambda y=y, c=consumers, st=stages, e=exact_decode: w4a16.launch_bulk_mma(
                            x, q, s, y, consumers=c, stages=st, exact=e), y, exact)
    for consumers in (8, 16):  # rows 128-byte aligned in the stage (2-way bank conflicts on W's loads)
        kernel = CudaKernel.from_file(w4a16.BULK_MMA_SOURCE, "w4a16_bulk_mma",
                                      defines={"CONSUMERS": consumers, "STAGES": 6, "ROW_STRIDE": 2048})
        y = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
        smem = w4a16.bulk_mma_shared_bytes(k, consumers, 6) - 6 * 16 * 64
        lab.add_checked(fns, f"bulk_mma CONSUMERS={consumers} STAGES=6 ROW_STRIDE=2048",
                        lab.bulk_launch(kernel, 32 * (consumers + 1), smem, 16, x, q, s, y), y, exact)
    fns["TIMING ONLY: the bulk kernel's feed (FEED_ONLY)"] = lab.bulk_feed_launch(x, q, s)
    nbytes = q.numel() + s.numel() * 2 + (k + n) * 2
    lab.add_read_stream(fns, nbytes)
    lab.timed(f"W4A16 N={n} K={k}", fns, nbytes, lab.CUBLAS)

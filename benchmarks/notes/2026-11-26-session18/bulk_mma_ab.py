"""Session 18 A/B (one-off): the first form of w4a16_bulk_mma.cu (one token on the tensor cores, W's
16-row tiles as the mma's A, whole rows a stage, x's fragments in shared memory) in each
(CONSUMERS, STAGES, EXACT_DECODE) variant against the committed one-token kernels, cuBLAS's bf16
GEMV on the dequantized W, the committed bulk kernel's feed alone and the read stream. The first
form is bulk-mma-xreg-not-kept.patch with w4a16_bulk_mma_lab.cu (knobs off) as the kernel:

    git apply benchmarks/notes/2026-11-26-session18/bulk-mma-xreg-not-kept.patch
    cp benchmarks/notes/2026-11-26-session18/w4a16_bulk_mma_lab.cu src/kforge/kernels/quant/w4a16_bulk_mma.cu
    PYTHONPATH=src:scripts python benchmarks/notes/2026-11-26-session18/bulk_mma_ab.py
"""

import lab  # noqa: I001  (first: builds the lab tree, measures the copy bandwidth)
import torch

from kforge.kernels.quant import w4a16

VARIANTS = [(4, 6, False), (4, 6, True), (8, 6, False), (4, 3, False), (8, 3, False), (2, 3, False), (6, 6, False)]

for n, k in [(28672, 4096), (14336, 4096), (6144, 4096), (4096, 4096)]:
    x, q, s, exact, fns = lab.w4a16_baselines(n, k)
    for consumers, stages, exact_decode in VARIANTS:
        y = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
        lab.add_checked(fns, f"bulk_mma CONSUMERS={consumers} STAGES={stages} EXACT_DECODE={int(exact_decode)}",
                        lambda y=y, c=consumers, st=stages, e=exact_decode: w4a16.launch_bulk_mma(
                            x, q, s, y, consumers=c, stages=st, exact=e), y, exact)
    fns["TIMING ONLY: the bulk kernel's feed (FEED_ONLY)"] = lab.bulk_feed_launch(x, q, s)
    nbytes = q.numel() + s.numel() * 2 + (k + n) * 2
    lab.add_read_stream(fns, nbytes)
    lab.timed(f"W4A16 N={n} K={k}", fns, nbytes, lab.CUBLAS)

"""Session 18 A/B (one-off): why the first form of w4a16_bulk_mma.cu is slower than its instruction
count predicts. Its lab copy (w4a16_bulk_mma_lab.cu) with the rows 128-byte aligned in the stage
(ROW_STRIDE 2048, 2176), its feed alone (FEED_ONLY, timing only) and 4 chunks a loop step (UNROLL),
beside the committed kernels, the committed bulk kernel's feed alone and the read stream. Needs the
first form's tree (bulk_mma_ab.py's docstring):

    PYTHONPATH=src:scripts python benchmarks/notes/2026-11-26-session18/bulk_mma_lab_ab.py
"""

import lab  # noqa: I001  (first: builds the lab tree, measures the copy bandwidth)
import shutil

import torch

from kforge.kernels.quant import w4a16
from kforge.runtime.cuda import CudaKernel
from quant_gemv_sweep import w4a16_inputs

# (CONSUMERS, STAGES, defines) of the lab copy
LAB_BUILDS = [(8, 6, {}), (8, 6, {"ROW_STRIDE": 2048}), (8, 6, {"ROW_STRIDE": 2176}), (4, 6, {"ROW_STRIDE": 2176}),
              (8, 6, {"UNROLL": 4}), (8, 6, {"FEED_ONLY": 1}), (8, 6, {"FEED_ONLY": 1, "ROW_STRIDE": 2176})]
shutil.copy(lab.HERE / "w4a16_bulk_mma_lab.cu", lab.LAB / "quant/w4a16_bulk_mma_lab.cu")


def lab_smem(k, consumers, stages, row_stride):
    chunks = k // 128
    return stages * (16 * row_stride + 1024) + chunks * 260 + 2 * (consumers - 1) * 64 + 2 * stages * 8


for n, k in [(28672, 4096), (14336, 4096)]:
    x, q, s = w4a16_inputs(n, k)
    exact = lab.w4a16_exact(x, q, s)
    y = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
    fns = {"committed w4a16_gemv_bulk.cu": lambda y=y: w4a16.launch_bulk_gemv(x, q, s, y)}
    y = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
    fns["committed w4a16_bulk_mma.cu (8, 6)"] = lambda y=y: w4a16.launch_bulk_mma(x, q, s, y, consumers=8, stages=6)
    for consumers, stages, defines in LAB_BUILDS:
        kernel = CudaKernel.from_file(lab.LAB / "quant/w4a16_bulk_mma_lab.cu", "w4a16_bulk_mma",
                                      defines={"CONSUMERS": consumers, "STAGES": stages, **defines})
        y = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
        call = lab.bulk_launch(kernel, 32 * (consumers + 1), lab_smem(k, consumers, stages,
                                                                      defines.get("ROW_STRIDE", 2112)), 16, x, q, s, y)
        name = f"lab ({consumers}, {stages}) {defines}"
        if "FEED_ONLY" in defines:
            fns["TIMING ONLY " + name] = call
        else:
            lab.add_checked(fns, name, call, y, exact)
    fns["TIMING ONLY committed bulk kernel's feed"] = lab.bulk_feed_launch(x, q, s)
    nbytes = q.numel() + s.numel() * 2 + (k + n) * 2
    lab.add_read_stream(fns, nbytes)
    lab.timed(f"W4A16 N={n} K={k}", fns, nbytes)

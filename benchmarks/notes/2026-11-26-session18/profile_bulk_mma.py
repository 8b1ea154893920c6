"""Session 18 (one-off, kept as it ran): w4a16_bulk_mma.cu (8 consumers, 6 stages) and the committed
w4a16_gemv_bulk.cu at 28672 x 4096 under Nsight Compute, one launch each (device_timing.profile_once):

    ncu --clock-control none --profile-from-start off --set full --import-source no -f -o $OUT/bulk-mma \\
        env PYTHONPATH=src:scripts python benchmarks/notes/2026-11-26-session18/profile_bulk_mma.py
"""

import kforge  # noqa: F401  (before triton)
import torch

from device_timing import profile_once
from kforge.kernels.quant import w4a16
from quant_gemv_sweep import w4a16_inputs

x, q, s = w4a16_inputs(28672, 4096)
y = torch.empty(1, 28672, dtype=torch.bfloat16, device="cuda")
profile_once({"w4a16_bulk_mma (8, 6)": lambda: w4a16.launch_bulk_mma(x, q, s, y, consumers=8, stages=6),
              "w4a16_gemv_bulk": lambda: w4a16.launch_bulk_gemv(x, q, s, y)})

"""Session 18 A/B (one-off): where the 4-bit GEMVs lose to a read-only stream. On the committed tree:

    PYTHONPATH=src:scripts python benchmarks/notes/2026-11-26-session18/gemv_feed_ab.py

W4A16 at batch 1 (28672 x 4096, 14336 x 4096): the committed bulk-fed kernel against its lab build
(lab.py) with each row's codes in 2 or 4 copies (COPY_SPLIT), and a timing-only build whose
consumers compute nothing (FEED_ONLY: how fast the copies alone arrive). NVFP4 on the problem
set: the committed kernel against lab builds with an L2 prefetch-size hint on a's loads. Beside
both, the read stream with and without that hint. Every build that computes is checked bit for
bit against the committed kernel before it is timed.
"""

import lab  # noqa: I001  (first: builds the lab tree, measures the copy bandwidth)
import torch

from kforge.kernels.quant import nvfp4_gemv, w4a16
from kforge.kernels.quant.formats import quantize_nvfp4
from kforge.runtime.cuda import CudaKernel
from quant_gemv_sweep import w4a16_inputs

ROWS, CONSUMERS, STAGES = 2, 4, 4  # the committed defaults at K = 4096
W4A16_BUILDS = {"lab, no knob (the committed code)": {}, "lab COPY_SPLIT=2": {"COPY_SPLIT": 2},
                "lab COPY_SPLIT=4": {"COPY_SPLIT": 4}, "TIMING ONLY lab FEED_ONLY=1": {"FEED_ONLY": 1},
                "TIMING ONLY lab FEED_ONLY=1 COPY_SPLIT=2": {"FEED_ONLY": 1, "COPY_SPLIT": 2}}

for n, k in [(28672, 4096), (14336, 4096)]:
    x, q, s = w4a16_inputs(n, k)
    ref = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
    w4a16.launch_cuda_gemv(x, q, s, 128, ref)  # the register kernel: the bulk kernel's bits, by construction
    y = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
    fns = {"committed w4a16_gemv_bulk.cu": lambda y=y: w4a16.launch_bulk_gemv(x, q, s, y)}
    smem = w4a16.bulk_shared_bytes(k, ROWS, CONSUMERS, STAGES)
    for name, defines in W4A16_BUILDS.items():
        kernel = CudaKernel.from_file(lab.LAB / "quant/w4a16_gemv_bulk.cu", "w4a16_gemv_bulk",
                                      defines={"ROWS": ROWS, "CONSUMERS": CONSUMERS, "STAGES": STAGES, **defines})
        y = torch.full((1, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        call = lab.bulk_launch(kernel, 32 * (CONSUMERS + 1), smem, ROWS * CONSUMERS, x, q, s, y)
        call()
        torch.cuda.synchronize()
        if "TIMING ONLY" not in name and not torch.equal(y, ref):
            print(f"  {name}: WRONG, not timed")
            continue
        fns[name] = call
    nbytes = q.numel() + s.numel() * 2 + (k + n) * 2
    for hint in (0, 128, 256):
        lab.add_read_stream(fns, nbytes, hint)
    lab.timed(f"W4A16 N={n} K={k}", fns, nbytes)

for m, k, batches in [(7168, 16384, 1), (4096, 7168, 8), (7168, 2048, 4)]:
    a, a_scales, a_gs = quantize_nvfp4(torch.randn(batches, m, k, device="cuda"))
    b, b_scales, b_gs = quantize_nvfp4(torch.randn(batches, 1, k, device="cuda") / k**0.5)
    operands = (a, a_scales, a_gs, b, b_scales, b_gs)
    ref = torch.full((batches, m, 1), float("nan"), dtype=torch.float16, device="cuda")
    nvfp4_gemv.launch_cuda_gemv(*operands, ref)
    rows, warps = nvfp4_gemv.cuda_variant(k)
    fns = {"committed nvfp4_gemv.cu": lambda: nvfp4_gemv.launch_cuda_gemv(*operands, ref)}
    for hint in (0, 128, 256):
        kernel = CudaKernel.from_file(lab.LAB / "quant/nvfp4_gemv.cu", "nvfp4_gemv",
                                      defines={"ROWS": rows, "WARPS": warps, "L2_PREFETCH": hint})
        launch = kernel.lean((-(-m // (rows * warps)), batches), 32 * warps, 0, kinds=nvfp4_gemv.CUDA_KINDS)
        c = torch.full_like(ref, float("nan"))

        def call(launch=launch, c=c):
            launch(torch._C._cuda_getCurrentRawStream(0), a.data_ptr(), a_scales.data_ptr(), b.data_ptr(),
                   b_scales.data_ptr(), a_gs.data_ptr(), b_gs.data_ptr(), c.data_ptr(), m, k // 32,
                   a.stride(0) // 16, a.stride(1) // 16, a_scales.stride(0) // 2, a_scales.stride(1) // 2,
                   b.stride(0) // 16, b_scales.stride(0) // 2, c.stride(0), c.stride(1))

        call()
        torch.cuda.synchronize()
        name = f"lab L2_PREFETCH={hint}" + (" (the committed code)" if hint == 0 else "")
        if not torch.equal(c, ref):
            print(f"  {name}: WRONG, not timed")
            continue
        fns[name] = call
    nbytes = nvfp4_gemv.nvfp4_gemv_min_bytes(m, k, batches)
    for hint in (0, 128, 256):
        lab.add_read_stream(fns, nbytes, hint)
    lab.timed(f"NVFP4 M={m} K={k} L={batches}", fns, nbytes)

"""The 4-bit GEMVs on the GPU, kernel by kernel: W4A16 at batch 1 and the batched NVFP4 GEMV.

    PYTHONPATH=src python scripts/quant_gemv_sweep.py [nvfp4] [w4a16] [w4a16-batch]   (default: the first two)

For each shape, the CUDA kernels (`w4a16_gemv.cu`, `nvfp4_gemv.cu`) in every ROWS x WARPS
variant below and the Triton kernels they replace are checked against the reference first
(a wrong one is reported and not timed), then timed as gemv_sweep.py times the bf16 GEMV:
after a reading L2 flush, interleaved, medians of CUDA event times (device_timing.median_ms),
with two ceilings beside them: a read-only stream of the same bytes (`read_stream.cu`) and
an empty launch. W4A16 also runs `w4a16_gemv_bulk.cu` (W streamed into shared memory by the
bulk-copy engine) in each ROWS x CONSUMERS x STAGES variant, timed only if its output is
`w4a16_gemv.cu`'s bit for bit. % of copy is on the packed bytes (codes and scales) against a
copy measured in the same run. `w4a16-batch` times 2 to 32 tokens: `w4a16_mma.cu` in each
MT x KW variant against the Triton tensor-core path it replaces and cuBLAS on the dequantized W.
W4A16 also shows `w4a16_matmul` itself (the kernel `one_token_kernel` names for the width) and
the bf16 GEMVs on the same weights (cuBLAS and kforge's `gemv`), and both as a decode step runs
them: eight calls on eight weights back to back in one CUDA graph, per call.
"""

import kforge  # noqa: F401  (before triton)
import sys
from pathlib import Path

import numpy as np
import torch

from device_timing import median_ms
from kforge.kernels.quant import nvfp4_gemv, w4a16
from kforge.kernels.quant.formats import dequantize_int4, quantize_nvfp4
from kforge.kernels.serving.gemv import gemv
from kforge.runtime.cuda import CudaKernel

ROUNDS = 200
GRAPHED = 8
VARIANTS = [(1, 4), (2, 4), (2, 8), (4, 4), (4, 8), (8, 4)]  # (ROWS, WARPS)
BULK_VARIANTS = [(2, 4, 4), (2, 4, 5), (4, 4, 4), (2, 5, 4), (2, 5, 3), (1, 5, 4), (2, 7, 2)]  # ROWS, CONSUMERS, STAGES
W4A16_SHAPES = [(4096, 4096), (6144, 4096), (14336, 4096), (4096, 14336), (28672, 4096)]
# (MT, KW, XPF) of w4a16_mma.cu by NT (8-token tiles)
MMA_VARIANTS = {1: [(m, k, x) for m, k in ((1, 4), (1, 8), (1, 16), (2, 2), (2, 4), (4, 2)) for x in (0, 1)],
                2: [(m, k, x) for m, k in ((1, 8), (2, 2), (2, 4), (2, 8), (3, 4), (4, 2)) for x in (0, 1)],
                4: [(2, 4, 0), (2, 8, 0), (2, 8, 1), (3, 2, 0), (3, 4, 0), (4, 2, 0)]}
BATCH_SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (28672, 4096)]
BATCHES = [2, 3, 8, 16, 32]  # NT 1, 1, 1, 2, 4
NVFP4_SHAPES = [(7168, 16384, 1), (4096, 7168, 8), (7168, 2048, 4)]  # (M, K, L)


def admit(fns, name, call, got, want, tol):
    """Time `call` under `name` only if its output `got` matches float64 `want` (atol = rtol = tol)."""
    if torch.allclose(got.double(), want, atol=tol, rtol=tol):
        fns[name] = call
    else:
        print(f"  {name}: WRONG, max error {(got.double() - want).abs().nan_to_num(1e9).max().item():.3g}")


def report(times, nbytes, copy_gbps):
    for name, ms in sorted(times.items(), key=lambda item: item[1]):
        us = ms * 1e3
        print(f"  {us:7.1f} us  {100 * nbytes / us / 1e3 / copy_gbps:5.1f}% of copy  {name}")


def report_graphed(graphed, nbytes, copy_gbps, what):
    """Each of `graphed` (name -> a function making GRAPHED calls) captured in one CUDA graph and
    replayed: the time per call as a decode step sees it, launches back to back."""
    replays = {}
    for name, calls in graphed.items():
        calls()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            calls()
        replays[name] = graph.replay
    print(f"  {GRAPHED} calls back to back in one CUDA graph, per call (% of copy on the {what} bytes):")
    report({name: ms / GRAPHED for name, ms in median_ms(replays, ROUNDS // 4).items()}, nbytes, copy_gbps)


def ceilings(fns, nbytes, stream, sink, blocks):
    """The read stream over a buffer of `nbytes` and an empty launch, added to `fns`."""
    words = np.int64(nbytes // 16)
    buffer = torch.empty(int(words) * 16, dtype=torch.uint8, device="cuda")
    fns["ceiling: read stream of the same bytes"] = lambda: stream.launch(blocks, 256, (buffer, words, sink))
    fns["ceiling: empty launch"] = lambda: stream.launch(1, 256, (buffer, np.int64(0), sink))


def w4a16_inputs(n, k):
    codes = torch.randint(-8, 8, (n, k), dtype=torch.int8, device="cuda")
    scales = torch.pow(2.0, torch.randint(-8, -4, (n, k // 128), device="cuda").float()).bfloat16()
    nibbles = (codes & 0xF).to(torch.uint8)
    return torch.randn(1, k, device="cuda").bfloat16(), nibbles[:, 0::2] | (nibbles[:, 1::2] << 4), scales


def sweep_w4a16(copy_gbps, stream, sink, blocks):
    for n, k in W4A16_SHAPES:
        x, qweight, scales = w4a16_inputs(n, k)
        w = dequantize_int4(qweight, scales, 128)
        want = torch.nn.functional.linear(x.double(), w.double())
        fns = {"cuBLAS bf16 (F.linear on the dequantized W)": lambda: torch.nn.functional.linear(x, w),
               "kforge bf16 gemv (gemv_rows.cu)": lambda: gemv(x, w)}
        tile = {"path": "gemv", "BLOCK_N": 8, "BLOCK_KW": 512, "num_warps": 4}
        fns["Triton w4a16 (8, 512, 4 warps)"] = lambda: w4a16.w4a16_matmul(x, qweight, scales, config=tile)
        taken = w4a16.one_token_kernel(n, k)  # w4a16_matmul's kernel for one token here
        fns[f"w4a16_matmul (takes {taken})"] = lambda: w4a16.w4a16_matmul(x, qweight, scales)
        for rows, warps in VARIANTS:
            y = torch.full((1, n), float("nan"), dtype=torch.bfloat16, device="cuda")

            def call(rows=rows, warps=warps, y=y):
                w4a16.launch_cuda_gemv(x, qweight, scales, 128, y, rows=rows, warps=warps)

            call()
            name = f"CUDA w4a16 ROWS={rows} WARPS={warps}" + (
                " (default)" if (rows, warps) == w4a16.cuda_variant(n) and taken == "gemv" else "")
            admit(fns, name, call, y, want, 2e-2)
        reference = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
        w4a16.launch_cuda_gemv(x, qweight, scales, 128, reference)
        for rows, consumers, stages in BULK_VARIANTS:
            if not w4a16.bulk_kernel_fits(x, qweight, scales, 128, rows=rows, consumers=consumers, stages=stages):
                continue
            y = torch.full((1, n), float("nan"), dtype=torch.bfloat16, device="cuda")

            def call(rows=rows, consumers=consumers, stages=stages, y=y):
                w4a16.launch_bulk_gemv(x, qweight, scales, y, rows=rows, consumers=consumers, stages=stages)

            call()
            name = f"CUDA w4a16 bulk ROWS={rows} CONSUMERS={consumers} STAGES={stages}" + (
                " (default)" if (rows, consumers, stages) == (2, 4, 4) and taken == "bulk" else "")
            if torch.equal(y, reference):  # the same sums in the same order as w4a16_gemv.cu
                fns[name] = call
            else:
                print(f"  {name}: WRONG, not w4a16_gemv.cu's bits, max error "
                      f"{(y.double() - want).abs().nan_to_num(1e9).max().item():.3g}")
        nbytes = qweight.numel() + scales.numel() * 2 + (k + n) * 2
        ceilings(fns, nbytes, stream, sink, blocks)
        print(f"W4A16 batch 1, W {n} x {k} ({nbytes / 1e6:.1f} MB packed; bf16 {n * k * 2 / 1e6:.1f} MB)")
        report(median_ms(fns, ROUNDS, sleep_cycles=1_000_000), nbytes, copy_gbps)
        packed = [w4a16_inputs(n, k)[1:] for _ in range(GRAPHED)]
        dense = [torch.randn(n, k, device="cuda").bfloat16() for _ in range(GRAPHED)]
        graphed = {f"w4a16_matmul (takes {taken})": lambda: [w4a16.w4a16_matmul(x, q, s) for q, s in packed],
                   "kforge bf16 gemv": lambda: [gemv(x, d) for d in dense],
                   "cuBLAS bf16": lambda: [torch.nn.functional.linear(x, d) for d in dense]}
        report_graphed(graphed, nbytes, copy_gbps, "packed")


def sweep_w4a16_batch(copy_gbps, stream, sink, blocks):
    for n, k in BATCH_SHAPES:
        for batch in BATCHES:
            _, qweight, scales = w4a16_inputs(n, k)
            x = torch.randn(batch, k, device="cuda").bfloat16()
            w = dequantize_int4(qweight, scales, 128)
            want = torch.nn.functional.linear(x.double(), w.double())
            triton_tile = {"path": "mma", **w4a16.MMA_CONFIGS[0]}
            fns = {"cuBLAS bf16 (F.linear on the dequantized W)": lambda: torch.nn.functional.linear(x, w),
                   "Triton w4a16 mma + split sum": lambda: w4a16.w4a16_matmul(x, qweight, scales,
                                                                               config=triton_tile),
                   "w4a16_matmul (its default path)": lambda: w4a16.w4a16_matmul(x, qweight, scales)}
            for m_tiles, k_warps, x_ahead in MMA_VARIANTS[-(-batch // 8)]:
                if w4a16.mma_shared_bytes(m_tiles, -(-batch // 8), k_warps) > w4a16.MMA_SHARED_LIMIT:
                    continue
                y = torch.full((batch, n), float("nan"), dtype=torch.bfloat16, device="cuda")

                def call(m_tiles=m_tiles, k_warps=k_warps, x_ahead=x_ahead, y=y):
                    w4a16.launch_cuda_mma(x, qweight, scales, 128, y, m_tiles=m_tiles, k_warps=k_warps,
                                          x_ahead=bool(x_ahead))

                call()
                name = f"CUDA w4a16_mma MT={m_tiles} KW={k_warps} XPF={x_ahead}" + (
                    " (default)" if (m_tiles, k_warps, x_ahead) == w4a16.mma_variant(n, batch)[:3] else "")
                admit(fns, name, call, y, want, 2e-2)
            nbytes = qweight.numel() + scales.numel() * 2 + (k + n) * 2 * batch
            ceilings(fns, nbytes, stream, sink, blocks)
            print(f"W4A16 batch {batch}, W {n} x {k} ({nbytes / 1e6:.1f} MB packed)")
            report(median_ms(fns, ROUNDS // 2, sleep_cycles=1_000_000), nbytes, copy_gbps)


def sweep_nvfp4(copy_gbps, stream, sink, blocks):
    for m, k, batches in NVFP4_SHAPES:
        a, a_scales, a_gs = quantize_nvfp4(torch.randn(batches, m, k, device="cuda"))
        b, b_scales, b_gs = quantize_nvfp4(torch.randn(batches, 1, k, device="cuda") / k**0.5)
        operands = (a, a_scales, a_gs, b, b_scales, b_gs)
        want = nvfp4_gemv.nvfp4_gemv_reference(*operands).double()
        fns = {}
        for config in nvfp4_gemv.CONFIGS[:1] + nvfp4_gemv.CONFIGS[3:4]:  # the two best measured
            tile = dict(config.kwargs, num_warps=config.num_warps)
            fns[f"Triton {tile}"] = lambda tile=tile: nvfp4_gemv.nvfp4_batched_gemv(*operands, config=tile)
        for rows, warps in VARIANTS:
            c = torch.full((batches, m, 1), float("nan"), dtype=torch.float16, device="cuda")

            def call(rows=rows, warps=warps, c=c):
                nvfp4_gemv.launch_cuda_gemv(*operands, c, rows=rows, warps=warps)

            call()
            name = f"CUDA nvfp4 ROWS={rows} WARPS={warps}" + (
                " (default)" if (rows, warps) == nvfp4_gemv.cuda_variant(k) else "")
            admit(fns, name, call, c, want, 2e-3)
        nbytes = nvfp4_gemv.nvfp4_gemv_min_bytes(m, k, batches)
        ceilings(fns, nbytes, stream, sink, blocks)
        print(f"NVFP4 batched GEMV M={m} K={k} L={batches} ({nbytes / 1e6:.1f} MB)")
        report(median_ms(fns, ROUNDS // 2, sleep_cycles=1_000_000), nbytes, copy_gbps)


def copy_bandwidth_gbps():
    src = torch.randn(2**28 // 4, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / median_ms({"copy": lambda: dst.copy_(src)}, 50)["copy"] / 1e6


def main():
    copy_gbps = copy_bandwidth_gbps()
    print(f"copy of 256 MiB: {copy_gbps:,.0f} GB/s")
    stream = CudaKernel.from_file(Path(__file__).with_name("read_stream.cu"), "read_stream")
    sink = torch.zeros(1, dtype=torch.int32, device="cuda")
    blocks = 8 * torch.cuda.get_device_properties(0).multi_processor_count
    groups = sys.argv[1:] or ["nvfp4", "w4a16"]
    if "nvfp4" in groups:
        sweep_nvfp4(copy_gbps, stream, sink, blocks)
    if "w4a16" in groups:
        sweep_w4a16(copy_gbps, stream, sink, blocks)
    if "w4a16-batch" in groups:
        sweep_w4a16_batch(copy_gbps, stream, sink, blocks)


if __name__ == "__main__":
    main()

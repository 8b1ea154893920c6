"""The FP8 weight-only GEMV on the GPU, kernel by kernel, at the Llama-3-8B widths.

    PYTHONPATH=src python scripts/fp8_gemv_sweep.py [BATCH ...]      (default: 1 2 4 8 16)

For each (N, K) and batch, `fp8_gemv.cu` in every (MT, KW, XPF, MINB) variant below, the Triton
fallback, the path it replaces in the engine (x quantized per 1 x 128 tile, then `fp8_gemm`) and
the bf16 GEMV on the dequantized W are checked against float64 first (a wrong one is reported and
not timed), then timed as quant_gemv_sweep.py times the 4-bit GEMVs: after a reading L2 flush,
interleaved, medians of CUDA event times, beside a read-only stream of the same bytes
(`read_stream.cu`) and an empty launch. % of copy is on the fp8 bytes (codes, scales, x, y)
against a copy measured in the same run. At batch 1 the default kernel and the bf16 GEMV also
run as a decode step runs them: eight calls on eight weights back to back in one CUDA graph.
"""

import kforge  # noqa: F401  (before triton)
import sys
from pathlib import Path

import torch

from device_timing import median_ms
from kforge import ops
from kforge.kernels.quant import fp8_gemv
from kforge.kernels.quant.formats import dequantize_fp8, quantize_fp8_blockwise
from kforge.kernels.serving.gemv import gemv
from kforge.runtime.cuda import CudaKernel
from quant_gemv_sweep import GRAPHED, ROUNDS, admit, ceilings, copy_bandwidth_gbps, report, report_graphed

SHAPES = [(4096, 4096), (6144, 4096), (14336, 4096), (28672, 4096), (4096, 14336)]  # (N, K)
# (MT, KW, XPF, MINB); MINB is the blocks an SM ptxas is asked to fit (3 caps 8 warps at 85 registers)
VARIANTS = [(1, 8, 0, 3), (1, 8, 1, 2), (1, 8, 1, 1), (1, 4, 0, 5), (1, 4, 1, 4), (1, 16, 0, 1), (1, 16, 1, 1),
            (2, 4, 0, 3), (2, 8, 0, 1), (2, 4, 1, 2), (1, 2, 1, 6)]


def fp8_weight(n, k):
    return quantize_fp8_blockwise(torch.randn(n, k, device="cuda") / k**0.5, (128, 128))


def sweep(copy_gbps, stream, sink, blocks, batches):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for n, k in SHAPES:
        q, scale = fp8_weight(n, k)
        w = dequantize_fp8(q, scale, (128, 128))
        w16 = w.bfloat16()
        for batch in batches:
            x = torch.randn(batch, k, device="cuda").bfloat16()
            want = x.double() @ w.double().T

            def gemm_path():
                a, a_scale = ops.quantize_fp8(x, "block", block=(1, 128))
                return ops.fp8_gemm(a, q, a_scale, scale, scaling="block")

            tile = fp8_gemv.triton_tile(batch, None, False)
            fns = {"kforge bf16 gemv on the dequantized W (2x the bytes)": lambda: gemv(x, w16),
                   "quantize x + fp8_gemm (the engine's path before the GEMV)": gemm_path,
                   f"Triton fp8_gemv_kernel {tile}": lambda: fp8_gemv.fp8_gemv(x, q, scale, config=tile)}
            for m_tiles, k_warps, x_ahead, min_blocks in VARIANTS:
                if fp8_gemv.cuda_shared_bytes(m_tiles, -(-batch // 8), k_warps) > fp8_gemv.CUDA_SHARED_LIMIT:
                    continue
                y = torch.full((batch, n), float("nan"), dtype=torch.bfloat16, device="cuda")

                def call(m_tiles=m_tiles, k_warps=k_warps, x_ahead=x_ahead, min_blocks=min_blocks, y=y):
                    fp8_gemv.launch_cuda_gemv(x, q, scale, y, m_tiles=m_tiles, k_warps=k_warps,
                                              x_ahead=bool(x_ahead), min_blocks=min_blocks)

                call()
                default = (m_tiles, k_warps, bool(x_ahead), min_blocks) == fp8_gemv.cuda_variant(n, batch, sms)
                name = f"CUDA fp8_gemv MT={m_tiles} KW={k_warps} XPF={x_ahead} MINB={min_blocks}" + (
                    " (default)" if default else "")
                admit(fns, name, call, y, want, 2e-2)
            nbytes = fp8_gemv.fp8_gemv_min_bytes(batch, n, k)
            ceilings(fns, nbytes, stream, sink, blocks)
            print(f"FP8 GEMV batch {batch}, W {n} x {k} ({nbytes / 1e6:.1f} MB; bf16 {n * k * 2 / 1e6:.1f} MB)")
            report(median_ms(fns, ROUNDS // 2, sleep_cycles=1_000_000), nbytes, copy_gbps)
            if batch == 1:
                graphed_calls(x, n, k, nbytes, copy_gbps)


def graphed_calls(x, n, k, nbytes, copy_gbps):
    weights = [fp8_weight(n, k) for _ in range(GRAPHED)]
    dense = [torch.randn(n, k, device="cuda").bfloat16() for _ in range(GRAPHED)]
    out = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
    graphed = {"CUDA fp8_gemv (default)": lambda: [fp8_gemv.launch_cuda_gemv(x, q, s, out) for q, s in weights],
               "kforge bf16 gemv": lambda: [gemv(x, d) for d in dense]}
    report_graphed(graphed, nbytes, copy_gbps, "fp8")


def main():
    copy_gbps = copy_bandwidth_gbps()
    print(f"copy of 256 MiB: {copy_gbps:,.0f} GB/s")
    stream = CudaKernel.from_file(Path(__file__).with_name("read_stream.cu"), "read_stream")
    sink = torch.zeros(1, dtype=torch.int32, device="cuda")
    blocks = 8 * torch.cuda.get_device_properties(0).multi_processor_count
    sweep(copy_gbps, stream, sink, blocks, [int(b) for b in sys.argv[1:]] or [1, 2, 4, 8, 16])


if __name__ == "__main__":
    main()

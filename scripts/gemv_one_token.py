"""The quantized GEMVs at one token as a decode step runs them: eight calls on eight weights in one
CUDA graph, the time per call, at the Llama-3-8B widths.

    PYTHONPATH=src python scripts/gemv_one_token.py [w4a16|fp8|both]

W4A16: the kernel `w4a16_matmul` picks (`one_token_kernel`) and `w4a16_mma.cu` in its (MT, KW,
XPF, DEPTH) variants. FP8: `fp8_gemv.cu` in its (MT, KW, XPF, MINB) variants. Beside them a
read-only stream of the same bytes (`read_stream.cu`), graphed the same way: the best a one-pass reader of those bytes
does between other kernels. Each variant is checked against float64 first (a wrong one is
reported and not timed). Medians of 40 rounds after a reading L2 flush (`device_timing`).
"""

import kforge  # noqa: F401  (before triton)
import sys
from pathlib import Path

import numpy as np
import torch

from device_timing import median_ms
from kforge.kernels.quant import fp8_gemv, w4a16
from kforge.kernels.quant.formats import dequantize_int4, quantize_fp8_blockwise
from kforge.runtime.cuda import CudaKernel
from quant_gemv_sweep import w4a16_inputs

GRAPHED = 8
SHAPES = [(4096, 4096), (6144, 4096), (14336, 4096), (4096, 14336), (28672, 4096)]  # (N, K)
MMA_VARIANTS = [(m, k, x, d) for m, k, x in [(1, 4, 0), (1, 4, 1), (1, 8, 0), (1, 8, 1), (1, 16, 0), (2, 4, 1),
                                             (2, 2, 1), (2, 8, 1), (1, 2, 0)] for d in (2, 3, 4)]
# (MT, KW, XPF, MINB): MINB the most blocks an SM each build fits without spills
FP8_VARIANTS = [(1, 8, 0, 3), (1, 8, 0, 4), (1, 8, 1, 2), (1, 4, 0, 5), (1, 4, 1, 4), (1, 2, 1, 6), (1, 2, 0, 8)]


def graphed(calls):
    calls()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    return graph.replay


def report(fns, nbytes):
    for name, ms in sorted(median_ms({k: graphed(v) for k, v in fns.items()}, 40).items(), key=lambda i: i[1]):
        us = ms * 1e3 / GRAPHED
        print(f"  {us:7.2f} us  {nbytes / us / 1e3:6.0f} GB/s  {name}", flush=True)


def read_streams(nbytes):
    stream = CudaKernel.from_file(Path(__file__).with_name("read_stream.cu"), "read_stream")
    sink = torch.zeros(1, dtype=torch.int32, device="cuda")
    blocks = 8 * torch.cuda.get_device_properties(0).multi_processor_count
    buffers = [torch.empty(nbytes // 16 * 16, dtype=torch.uint8, device="cuda") for _ in range(GRAPHED)]
    return lambda: [stream.launch(blocks, 256, (b, np.int64(b.numel() // 16), sink)) for b in buffers]


def sweep_w4a16(n, k):
    weights = [w4a16_inputs(n, k) for _ in range(GRAPHED)]
    x = weights[0][0]
    nbytes = weights[0][1].numel() + weights[0][2].numel() * 2
    want = torch.nn.functional.linear(x.double(), dequantize_int4(weights[0][1], weights[0][2], 128).double())
    fns = {"read stream": read_streams(nbytes),
           f"w4a16_matmul (takes {w4a16.one_token_kernel(n, k)})": lambda: [
               w4a16.launch_w4a16(x, q, s, 128, None) for _, q, s in weights]}
    for m_tiles, k_warps, x_ahead, depth in MMA_VARIANTS:
        ys = [torch.full((1, n), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(GRAPHED)]
        variant = dict(m_tiles=m_tiles, k_warps=k_warps, x_ahead=bool(x_ahead), depth=depth)
        name = f"w4a16_mma.cu MT={m_tiles} KW={k_warps} XPF={x_ahead} DEPTH={depth}"
        w4a16.launch_cuda_mma(x, weights[0][1], weights[0][2], 128, ys[0], **variant)
        if not torch.allclose(ys[0].double(), want, atol=2e-2, rtol=2e-2):
            print(f"  {name}: WRONG")
            continue
        fns[name] = lambda ys=ys, variant=variant: [w4a16.launch_cuda_mma(x, q, s, 128, y, **variant)
                                                     for (_, q, s), y in zip(weights, ys)]
    print(f"W4A16 1 token {n} x {k} ({nbytes / 1e6:.1f} MB)")
    report(fns, nbytes)


def sweep_fp8(n, k):
    x = torch.randn(1, k, device="cuda").bfloat16()
    weights = [quantize_fp8_blockwise(torch.randn(n, k, device="cuda") * 0.02, (128, 128)) for _ in range(GRAPHED)]
    nbytes = weights[0][0].numel() + weights[0][1].numel() * 4
    want = fp8_gemv.fp8_gemv_reference(x, *weights[0]).double()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    fns = {"read stream": read_streams(nbytes)}
    for m_tiles, k_warps, x_ahead, min_blocks in FP8_VARIANTS:
        ys = [torch.empty(1, n, dtype=torch.bfloat16, device="cuda") for _ in range(GRAPHED)]
        variant = dict(m_tiles=m_tiles, k_warps=k_warps, x_ahead=bool(x_ahead), min_blocks=min_blocks)
        default = (m_tiles, k_warps, bool(x_ahead), min_blocks) == fp8_gemv.cuda_variant(n, 1, sms)
        name = f"fp8_gemv.cu MT={m_tiles} KW={k_warps} XPF={x_ahead} MINB={min_blocks}" + (" (default)" * default)
        fp8_gemv.launch_cuda_gemv(x, *weights[0], ys[0], **variant)
        if not torch.allclose(ys[0].double(), want, atol=2e-2, rtol=2e-2):
            print(f"  {name}: WRONG")
            continue
        fns[name] = lambda ys=ys, variant=variant: [fp8_gemv.launch_cuda_gemv(x, q, s, y, **variant)
                                                     for (q, s), y in zip(weights, ys)]
    print(f"FP8 1 token {n} x {k} ({nbytes / 1e6:.1f} MB)")
    report(fns, nbytes)


def main():
    which = sys.argv[1] if len(sys.argv) > 1 else "both"
    if which not in ("w4a16", "fp8", "both"):
        sys.exit(f"gemv_one_token: w4a16, fp8 or both, got {which!r}")
    for n, k in SHAPES:
        if which in ("w4a16", "both"):
            sweep_w4a16(n, k)
        if which in ("fp8", "both"):
            sweep_fp8(n, k)


if __name__ == "__main__":
    main()

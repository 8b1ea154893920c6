"""The decode GEMV's tiles at batch 1, one by one, on the GPU: which keeps HBM busiest?

    PYTHONPATH=src python scripts/gemv_sweep.py

For each weight shape, every tile below (the autotuner's CUDA-core and tensor-core lists,
plus deeper pipelines) and the one-token CUDA kernel (`gemv_rows.cu`, "rows kernel"; off
in kforge by default until measured; also its CHUNK x WARPS variants) are checked against
F.linear, then timed after a reading L2 flush (as the timing engine does), interleaved with
cuBLAS, 200 rounds, medians of CUDA event times; prints us and % of a copy's bandwidth
measured in the same run. Three ceilings sit among them: a read-only stream of W's bytes
(`read_stream.cu`), a copy of the same bytes, and an empty launch. Then the CUDA kernel,
cuBLAS and the read stream again as a decode step runs them: eight calls on eight weights
back to back in one CUDA graph, per call (no launch or event gap between them).
"""

import kforge  # noqa: F401  (before triton)
from pathlib import Path

import numpy as np
import torch
import triton

from device_timing import median_ms
from kforge.kernels.serving import gemv as gemv_module
from kforge.kernels.serving.gemv import gemv
from kforge.runtime.cuda import CudaKernel

TILES = [dict(BLOCK_N=8, BLOCK_K=bk, USE_DOT=False, num_warps=w, num_stages=s)
         for bk, w in ((256, 1), (512, 2), (1024, 4), (2048, 8)) for s in (1, 2, 3)]
TILES += [dict(BLOCK_N=bn, BLOCK_K=bk, USE_DOT=True, num_warps=w, num_stages=s)
          for bn, bk, w, s in ((16, 256, 4, 4), (16, 256, 4, 6), (16, 512, 4, 3), (16, 512, 4, 4), (32, 256, 4, 4),
                               (16, 128, 2, 6), (16, 128, 2, 8), (64, 128, 4, 4), (32, 128, 4, 6))]

ROUNDS = 200
GRAPHED = 8  # calls in the back-to-back graph
ROWS_VARIANTS = [(4, 4), (8, 8), (16, 4)]  # (CHUNK, WARPS) beside the default (4, 8)


def time_us(fns, rounds=200):
    """Median device microseconds per function (device_timing.median_ms, a 1M-cycle sleep)."""
    return {name: ms * 1e3 for name, ms in median_ms(fns, rounds, sleep_cycles=1_000_000).items()}


def main():
    src = torch.randn(2**28 // 4, device="cuda")
    dst = torch.empty_like(src)
    copy_gbps = 2 * src.numel() * 4 / time_us({"copy": lambda: dst.copy_(src)}, 50)["copy"] / 1e3
    print(f"copy of 256 MiB: {copy_gbps:,.0f} GB/s")
    stream = CudaKernel.from_file(Path(__file__).with_name("read_stream.cu"), "read_stream")
    sink = torch.zeros(1, dtype=torch.int32, device="cuda")
    blocks = 8 * torch.cuda.get_device_properties(0).multi_processor_count  # 2048 threads an SM
    for n, k in ((4096, 4096), (6144, 4096), (14336, 4096), (28672, 4096), (4096, 14336)):
        x, w = torch.randn(1, k, device="cuda").bfloat16(), (torch.randn(n, k, device="cuda") / k**0.5).bfloat16()
        want = torch.nn.functional.linear(x.float(), w.float())
        fns = {"cuBLAS": lambda: torch.nn.functional.linear(x, w), "kforge gemv()": lambda: gemv(x, w)}
        for tile in TILES:
            name = " ".join(f"{key}={value}" for key, value in tile.items())
            try:
                got = gemv(x, w, config=tile)
            except Exception as error:  # a tile this shape or compiler refuses
                print(f"  {name}: {type(error).__name__}")
                continue
            if not torch.allclose(got.float(), want, atol=2e-2, rtol=2e-2):
                print(f"  {name}: WRONG")
                continue
            fns[name] = lambda tile=tile: gemv(x, w, config=tile)
        y = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
        gemv_module.launch_rows_kernel(x, w, y)
        if torch.allclose(y.float(), want, atol=2e-2, rtol=2e-2):
            fns["rows kernel"] = lambda y=y: gemv_module.launch_rows_kernel(x, w, y)
        else:
            print("  rows kernel: WRONG")
        for chunk, warps in ROWS_VARIANTS:
            kernel = CudaKernel.from_file(gemv_module.ROWS_SOURCE, "gemv_bf16", defines=dict(CHUNK=chunk, WARPS=warps))
            launch = kernel.lean(triton.cdiv(n, warps), 32 * warps, 0,
                                 kinds=("ptr", "ptr", "ptr", "i32", "i32", "i32", "ptr"))
            out = torch.full_like(y, float("nan"))

            def call(launch=launch, out=out):
                launch(torch._C._cuda_getCurrentRawStream(0), w.data_ptr(), x.data_ptr(), out.data_ptr(), n, k // 8,
                       k // 8, 0)  # no residual: the plain build

            call()
            name = f"rows kernel CHUNK={chunk} WARPS={warps}"
            if torch.allclose(out.float(), want, atol=2e-2, rtol=2e-2):
                fns[name] = call
            else:
                print(f"  {name}: WRONG")
        nbytes = (n * k + k + n) * 2
        # the ceilings of one launch moving these bytes: read once, copied (half read, half written),
        # and an empty launch (the fixed cost every call pays under this timing)
        fns["ceiling: read stream of the same bytes"] = lambda w=w: stream.launch(
            blocks, 256, (w, np.int64(w.numel() * 2 // 16), sink))
        half = torch.empty(nbytes // 4, dtype=torch.int16, device="cuda"), torch.empty(nbytes // 4, dtype=torch.int16,
                                                                                      device="cuda")
        fns["ceiling: copy of the same bytes"] = lambda half=half: half[1].copy_(half[0])
        fns["ceiling: empty launch"] = lambda: stream.launch(1, 256, (w, np.int64(0), sink))
        print(f"W {n} x {k} ({nbytes / 1e6:.1f} MB)")
        times = time_us(fns, ROUNDS)
        # the floor of one launch under this timing: the empty launch, then the bytes at the copy rate
        times["floor: empty launch + the bytes at copy bandwidth"] = times["ceiling: empty launch"] + \
            nbytes / copy_gbps / 1e3
        for name, us in sorted(times.items(), key=lambda item: item[1]):
            print(f"  {us:7.1f} us  {100 * nbytes / us / 1e3 / copy_gbps:5.1f}% of copy  {name}")
        # As a decode step runs them: GRAPHED calls back to back in one CUDA graph, each on its own
        # weight (GRAPHED x W is more than L2 holds), timed over the replay; per call.
        weights = [w] + [torch.randn_like(w) for _ in range(GRAPHED - 1)]
        outs = [torch.empty(1, n, dtype=torch.bfloat16, device="cuda") for _ in weights]
        graphed = {"rows kernel": lambda wi, yi: gemv_module.launch_rows_kernel(x, wi, yi),
                   "cuBLAS": lambda wi, yi: torch.matmul(x, wi.t(), out=yi),
                   "ceiling: read stream": lambda wi, yi: stream.launch(blocks, 256,
                                                                       (wi, np.int64(wi.numel() * 2 // 16), sink))}
        replays = {}
        for name, one in graphed.items():
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for wi, yi in zip(weights, outs):
                    one(wi, yi)
            replays[name] = graph.replay
        print(f"  {GRAPHED} calls back to back in one CUDA graph, per call:")
        for name, us in sorted(time_us(replays, ROUNDS // 4).items(), key=lambda item: item[1]):
            per_call = us / GRAPHED
            print(f"  {per_call:7.1f} us  {100 * nbytes / per_call / 1e3 / copy_gbps:5.1f}% of copy  {name} (graph)")
        del weights, outs, replays


if __name__ == "__main__":
    main()

"""Decode attention at batch 1 as a llama3-8b step runs it: which partitioning, one launch or two?

    PYTHONPATH=src python scripts/paged_decode_sweep.py

The step profile (decode_profile.py) puts paged decode attention at 8.5 us a layer for a
512-token context whose K and V are 2 MB (0.5 us at copy speed): latency, not bytes. Here
32 calls (one a layer, each on its own cache: 64 MB, past L2) are captured in one CUDA
graph per variant, as the step runs them, and timed after an L2 flush: partition sizes and
tile heights (BLOCK_N) against plan_decode's default, each with the partials reduced in a
second kernel and in kernel 1 (fused_reduce). Contexts 512 and 2048, in a block table of
4096 tokens (the graph's shape is the table's, the length is data). Prints us a call.
Measured on the H200: benchmarks/results/nvidia-h200/paged-decode-sweep.txt.
"""

import kforge  # noqa: F401  (before triton)

import torch

from device_timing import median_ms
from kforge.kernels.serving.paged_decode import paged_decode, plan_decode, reduce_counters

LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM, PAGE = 32, 8, 32, 128, 16
TABLE_TOKENS = 4096
# (BLOCK_N, partition size[, num_stages]); None: plan_decode's choice (at batch 1, one 128-token tile
# a partition). A program walks partition / BLOCK_N tiles one after another: at batch 1 each costs
# latency, not bytes. With one tile a program, fewer stages leave shared memory for more programs an SM.
PARTITIONS = [None, (64, 64), (64, 128), (128, 128), (128, 128, 2), (128, 128, 1), (64, 256), (128, 256), (64, 512)]


def graphed(calls):
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return graph.replay


def main():
    pages = TABLE_TOKENS // PAGE
    caches = [(torch.randn(pages, KV_HEADS, PAGE, HEAD_DIM, device="cuda", dtype=torch.bfloat16),
               torch.randn(pages, KV_HEADS, PAGE, HEAD_DIM, device="cuda", dtype=torch.bfloat16)) for _ in range(LAYERS)]
    q = torch.randn(1, Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    table = torch.randperm(pages, device="cuda", dtype=torch.int32)[None]
    reduce_counters(q.device, KV_HEADS)  # before any capture
    default = plan_decode(1, KV_HEADS, TABLE_TOKENS, HEAD_DIM, 2, torch.cuda.get_device_properties(0).multi_processor_count)
    print(f"plan_decode's default at a {TABLE_TOKENS}-token table: partitions of {default.partition_size} tokens, "
          f"BLOCK_N {default.block_n}")
    for context in (512, 2048):
        lens = torch.tensor([context], device="cuda", dtype=torch.int32)
        want = paged_decode(q, *caches[0], table, lens, validate=False, fused_reduce=False)
        fns = {}
        for tiling in PARTITIONS:
            for fused in (False, True):
                config = None if tiling is None else {"BLOCK_N": tiling[0], "partition_size": tiling[1],
                                                      **({"num_stages": tiling[2]} if len(tiling) > 2 else {})}
                got = paged_decode(q, *caches[0], table, lens, validate=False, config=config, fused_reduce=fused)
                error = (got.float() - want.float()).abs().max().item()
                shape = "default" if tiling is None else f"{tiling[1]} by {tiling[0]}" + (
                    f" s{tiling[2]}" if len(tiling) > 2 else "")
                name = f"{shape:>13} {'one launch' if fused else 'two'}"
                if error > 2e-2:
                    print(f"  {name}: wrong (max error {error:.3g}), not timed")
                    continue
                fns[name] = graphed([lambda k=k, v=v, c=config, f=fused: paged_decode(
                    q, k, v, table, lens, validate=False, config=c, fused_reduce=f) for k, v in caches])
        times = median_ms(fns, 100)
        print(f"context {context}: us a call (median of 100 replays of {LAYERS} calls)")
        for name, ms in times.items():
            print(f"  partition {name:<24} {ms * 1e3 / LAYERS:6.2f}")


if __name__ == "__main__":
    main()

"""Session 18 (one-off): where w4a16_gemv_bulk.cu's 2.2 us over its own feed go. The lab build with
TIMELINE (w4a16-gemv-bulk-knobs.patch) writes %globaltimer at each block's start, when x is ready,
when the producer has issued each stage's copies, when consumer warp 0 sees the stage arrive and
when it has computed it, and at each block's end: for the committed code, with FEED_ONLY
(consumers computing nothing), and a group of knob builds (w4a16-gemv-bulk-knobs.patch): `copies`,
ROWS_PER_COPY (n rows' codes a copy, the stage's scales in one); `x-loads`, the timing-only
NO_X_LOADS (x kept in registers) and X_BROADCAST (x's loads kept, their bytes cut to a quarter);
`tail`, LAST_EARLY (each block's last tile copied into a spare slot after the ring's first fill)
beside 5 plain stages (the same shared memory).
Then the same builds without TIMELINE, timed as the other A/Bs time them. On the committed tree:

    PYTHONPATH=src:scripts python benchmarks/notes/2026-11-26-session18/bulk_timeline.py copies|x-loads|tail

Each call runs as the A/Bs time them (a reading L2 flush, a GPU sleep, events around the call);
20 calls a build, and each statistic is the median over those calls of its median (or extreme)
over the blocks. Times in us from the first block's start.
"""

import lab  # noqa: I001  (first: builds the lab tree, measures the copy bandwidth)
import statistics
import sys

import numpy as np
import torch

from device_timing import _flush
from kforge.kernels.quant import w4a16
from kforge.runtime.cuda import CudaKernel
from quant_gemv_sweep import w4a16_inputs

SLOTS, CALLS, ROWS, CONSUMERS, STAGES = 100, 20, 2, 4, 4


GROUPS = {"copies": {"8 rows a copy": {"ROWS_PER_COPY": 8}, "4 rows a copy": {"ROWS_PER_COPY": 4},
                     "2 rows a copy": {"ROWS_PER_COPY": 2}, "1 row a copy, scales in 1": {"ROWS_PER_COPY": 1}},
          "x-loads": {"NO_X_LOADS (timing)": {"NO_X_LOADS": 1}, "X_BROADCAST (timing)": {"X_BROADCAST": 1}},
          "tail": {"LAST_EARLY": {"LAST_EARLY": 1}, "5 stages": {"STAGES": 5},
                   "LAST_EARLY, 3 stages": {"LAST_EARLY": 1, "STAGES": 3}}}
BUILDS = {"committed": {}, "FEED_ONLY": {"FEED_ONLY": 1}, **GROUPS[sys.argv[1] if len(sys.argv) > 1 else "copies"]}


def build(defines):
    return CudaKernel.from_file(lab.LAB / "quant/w4a16_gemv_bulk.cu", "w4a16_gemv_bulk",
                                defines={"ROWS": ROWS, "CONSUMERS": CONSUMERS, "STAGES": STAGES, **defines})


def shared_bytes(k, defines):  # the ring's slots, and LAST_EARLY's spare
    return w4a16.bulk_shared_bytes(k, ROWS, CONSUMERS, defines.get("STAGES", STAGES) + defines.get("LAST_EARLY", 0))


def timelines(x, q, s, defines):
    n, k = q.shape[0], x.shape[1]
    kernel = build({"TIMELINE": 1, **defines})
    smem = shared_bytes(k, defines)
    grid = min(-(-n // (ROWS * CONSUMERS)), kernel.max_active_clusters(32 * (CONSUMERS + 1), 1, smem, 0))
    launch = kernel.lean(grid, 32 * (CONSUMERS + 1), 0, kinds=w4a16.BULK_KINDS + ("ptr",), shared_bytes=smem)
    y = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
    marks = torch.zeros(grid * SLOTS, dtype=torch.int64, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    runs = []
    for call in range(CALLS + 3):
        marks.zero_()
        _flush()
        torch.cuda._sleep(1_000_000)
        start.record()
        launch(torch._C._cuda_getCurrentRawStream(0), q.data_ptr(), s.data_ptr(), x.data_ptr(), y.data_ptr(), n, k,
               marks.data_ptr())
        end.record()
        end.synchronize()
        if call >= 3:  # (warm-up)
            runs.append((start.elapsed_time(end) * 1e3, marks.view(grid, SLOTS).cpu().numpy().astype(np.float64)))
    if not {"FEED_ONLY", "NO_X_LOADS", "X_BROADCAST"} & set(defines):  # (the timing-only knobs)
        want = torch.empty_like(y)
        w4a16.launch_cuda_gemv(x, q, s, 128, want)
        assert torch.equal(y, want), f"{defines}: the committed kernel's bits"
    return runs


def stats(event_us, t):
    """One call's statistics from its [blocks, SLOTS] globaltimer marks (ns)."""
    t0 = t[:, 0].min()
    rel = (t - t0) / 1e3
    tiles = (t[:, 4::3] > 0).sum(axis=1)  # ring positions a block used (< 32)
    issued, seen, done = rel[:, 4::3], rel[:, 5::3], rel[:, 6::3]
    waits, computes, refills, latencies = [], [], [], []
    for b in range(t.shape[0]):
        m = int(tiles[b])
        computes += list(done[b, :m] - seen[b, :m])
        waits += list(seen[b, 1:m] - done[b, :m - 1])
        refills += list(issued[b, STAGES:m] - done[b, :m - STAGES])
        latencies += list(seen[b, STAGES:m] - issued[b, STAGES:m])
    ends = rel[:, 2]
    return {"event time": event_us, "last block starts": rel[:, 0].max(), "x ready (median)": np.median(rel[:, 1]),
            "first stage seen (median)": np.median(seen[:, 0]), "consumers end, first": ends.min(),
            "consumers end, median": np.median(ends), "consumers end, last": ends.max(),
            "stages a block, max": tiles.max(), "stage computed (median)": np.median(computes),
            "wait for a stage after the last (median)": np.median(waits),
            "wait for a stage, summed a block (median)": np.median([
                (seen[b, 1:int(tiles[b])] - done[b, :int(tiles[b]) - 1]).sum() for b in range(t.shape[0])]),
            "last stage seen, median block": np.median([seen[b, int(tiles[b]) - 1] for b in range(t.shape[0])]),
            "last stage seen, last block": max(seen[b, int(tiles[b]) - 1] for b in range(t.shape[0])),
            "end - last stage seen (median)": np.median([ends[b] - seen[b, int(tiles[b]) - 1]
                                                         for b in range(t.shape[0])]),
            "refill issued after warp 0 freed it (median)": np.median(refills),
            "issued -> seen, steady state (median)": np.median(latencies)}


for n, k in [(28672, 4096), (14336, 4096)]:
    x, q, s = w4a16_inputs(n, k)
    table = {}
    for name, defines in BUILDS.items():
        per_call = [stats(us, t) for us, t in timelines(x, q, s, defines)]
        table[name] = {key: statistics.median(c[key] for c in per_call) for key in per_call[0]}
    print(f"W4A16 N={n} K={k}: w4a16_gemv_bulk.cu (ROWS {ROWS}, CONSUMERS {CONSUMERS}, STAGES {STAGES}), TIMELINE builds, us")
    print(f"  {'':44s}" + "".join(f" {name[:12]:>12s}" for name in BUILDS))
    for key in table["committed"]:
        print(f"  {key:44s}" + "".join(f" {table[name][key]:12.2f}" for name in BUILDS))
    fns = {}
    for name, defines in BUILDS.items():
        y = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
        fns[name] = lab.bulk_launch(build(defines), 32 * (CONSUMERS + 1), shared_bytes(k, defines), ROWS * CONSUMERS,
                                    x, q, s, y)
    nbytes = q.numel() + s.numel() * 2 + (k + n) * 2
    lab.add_read_stream(fns, nbytes)
    lab.timed(f"W4A16 N={n} K={k}, the same builds without TIMELINE", fns, nbytes)

"""What session 18's A/B scripts share: lab builds of committed kernels with this folder's knob
patches applied (in a temporary copy, never in the tree), the read stream and the bulk kernel's
feed as floors, and the timing loop (device_timing.median_ms: a reading L2 flush and a GPU sleep
before every call, interleaved rounds, medians), repeated three times in one process.

Knob patches (each built with its knobs off is the committed code):
- w4a16-gemv-bulk-knobs.patch, in w4a16_gemv_bulk.cu: FEED_ONLY (timing only: consumers free each
  stage without computing), COPY_SPLIT (a row's codes in n copies), ROWS_PER_COPY (n rows' codes a
  copy, a stage's scales in one), LAST_EARLY (a block's last tile copied into a spare slot early),
  TIMELINE (%globaltimer marks, bulk_timeline.py), and the timing-only NO_X_LOADS and X_BROADCAST;
- nvfp4-gemv-l2-prefetch.patch, read-stream-l2-prefetch.patch: L2_PREFETCH (128 or 256: the
  loads' L2 prefetch-size hint) in nvfp4_gemv.cu and scripts/read_stream.cu.
"""

import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch

from device_timing import median_ms
from kforge.kernels.quant import w4a16
from kforge.runtime.cuda import CudaKernel
from quant_gemv_sweep import copy_bandwidth_gbps

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
ROUNDS, REPEATS = 200, 3
PATCHES = ("w4a16-gemv-bulk-knobs.patch", "nvfp4-gemv-l2-prefetch.patch", "read-stream-l2-prefetch.patch")


def _lab_tree() -> Path:
    """A temporary copy of src/kforge/kernels and scripts/read_stream.cu at their repository paths,
    the knob patches applied."""
    root = Path(tempfile.mkdtemp())
    shutil.copytree(REPO / "src/kforge/kernels", root / "src/kforge/kernels")
    (root / "scripts").mkdir()
    shutil.copy(REPO / "scripts/read_stream.cu", root / "scripts/read_stream.cu")
    for patch in PATCHES:
        subprocess.run(["git", "apply", str(HERE / patch)], cwd=root, check=True)
    return root


LAB_ROOT = _lab_tree()
LAB = LAB_ROOT / "src/kforge/kernels"  # the kernels folder, knobs in
COPY_GBPS = copy_bandwidth_gbps()
print(f"copy of 256 MiB: {COPY_GBPS:,.0f} GB/s")
_SINK = torch.zeros(1, dtype=torch.int32, device="cuda")
_STREAMS = {}


def add_read_stream(fns: dict, nbytes: int, hint: int = 0) -> None:
    """The read stream over a buffer of `nbytes`, with the L2 prefetch hint `hint` (0: none)."""
    if hint not in _STREAMS:
        _STREAMS[hint] = CudaKernel.from_file(LAB_ROOT / "scripts/read_stream.cu", "read_stream",
                                              defines={"L2_PREFETCH": hint})
    words = np.int64(nbytes // 16)
    buf = torch.empty(int(words) * 16, dtype=torch.uint8, device="cuda")
    fns[f"read stream{f' L2::{hint}B' if hint else ''}"] = lambda k=_STREAMS[hint]: k.launch(
        8 * 132, 256, (buf, words, _SINK))


def bulk_launch(kernel, threads: int, smem: int, tile_rows: int, x, q, s, y):
    """A call of a one-token W4A16 kernel with the bulk kernel's arguments, on a persistent grid."""
    n, k = q.shape[0], x.shape[1]
    grid = min(-(-n // tile_rows), kernel.max_active_clusters(threads, 1, smem, 0))
    launch = kernel.lean(grid, threads, 0, kinds=w4a16.BULK_KINDS, shared_bytes=smem)
    return lambda: launch(torch._C._cuda_getCurrentRawStream(0), q.data_ptr(), s.data_ptr(), x.data_ptr(),
                          y.data_ptr(), n, k)


def bulk_feed_launch(x, q, s, defines: dict | None = None):
    """TIMING ONLY: w4a16_gemv_bulk.cu (2 rows, 4 consumers, 4 stages) with FEED_ONLY: its feed alone."""
    kernel = CudaKernel.from_file(LAB / "quant/w4a16_gemv_bulk.cu", "w4a16_gemv_bulk",
                                  defines={"ROWS": 2, "CONSUMERS": 4, "STAGES": 4, "FEED_ONLY": 1, **(defines or {})})
    y = torch.empty(1, q.shape[0], dtype=torch.bfloat16, device="cuda")
    return bulk_launch(kernel, 160, w4a16.bulk_shared_bytes(x.shape[1], 2, 4, 4), 8, x, q, s, y)


def timed(title: str, fns: dict, nbytes: int, baseline: str | None = None) -> None:
    """Print each call's three medians (us), % of copy on the best, and x `baseline` if named."""
    print(f"{title} ({nbytes / 1e6:.1f} MB)")
    reps = [median_ms(fns, ROUNDS, sleep_cycles=1_000_000) for _ in range(REPEATS)]
    base = min(r[baseline] for r in reps) if baseline else None
    for name in sorted(fns, key=lambda nm: reps[0][nm]):
        us = [r[name] * 1e3 for r in reps]
        ratio = f"  {base * 1e3 / min(us):5.2f}x cuBLAS" if base else ""
        print(f"  {' '.join(f'{u:6.2f}' for u in us)} us  {100 * nbytes / min(us) / 1e3 / COPY_GBPS:5.1f}% of copy"
              f"{ratio}  {name}")


def w4a16_exact(x, q, s):
    """float64 x @ (q * s).T for group 128."""
    from kforge.kernels.quant.formats import unpack_int4

    return x.double() @ (unpack_int4(q).double() * s.double().repeat_interleave(128, dim=1)).T


def add_checked(fns: dict, name: str, call, y, exact) -> None:
    """Run `call` once into NaN-poisoned `y`; time it only if max |y - exact| / max |exact| < 2^-7."""
    y.fill_(float("nan"))
    call()
    torch.cuda.synchronize()
    err = ((y.double() - exact).abs().max() / exact.abs().max()).item()
    print(f"  {name}: max |y - exact| / max |exact| = {err:.2e}")
    if np.isfinite(err) and err < 2**-7:
        fns[name] = call


CUBLAS = "cuBLAS bf16 (F.linear on the dequantized W)"


def w4a16_baselines(n: int, k: int):
    """One token's operands at N x K (quant_gemv_sweep.w4a16_inputs), their float64 product, and the
    calls every W4A16 A/B times beside its builds: cuBLAS's bf16 GEMV on the dequantized W and the
    committed one-token kernels (checked)."""
    from kforge.kernels.quant.formats import dequantize_int4
    from quant_gemv_sweep import w4a16_inputs

    x, q, s = w4a16_inputs(n, k)
    w = dequantize_int4(q, s, 128)
    exact = w4a16_exact(x, q, s)
    fns = {CUBLAS: lambda: torch.nn.functional.linear(x, w)}
    y = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
    add_checked(fns, "committed w4a16_gemv.cu", lambda: w4a16.launch_cuda_gemv(x, q, s, 128, y), y, exact)
    y2 = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
    add_checked(fns, "committed w4a16_gemv_bulk.cu", lambda: w4a16.launch_bulk_gemv(x, q, s, y2), y2, exact)
    return x, q, s, exact, fns

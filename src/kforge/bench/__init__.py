"""`kforge bench`: a list of (problem, candidates) pairs, each pair one `evaluate()`.

A family (`gemm.py`, `attention.py`) lists its shapes and the methods timed on each; the
problem's reference is the library baseline (cuBLAS for GEMM, SDPA's flash backend for
attention), timed interleaved with every method in the same evaluation, so each ratio
compares two timings taken side by side. One EvalRecord per evaluation goes to the
results file; the table and the chart are drawn from those records (`--replot` redraws
them anywhere). This module holds what the families share: rows, geomean, the chart.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kforge.errors import KforgeError
from kforge.harness.candidate import Candidate


@dataclass(frozen=True)
class BenchJob:
    label: str  # what the progress line shows
    problem: object  # a loaded kforge.harness.problem.Problem, sized
    candidate: Candidate
    baseline: str = "eager"  # what the problem's reference runs as: eager, or torch.compile of it


def run_bench(jobs: Iterable[BenchJob], *, time_budget: float, results: Path | None, command: str | None = None,
              on_step: Callable[[str], None] | None = None) -> list[dict]:
    """Evaluate every job on this GPU; append each record to `results` as it lands."""
    from kforge.device import current_device
    from kforge.harness.evaluate import evaluate
    from kforge.harness.record import append_record
    from kforge.harness.roofline import get_ceilings
    from kforge.harness.timing import TimingConfig
    from kforge.ladder import require_gpu

    require_gpu()
    device = current_device("cuda")
    ceilings = get_ceilings(device)
    records = []
    for job in jobs:
        if on_step:
            on_step(job.label)
        record = evaluate(job.problem, job.candidate, baseline=job.baseline, device=device, ceilings=ceilings,
                          timing=TimingConfig(budget_s=time_budget), command=command)
        if results is not None:
            append_record(results, record)
        records.append(record.to_dict())
    return records


def run_in_process(shapes: Sequence, measure: Callable, *, bench: str, step: str, results: Path | None,
                   command: str | None, on_step: Callable[[str], None] | None = None,
                   fields: Callable[[object], dict] = lambda shape: {}) -> list[dict]:
    """One record a shape for the benches whose calls cannot go through `evaluate()` (a backward
    needs its forward's graph; a layer timed by stage): `measure(shape, device)` returns the
    figures, timed in this process on this GPU. Each record is appended to `results` as it lands;
    a shape that raises is recorded as an error (its first line and the traceback) and the next
    one runs."""
    import datetime
    import traceback

    import torch

    from kforge.device import current_device, library_versions
    from kforge.harness.record import append_record
    from kforge.ladder import require_gpu

    require_gpu()
    device = current_device("cuda")
    records = []
    for shape in shapes:
        if on_step:
            on_step(f"{shape.label}: {step}")
        record = {"bench": bench, "shape": shape.label, **fields(shape), "sizes": shape.sizes,
                  "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "command": command, "device": device.to_dict(), "versions": library_versions(), "status": "ok",
                  "reason": None}
        try:
            record.update(measure(shape, device))
        except Exception as exc:  # noqa: BLE001 - one shape's failure is recorded; the table still prints
            lines = str(exc).strip().splitlines()
            record.update(status="error", reason=f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300],
                          details=traceback.format_exc())
        finally:
            torch.cuda.empty_cache()
        if results is not None:
            append_record(results, record)
        records.append(record)
    return records


class OursRates:
    """TFLOP/s and GB/s of our device time, for a row with `flops`, `bytes` and `ours_device_ms`."""

    flops: float | None
    bytes: int | None
    ours_device_ms: float | None

    @property
    def tflops(self) -> float | None:
        return self.flops / self.ours_device_ms / 1e9 if self.flops and self.ours_device_ms else None

    @property
    def gbps(self) -> float | None:
        return self.bytes / self.ours_device_ms / 1e6 if self.bytes and self.ours_device_ms else None


@dataclass(frozen=True)
class BenchRow:
    shape: str
    tflops: dict[str, float | None]  # per method, and the baseline's (its median over the methods' runs)
    vs_baseline: dict[str, float | None]  # baseline time / method time, timed in the same evaluation
    status: dict[str, str]
    sizes: dict[str, int]  # the problem's size constants (M, N, K or B, H, N, D, ...)


def bench_rows(records: Sequence[dict], baseline: str, label: Callable[[dict], str]) -> list[BenchRow]:
    """One row per problem size, in the order first seen; the latest record per (size, method)."""
    latest: dict[tuple[str, str], dict] = {}
    order: list[str] = []
    for r in records:
        size = label(r)
        if size not in order:
            order.append(size)
        latest[(size, r["candidate"]["name"])] = r
    rows = []
    for size in order:
        tflops, ratios, status, lib, sizes = {}, {}, {}, [], {}
        for (s, method), r in latest.items():
            if s != size:
                continue
            sizes = size_constants(r)
            stats = (r.get("gate2") or {}).get("stats") or {}
            flops = (r.get("roofline") or {}).get("flops")
            ms = stats.get("candidate", {}).get("median_ms")
            ref_ms = stats.get("reference", {}).get("median_ms")
            tflops[method] = flops / ms / 1e9 if flops and ms else None
            ratios[method] = ref_ms / ms if ms and ref_ms else None
            status[method] = r["status"]
            if flops and ref_ms:
                lib.append(flops / ref_ms / 1e9)
        tflops[baseline] = sorted(lib)[len(lib) // 2] if lib else None
        rows.append(BenchRow(size, tflops, ratios, status, sizes))
    return rows


def size_constants(record: dict) -> dict[str, int]:
    """{"M": 16, ...} from a record's problem size "M=16,N=4096,K=4096"."""
    return {k: int(v) for k, v in (part.split("=") for part in record["problem"]["size"].split(",") if "=" in part)}


def geomean(values: Sequence[float]) -> float | None:
    values = [v for v in values if v]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def save_bench_chart(rows: Sequence[BenchRow], path: Path, *, title: str, baseline: str) -> Path:
    """Bars of speedup over the baseline per shape, one colour per method; 1.0 marked."""
    from kforge.views import pyplot, save_figure

    plt = pyplot()

    methods = sorted({m for r in rows for m in r.vs_baseline})
    if not methods:
        raise KforgeError("nothing to chart: no method was timed")
    fig, ax = plt.subplots(figsize=(max(8, 0.55 * len(rows) + 2), 5.5), dpi=120)
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        xs = [j + i * width for j in range(len(rows))]
        ax.bar(xs, [r.vs_baseline.get(method) or 0 for r in rows], width, label=method)
    ax.axhline(1.0, color="#c44e52", linestyle="--", linewidth=1.2)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))], [r.shape for r in rows], rotation=60, ha="right",
                  fontsize=7)
    ax.set_ylabel(f"speedup over {baseline} (same run, median, L2 flushed)")
    ax.set_title(title, fontsize=11)
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    return save_figure(fig, path)

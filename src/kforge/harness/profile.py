"""Nsight Compute on one call of a candidate: where its device time goes, as feedback.

    summary = profile_candidate(problem, candidate, gpu=0)    # a ProfileSummary, or a reason (str)
    lines = profile_lines(summary, ceilings)                   # what `kforge machine --profile` feeds back

The candidate runs in a process of its own (`profile_worker.py`: warm-up calls, then one call
inside the NVTX range `kforge_profile`), under `ncu` with the sections that say where a
kernel stands: SpeedOfLight (SM and DRAM throughput as % of peak), MemoryWorkloadAnalysis
(DRAM bytes), ComputeWorkloadAnalysis (pipe utilization, the tensor pipes among them) and
WarpStateStats (what warps wait on, in cycles per issued instruction). The report is read back
with `ncu --import --page raw --csv --print-units base`: one row per kernel, one column per
metric, numbers in bytes and nanoseconds. The clocks are left alone (`--clock-control none`),
as every other kforge measurement leaves them.

A profile decides nothing: the judge's gates decide, in processes the candidate does not share.
The profiled process runs the candidate's code, which could write anything, so what comes back
is a hint for the next turn, read as such: metrics this parser does not find are left out, a
run that fails is a one-line reason. Durations here are under the profiler (each kernel
replayed with the caches flushed), so they differ from gate 2's.
"""

from __future__ import annotations

import csv
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

RANGE = "kforge_profile"
SECTIONS = ("SpeedOfLight", "MemoryWorkloadAnalysis", "ComputeWorkloadAnalysis", "WarpStateStats")
TIMEOUT_S = 600.0
TOP_STALLS = 3
# metric columns of the raw page (Hopper, ncu 2025); each is optional
DURATION = "gpu__time_duration.sum"
DRAM_BYTES = ("dram__bytes_read.sum", "dram__bytes_write.sum")
DRAM_PCT = "dram__throughput.avg.pct_of_peak_sustained_elapsed"
SM_PCT = "sm__throughput.avg.pct_of_peak_sustained_elapsed"
TENSOR_PIPE = re.compile(r"^sm__(?:pipe_tensor\w*_cycles_active|inst_executed_pipe_tensor\w*)"
                         r"\.avg\.pct_of_peak_sustained_active$")
STALL = re.compile(r"^smsp__average_warps?_(?:latency_)?issue_stalled_(?P<reason>\w+?)(?:_per_issue_active)?\.ratio$")
NOT_STALLS = {"selected"}  # a warp picked to issue is not waiting
TIME_UNITS = {"nsecond": 1e-6, "ns": 1e-6, "usecond": 1e-3, "us": 1e-3, "msecond": 1.0, "ms": 1.0, "second": 1e3}
BYTE_UNITS = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12}


@dataclass(frozen=True)
class KernelProfile:
    name: str
    duration_ms: float | None
    dram_bytes: float | None
    dram_pct: float | None  # DRAM throughput, % of its peak
    sm_pct: float | None  # SM throughput, % of its peak
    tensor_pct: float | None  # the busiest tensor pipe, % of its peak while the SMs were active
    stalls: dict[str, float] = field(default_factory=dict)  # reason -> cycles per issued instruction


@dataclass(frozen=True)
class ProfileSummary:
    kernels: list[KernelProfile]

    @property
    def total_ms(self) -> float:
        return sum(k.duration_ms or 0.0 for k in self.kernels)

    @property
    def dram_gbps(self) -> float | None:
        """DRAM bytes of every kernel over their summed durations."""
        known = [k for k in self.kernels if k.dram_bytes is not None and k.duration_ms]
        seconds = sum(k.duration_ms for k in known) / 1e3
        return sum(k.dram_bytes for k in known) / seconds / 1e9 if known and seconds else None

    def top_stalls(self, count: int = TOP_STALLS) -> list[tuple[str, float]]:
        """The stall reasons with the most cycles per issued instruction, weighted by each kernel's duration."""
        weights: dict[str, float] = {}
        total = sum(k.duration_ms or 0.0 for k in self.kernels if k.stalls) or 1.0
        for k in self.kernels:
            for reason, value in k.stalls.items():
                weights[reason] = weights.get(reason, 0.0) + value * (k.duration_ms or 0.0) / total
        return sorted(weights.items(), key=lambda item: -item[1])[:count]

    def to_dict(self) -> dict:
        return {"kernels": [asdict(k) for k in self.kernels], "total_ms": self.total_ms, "dram_gbps": self.dram_gbps,
                "top_stalls": self.top_stalls()}


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))  # ncu may group thousands
    except ValueError:
        return None


def _scaled(row: dict, units: dict, name: str, scale: dict[str, float]) -> float | None:
    value = _number(row.get(name, ""))
    factor = scale.get(units.get(name, "").strip())
    return value * factor if value is not None and factor is not None else None


def parse_raw_csv(text: str) -> list[KernelProfile]:
    """The kernels of `ncu --import REPORT --page raw --csv`: a header row of metric names, a row
    of their units, then one row per profiled kernel. Lines before the header (ncu's own
    notices) are skipped; ValueError if there is no such table."""
    rows = list(csv.reader(io.StringIO(text)))
    start = next((i for i, r in enumerate(rows) if "Kernel Name" in r), None)
    if start is None or start + 1 >= len(rows):
        raise ValueError("no kernel table in the report (nothing ran inside the profiled range?)")
    header, unit_row = rows[start], rows[start + 1]
    units = dict(zip(header, unit_row))
    kernels = []
    for values in rows[start + 2:]:
        if len(values) != len(header):
            continue
        row = dict(zip(header, values))
        read_write = [_scaled(row, units, name, BYTE_UNITS) for name in DRAM_BYTES]
        tensor = [v for name in header if TENSOR_PIPE.match(name) and (v := _number(row[name])) is not None]
        stalls = {}
        for name in header:
            match = STALL.match(name)
            if match and match["reason"] not in NOT_STALLS and (value := _number(row[name])) is not None and value > 0:
                stalls[match["reason"].replace("_", " ")] = value
        kernels.append(KernelProfile(
            name=row["Kernel Name"], duration_ms=_scaled(row, units, DURATION, TIME_UNITS),
            dram_bytes=sum(read_write) if all(v is not None for v in read_write) else None,
            dram_pct=_number(row.get(DRAM_PCT, "")), sm_pct=_number(row.get(SM_PCT, "")),
            tensor_pct=max(tensor) if tensor else None, stalls=stalls))
    if not kernels:
        raise ValueError("the report's kernel table is empty")
    return kernels


def ncu_commands(ncu: str, report: Path, problem: Path, candidate: Path, *, size: str, seed: int
                 ) -> tuple[list[str], list[str]]:
    """The profiling run and the export of its report."""
    sections = [arg for name in SECTIONS for arg in ("--section", name)]
    # the sections alone left the DRAM byte counts out of the raw page on an H200 (2026-11-28):
    # ask for the parsed columns by name as well
    sections += ["--metrics", ",".join((DURATION, *DRAM_BYTES, DRAM_PCT, SM_PCT))]
    profile = [ncu, "--clock-control", "none", "--target-processes", "all", "--nvtx", "--nvtx-include", f"{RANGE}/",
               *sections, "--export", str(report), "--force-overwrite",
               sys.executable, "-m", "kforge.harness.profile_worker", str(problem), str(candidate),
               "--size", size, "--seed", str(seed)]
    export = [ncu, "--import", f"{report}.ncu-rep", "--page", "raw", "--csv", "--print-units", "base"]
    return profile, export


def profile_candidate(problem: str | Path, candidate: str | Path, *, gpu: int | None = None, size: str = "full",
                      seed: int = 0, timeout_s: float = TIMEOUT_S, ncu: str | None = None
                      ) -> ProfileSummary | str:
    """Profile one call of the candidate (module docstring): its summary, or why there is none."""
    import torch

    ncu = ncu or shutil.which("ncu")
    if ncu is None:
        return "Nsight Compute (ncu) is not on this machine's PATH"
    if not torch.cuda.is_available():
        return "no CUDA device: a profile needs a GPU"
    env = dict(os.environ)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    with tempfile.TemporaryDirectory(prefix="kforge-profile-") as scratch:
        report = Path(scratch) / "report"
        profile, export = ncu_commands(ncu, report, Path(problem).resolve(), Path(candidate).resolve(), size=size,
                                       seed=seed)
        try:
            ran = subprocess.run(profile, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=scratch)
            if ran.returncode != 0 or not Path(f"{report}.ncu-rep").is_file():
                return f"the profiling run failed (exit {ran.returncode}): {_last_line(ran.stderr or ran.stdout)}"
            read = subprocess.run(export, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=scratch)
        except subprocess.TimeoutExpired:
            return f"the profiling run took longer than {timeout_s:g} s"
        if read.returncode != 0:
            return f"reading the report failed: {_last_line(read.stderr or read.stdout)}"
        try:
            return ProfileSummary(parse_raw_csv(read.stdout))
        except ValueError as exc:
            return str(exc)


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"


def profile_lines(found: ProfileSummary | dict | str, copy_gbps: float | None = None, top: int = 3) -> list[str]:
    """The profile as feedback lines: the whole call, then its longest kernels. `found` is a
    summary, its to_dict(), or the reason there is none."""
    if isinstance(found, str):
        return [f"Profile: none ({found})."]
    data = found.to_dict() if isinstance(found, ProfileSummary) else found
    kernels = sorted(data["kernels"], key=lambda k: -(k.get("duration_ms") or 0.0))
    total = data["total_ms"] or 0.0
    head = f"Profile (Nsight Compute, one call after warm-up; a hint, it decides nothing): {len(kernels)} kernel(s)"
    head += f", {total:.3g} ms on the device"
    if data.get("dram_gbps") is not None:
        head += f"; DRAM {data['dram_gbps']:.3g} GB/s"
        if copy_gbps:
            head += f" ({100 * data['dram_gbps'] / copy_gbps:.0f}% of the measured copy bandwidth)"
    lines = [head + "."]
    for k in kernels[:top]:
        share = f" ({100 * k['duration_ms'] / total:.0f}%)" if total and k.get("duration_ms") else ""
        parts = [f"{label} {k[key]:.0f}%" for label, key in (("DRAM", "dram_pct"), ("SM", "sm_pct"),
                                                              ("tensor pipe", "tensor_pct")) if k.get(key) is not None]
        stalls = sorted(k.get("stalls", {}).items(), key=lambda item: -item[1])[:TOP_STALLS]
        text = f"- {_short_name(k['name'])}: {k['duration_ms']:.3g} ms{share}" if k.get("duration_ms") is not None \
            else f"- {_short_name(k['name'])}"
        if parts:
            text += "; " + ", ".join(parts) + " of peak"
        if stalls:
            text += "; warps wait on " + ", ".join(f"{reason} ({value:.2g})" for reason, value in stalls) + \
                    " cycles per issued instruction"
        lines.append(text + ".")
    if len(kernels) > top:
        lines.append(f"- and {len(kernels) - top} more kernel(s).")
    return lines


def _short_name(name: str, limit: int = 80) -> str:
    return name if len(name) <= limit else name[:limit - 3] + "..."

"""The yardstick: what % of the hardware's peak is a kernel at?

Two kinds of ceiling per device:
- measured: what the best library reaches here (a large device-to-device copy, counting
  bytes read plus written; a large cuBLAS matmul per dtype). `kforge roofline` measures
  them once, through the same timing engine as every evaluation, and caches them per
  device. "% of roof" is against these: 100% means "as fast as the vendor's own
  library runs the same kind of work".
- datasheet: the vendor's dense (no sparsity) peaks. They bound what is physically
  possible, so a time under the floor they give means the timer was fooled. Devices
  missing from the table are bounded by their measured ceilings times PHYSICS_SLACK.
  On a CPU nothing is flushed between calls, so data may stream from cache faster than
  any DRAM figure: there only the compute floor is a physical bound.

For a kernel that must do F flops and move B bytes, the floor is
max(F / compute_ceiling, B / bandwidth_ceiling); the larger term names the bound.
"""

from __future__ import annotations

import datetime as _dt
import json
import re
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kforge.device import DeviceInfo, cache_dir
from kforge.harness.timing import TimingConfig, time_interleaved

COMPUTE_DTYPES = ("fp32", "tf32", "fp16", "bf16", "fp8")
TORCH_TO_COMPUTE_DTYPE = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float8_e4m3fn: "fp8",
    torch.float8_e5m2: "fp8",
}
# A fp32 problem may legitimately run on tensor cores (split-TF32 keeps fp32 accuracy),
# so what physics allows it is the tf32 peak, not the CUDA-core fp32 peak.
PHYSICAL_UNIT = {"fp32": "tf32"}
# Unknown devices: how far above the measured ceilings we still believe a time.
PHYSICS_SLACK = 1.5


@dataclass(frozen=True)
class DatasheetPeaks:
    name: str
    tflops: dict[str, float]  # dense peaks per compute dtype
    bandwidth_gbps: float
    source: str


# Vendor datasheets, dense (sparsity figures halved), boost clocks.
DATASHEET = [
    (r"H100.*(SXM|HBM3)", DatasheetPeaks(
        "H100 SXM", {"fp32": 67, "tf32": 494.7, "fp16": 989.4, "bf16": 989.4, "fp8": 1978.9},
        3350, "NVIDIA H100 datasheet")),
    (r"H100.*PCIe", DatasheetPeaks(
        "H100 PCIe", {"fp32": 51.2, "tf32": 378, "fp16": 756, "bf16": 756, "fp8": 1513},
        2000, "NVIDIA H100 datasheet")),
    (r"H200", DatasheetPeaks(
        "H200 SXM", {"fp32": 67, "tf32": 494.7, "fp16": 989.4, "bf16": 989.4, "fp8": 1978.9},
        4800, "NVIDIA H200 datasheet")),
    (r"A100.*80GB", DatasheetPeaks(
        "A100 80GB", {"fp32": 19.5, "tf32": 156, "fp16": 312, "bf16": 312},
        2039, "NVIDIA A100 datasheet (SXM; PCIe 1935)")),
    (r"A100", DatasheetPeaks(
        "A100 40GB", {"fp32": 19.5, "tf32": 156, "fp16": 312, "bf16": 312},
        1555, "NVIDIA A100 datasheet")),
    (r"\bL4\b", DatasheetPeaks(
        "L4", {"fp32": 30.3, "tf32": 60, "fp16": 121, "bf16": 121, "fp8": 242},
        300, "NVIDIA L4 datasheet")),
    (r"\bA10\b", DatasheetPeaks(
        "A10", {"fp32": 31.2, "tf32": 62.5, "fp16": 125, "bf16": 125},
        600, "NVIDIA A10 datasheet")),
    (r"B200", DatasheetPeaks(
        "B200", {"tf32": 1100, "fp16": 2250, "bf16": 2250, "fp8": 4500},
        8000, "NVIDIA HGX B200 datasheet")),
]


def datasheet_for(device_name: str) -> DatasheetPeaks | None:
    for pattern, peaks in DATASHEET:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return peaks
    return None


@dataclass
class Ceilings:
    """Measured ceilings of one device, plus its datasheet peaks when known."""

    device: str
    kind: str
    copy_gbps: float
    matmul_tflops: dict[str, float]
    measured_on: str
    versions: dict[str, str | None] = field(default_factory=dict)
    method: dict[str, str] = field(default_factory=dict)

    @property
    def datasheet(self) -> DatasheetPeaks | None:
        return datasheet_for(self.device) if self.kind == "cuda" else None

    def physical_tflops(self, compute_dtype: str) -> float | None:
        unit = PHYSICAL_UNIT.get(compute_dtype, compute_dtype)
        sheet = self.datasheet
        if sheet and unit in sheet.tflops:
            return sheet.tflops[unit]
        measured = self.matmul_tflops.get(unit) or self.matmul_tflops.get(compute_dtype)
        return measured * PHYSICS_SLACK if measured else None

    def physical_gbps(self) -> float | None:
        if self.kind != "cuda":
            return None  # unflushed caches: no bandwidth figure bounds a CPU call
        sheet = self.datasheet
        return sheet.bandwidth_gbps if sheet else self.copy_gbps * PHYSICS_SLACK

    def to_dict(self) -> dict:
        out = asdict(self)
        sheet = self.datasheet
        out["datasheet"] = asdict(sheet) if sheet else None
        return out

    @classmethod
    def from_dict(cls, data: dict) -> Ceilings:
        return cls(
            device=data["device"],
            kind=data["kind"],
            copy_gbps=float(data["copy_gbps"]),
            matmul_tflops={k: float(v) for k, v in data["matmul_tflops"].items()},
            measured_on=data["measured_on"],
            versions=data.get("versions", {}),
            method=data.get("method", {}),
        )


@dataclass
class RooflinePoint:
    """Where one timed kernel stands against the ceilings."""

    time_ms: float
    tflops: float | None  # achieved
    gbps: float  # achieved, on the minimum bytes
    pct_of_roof: float | None  # measured floor time / time, in %
    pct_of_compute: float | None  # achieved / measured matmul rate, in %
    pct_of_bandwidth: float  # achieved / measured copy bandwidth, in %


@dataclass
class Roofline:
    flops: float | None
    bytes: int
    compute_dtype: str | None
    bound: str  # "compute" or "memory"
    floor_ms: float | None  # against the measured ceilings
    physical_floor_ms: float | None  # against datasheet peaks: nothing correct runs faster
    compute_tflops: float | None  # the measured ceiling used
    bandwidth_gbps: float

    def point(self, time_ms: float) -> RooflinePoint:
        seconds = time_ms * 1e-3
        tflops = self.flops / seconds / 1e12 if self.flops is not None else None
        gbps = self.bytes / seconds / 1e9
        return RooflinePoint(
            time_ms=time_ms,
            tflops=tflops,
            gbps=gbps,
            pct_of_roof=100 * self.floor_ms / time_ms if self.floor_ms else None,
            pct_of_compute=100 * tflops / self.compute_tflops if tflops is not None and self.compute_tflops else None,
            pct_of_bandwidth=100 * gbps / self.bandwidth_gbps,
        )

    def to_dict(self) -> dict:
        return asdict(self)


def roofline_for(flops: float | None, nbytes: int, compute_dtype: str | None, ceilings: Ceilings) -> Roofline:
    compute = ceilings.matmul_tflops.get(compute_dtype) if compute_dtype and flops is not None else None
    memory_s = nbytes / (ceilings.copy_gbps * 1e9)
    compute_s = flops / (compute * 1e12) if compute else 0.0
    physical_compute = ceilings.physical_tflops(compute_dtype) if compute_dtype and flops is not None else None
    physical_bandwidth = ceilings.physical_gbps()
    physical_s = max(
        nbytes / (physical_bandwidth * 1e9) if physical_bandwidth else 0.0,
        flops / (physical_compute * 1e12) if physical_compute else 0.0,
    )
    return Roofline(
        flops=flops,
        bytes=nbytes,
        compute_dtype=compute_dtype,
        bound="compute" if compute_s > memory_s else "memory",
        floor_ms=1e3 * max(memory_s, compute_s) if nbytes or compute_s else None,
        physical_floor_ms=1e3 * physical_s if physical_s > 0 else None,
        compute_tflops=compute,
        bandwidth_gbps=ceilings.copy_gbps,
    )


# --- measuring the ceilings -------------------------------------------------------------

# Sizes: big enough to reach steady state on an H100, small enough for a CPU.
GPU_COPY_BYTES = 1 << 30
CPU_COPY_BYTES = 64 << 20
GPU_MATMUL_N = 8192
CPU_MATMUL_N = 1024


def measure_ceilings(device: DeviceInfo, config: TimingConfig | None = None) -> Ceilings:
    """Measure copy bandwidth and matmul rates on `device` with the timing engine."""
    from kforge.device import library_versions

    config = config or TimingConfig(budget_s=5.0 if device.is_cuda else 2.0)
    dev = device.torch_device
    copy_bytes = GPU_COPY_BYTES if device.is_cuda else CPU_COPY_BYTES
    n = GPU_MATMUL_N if device.is_cuda else CPU_MATMUL_N
    generator = torch.Generator(device=dev)

    def copy_set(i: int) -> list[torch.Tensor]:
        generator.manual_seed(i)
        src = torch.rand(copy_bytes // 4, device=dev, generator=generator)
        return [src, torch.empty_like(src)]

    run = time_interleaved({"copy": lambda s: s[1].copy_(s[0])}, copy_set, device, config)
    copy_gbps = 2 * copy_bytes / (run.stats["copy"].median_ms * 1e-3) / 1e9

    dtypes = ["fp32", "tf32", "fp16", "bf16", "fp8"] if device.is_cuda else ["fp32", "bf16"]
    matmul_tflops = {}
    for name in dtypes:
        case = _matmul_case(name, n, device, generator)
        if case is None:
            continue
        make_set, fn, precision = case
        with _fp32_matmul_precision(precision):
            run = time_interleaved({name: fn}, make_set, device, config)
        matmul_tflops[name] = 2 * n**3 / (run.stats[name].median_ms * 1e-3) / 1e12

    return Ceilings(
        device=device.name,
        kind=device.kind,
        copy_gbps=copy_gbps,
        matmul_tflops=matmul_tflops,
        measured_on=_dt.date.today().isoformat(),
        versions=library_versions(),
        method={
            "copy": f"tensor.copy_ of {copy_bytes >> 20} MiB fp32, bytes read + written",
            "matmul": f"torch.mm {n}x{n}x{n} on standard normal inputs "
                      "(fp8: torch._scaled_mm e4m3, fast accumulation, bf16 out)",
            "timing": "kforge timing engine: L2 flushed, rotating inputs, median" if device.is_cuda
            else "kforge timing engine: host clock, median",
        },
    )


def _matmul_case(name: str, n: int, device: DeviceInfo, generator: torch.Generator):
    dev = device.torch_device
    if name == "fp8":
        if not device.is_cuda or torch.cuda.get_device_capability(dev) < (8, 9):
            return None
        e4m3 = torch.float8_e4m3fn
        one = torch.ones((), device=dev)

        def make_fp8(i: int):
            generator.manual_seed(i)
            a = torch.randn(n, n, device=dev, generator=generator).to(e4m3)
            b = torch.randn(n, n, device=dev, generator=generator).to(e4m3).t()  # column-major
            return [a, b]

        def scaled_mm(s):  # cuBLAS's fastest fp8 path: fast accumulation, bf16 out
            return torch._scaled_mm(s[0], s[1], one, one, out_dtype=torch.bfloat16, use_fast_accum=True)

        return make_fp8, scaled_mm, "highest"
    dtype = {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]

    def make(i: int):
        generator.manual_seed(i)
        # Normal inputs, as problems draw them: a GEMM's speed depends on its data (zeros or
        # uniform [0, 1) draw less power and run faster), so the ceiling must use the same.
        return [torch.randn(n, n, device=dev, generator=generator).to(dtype) for _ in range(2)]

    return make, lambda s: torch.mm(s[0], s[1]), "high" if name == "tf32" else "highest"


@contextmanager
def _fp32_matmul_precision(precision: str):
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


# --- the per-device cache ---------------------------------------------------------------


def ceilings_path(device: DeviceInfo) -> Path:
    return cache_dir() / "ceilings" / f"{device.slug}.json"


def load_ceilings(device: DeviceInfo) -> Ceilings | None:
    path = ceilings_path(device)
    if not path.is_file():
        return None
    try:
        return Ceilings.from_dict(json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError):
        return None  # a damaged cache is re-measured, not trusted


def save_ceilings(device: DeviceInfo, ceilings: Ceilings) -> Path:
    path = ceilings_path(device)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(ceilings.to_dict(), indent=2) + "\n")
    tmp.replace(path)
    return path


def get_ceilings(device: DeviceInfo, remeasure: bool = False) -> Ceilings:
    """The cached ceilings of `device`, measured first if there are none (or if asked)."""
    if not remeasure:
        cached = load_ceilings(device)
        if cached is not None:
            return cached
    ceilings = measure_ceilings(device)
    save_ceilings(device, ceilings)
    return ceilings

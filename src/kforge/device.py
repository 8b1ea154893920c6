"""What we are running on: the device every figure is measured on, and library versions.

CUDA is chosen at run time, never at import, so all of kforge imports on a machine
with no GPU.
"""

from __future__ import annotations

import functools
import os
import platform
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class DeviceInfo:
    kind: str  # "cuda" or "cpu"
    name: str
    index: int | None = None
    capability: str | None = None  # "9.0" on Hopper
    multiprocessors: int | None = None
    cache_bytes: int | None = None  # last-level cache: L2 on a GPU, L3 on a CPU
    memory_bytes: int | None = None

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.kind, self.index) if self.kind == "cuda" else torch.device("cpu")

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def slug(self) -> str:
        """A file-name-safe identity, e.g. 'nvidia-h100-80gb-hbm3'."""
        return name_slug(self.name) or self.kind

    def to_dict(self) -> dict:
        return asdict(self)


def name_slug(name: str) -> str:
    """A device name as a file-name-safe word: 'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def current_device(kind: str | None = None) -> DeviceInfo:
    """The device to evaluate on: the current CUDA device if there is one, else the CPU."""
    if kind is None:
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA was asked for but torch sees no CUDA device")
        index = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        return DeviceInfo(
            kind="cuda",
            name=props.name,
            index=index,
            capability=f"{props.major}.{props.minor}",
            multiprocessors=props.multi_processor_count,
            cache_bytes=getattr(props, "L2_cache_size", None),
            memory_bytes=props.total_memory,
        )
    if kind == "cpu":
        return DeviceInfo(
            kind="cpu",
            name=_cpu_name(),
            multiprocessors=os.cpu_count(),
            cache_bytes=_cpu_last_level_cache_bytes(),
            memory_bytes=_host_memory_bytes(),
        )
    raise ValueError(f"unknown device kind {kind!r} (expected 'cuda' or 'cpu')")


def sm_count(device: torch.device | int) -> int:
    """The SM count of a CUDA device (`torch.device` or index), read once per device: persistent
    grids launch a program an SM and split plans fill the SMs in waves, on every call."""
    if isinstance(device, torch.device):
        if device.type != "cuda":
            raise ValueError(f"sm_count needs a CUDA device, not {device}")
        device = torch.cuda.current_device() if device.index is None else device.index
    return _sm_count(device)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def library_versions() -> dict[str, str | None]:
    """Versions that change what a kernel or its reference does; stored in every record."""
    import numpy

    from kforge import __version__

    versions: dict[str, str | None] = {
        "kforge": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "numpy": numpy.__version__,
    }
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:
        versions["triton"] = None
    if torch.backends.cudnn.is_available():
        versions["cudnn"] = str(torch.backends.cudnn.version())
    return versions


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def _cpu_last_level_cache_bytes() -> int | None:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    best = None
    for size_file in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = size_file.read_text().strip()
        match = re.fullmatch(r"(\d+)([KMG]?)", text)
        if match:
            size = int(match.group(1)) * units.get(match.group(2), 1)
            best = size if best is None else max(best, size)
    return best


def _host_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def cache_dir() -> Path:
    """$KFORGE_CACHE_DIR, else $XDG_CACHE_HOME/kforge, else ~/.cache/kforge."""
    if os.environ.get("KFORGE_CACHE_DIR"):
        return Path(os.environ["KFORGE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kforge"

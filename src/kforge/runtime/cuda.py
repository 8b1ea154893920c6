"""CUDA C++ kernels from Python: compile with NVRTC, cache the cubin, launch on torch tensors.

    kernel = CudaKernel.from_file("sgemm.cu", "sgemm", defines={"BM": 128})
    kernel.launch(grid=(n // 128, m // 128), block=256, args=(a, b, c, m, n, k))

Why NVRTC (through cuda.core) and not torch's cpp_extension: a cold cpp_extension build
runs the host compiler and a linker and takes 25-90 s; NVRTC compiles one kernel in well
under a second, and compiles on a machine with no GPU at all (CI checks every `.cu` in
the package this way). The target is the device's architecture with the "a" suffix on
Hopper (`sm_90a`), without which wgmma and TMA instructions do not assemble.

Cubins are cached on disk under `<cache dir>/cubins/`, keyed by the source text, every
file it includes from its own folder, the options, the architecture and NVRTC's version:
a second run compiles nothing. Launches go on torch's current stream, so they are
ordered with torch's own work and timed by the same CUDA events.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import subprocess
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from kforge.device import cache_dir
from kforge.errors import KforgeError

DEFAULT_OPTIONS = ("-std=c++17", "-lineinfo")
_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)
_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_MAX_THREADS_PER_BLOCK = 1024
_DEFAULT_SHARED_LIMIT = 48 * 1024  # above this a kernel must opt in to dynamic shared memory


class CudaCompileError(KforgeError):
    """NVRTC rejected a source: `reason` names the first error's file and line, `details` is the log."""


class LaunchError(KforgeError):
    """A launch that cannot be right (a bad shape, grid or argument), refused before it runs."""


@dataclass(frozen=True)
class Resources:
    """What one compiled kernel costs per thread and per block (from ptxas and cuobjdump)."""

    registers: int
    shared_bytes: int  # static shared memory per block
    stack_bytes: int
    local_bytes: int
    spill_stores: int  # bytes
    spill_loads: int  # bytes


@dataclass(frozen=True)
class Cubin:
    """A compiled source: the cubin's bytes and how it was made."""

    source: Path
    arch: str
    options: tuple[str, ...]
    key: str  # the cache key: changes whenever anything that could change the code does
    code: bytes
    ptxas_log: str
    from_cache: bool = field(default=False, compare=False)


# --- compiling -------------------------------------------------------------------------


def compile_cuda(source: str | Path, *, arch: str | None = None, defines: Mapping[str, object] | None = None,
                 options: Sequence[str] = (), cache: bool = True) -> Cubin:
    """Compile a `.cu` file to a cubin for `arch` (default: the current GPU's), cached on disk.

    `defines` become `-DNAME=VALUE`; `options` are extra NVRTC options. The include path
    holds the source's own folder and the CUDA toolkit's headers (cudart's and CCCL's).
    Raises CudaCompileError with NVRTC's log when the source does not compile.
    """
    path = Path(source).resolve()
    if not path.is_file():
        raise KforgeError(f"no CUDA source at {path}")
    arch = arch or device_arch()
    all_options = (*DEFAULT_OPTIONS, *(f"-D{k}={v}" for k, v in sorted((defines or {}).items())), *options)
    key = _cache_key(path, arch, all_options)
    cached = cache_dir() / "cubins" / f"{path.stem}-{key[:24]}"
    if cache and cached.with_suffix(".cubin").is_file() and cached.with_suffix(".json").is_file():
        meta = json.loads(cached.with_suffix(".json").read_text())
        return Cubin(path, arch, all_options, key, cached.with_suffix(".cubin").read_bytes(),
                     meta["ptxas_log"], from_cache=True)

    code, log = _nvrtc_compile(path, arch, all_options)
    cubin = Cubin(path, arch, all_options, key, code, log)
    if cache:
        write_atomically(cached.with_suffix(".cubin"), code)
        write_atomically(cached.with_suffix(".json"),
                         json.dumps({"source": str(path), "arch": arch, "options": all_options,
                                     "nvrtc": nvrtc_version(), "ptxas_log": log}, indent=1).encode())
    return cubin


def _nvrtc_compile(path: Path, arch: str, options: tuple[str, ...]) -> tuple[bytes, str]:
    from cuda.core import Program, ProgramOptions

    includes = [str(path.parent), *cuda_include_dirs()]
    program_options = ProgramOptions(arch=arch, name=str(path), include_path=includes,
                                     ptxas_options=["-v"], **_as_program_options(options))
    log = io.StringIO()
    try:
        code = Program(path.read_text(), "c++", program_options).compile("cubin", logs=log)
    except Exception as exc:
        if type(exc).__name__ != "NVRTCError":  # cuda.core's compile error; its text holds the log
            raise
        text = str(exc)
        first = next((line.strip() for line in text.splitlines() if ": error" in line), None)
        reason = f"{path.name} does not compile: {_short_location(first, path)}" if first else \
            f"{path.name} does not compile: {text.strip().splitlines()[0] if text.strip() else type(exc).__name__}"
        raise CudaCompileError(reason, text) from None
    return bytes(code.code), log.getvalue().replace("\x00", "").strip()


def _as_program_options(options: Sequence[str]) -> dict:
    """NVRTC command-line options as cuda.core's ProgramOptions fields (the ones we use)."""
    fields: dict = {}
    for option in options:
        if option.startswith("-D"):
            name, _, value = option[2:].partition("=")
            fields.setdefault("define_macro", []).append((name, value) if value else name)
        elif option.startswith("-std="):
            fields["std"] = option[len("-std="):]
        elif option == "-lineinfo":
            fields["lineinfo"] = True
        elif option == "--use_fast_math":
            fields["use_fast_math"] = True
        elif option.startswith("-maxrregcount="):
            fields["max_register_count"] = int(option.split("=", 1)[1])
        elif option == "-default-device":  # unannotated functions (a kernel's lambdas) compile as __device__
            fields["device_as_default_execution_space"] = True
        else:
            raise KforgeError(f"unsupported NVRTC option {option!r}",
                              "Supported: -DNAME[=VALUE], -std=..., -lineinfo, --use_fast_math, -maxrregcount=N, -default-device.")
    return fields


def _short_location(line: str, path: Path) -> str:
    """'/abs/dir/k.cu(12): error: x' -> 'k.cu:12: error: x'."""
    match = re.match(r"(.+?)\((\d+)\): (.*)", line)
    if not match:
        return line
    return f"{Path(match.group(1)).name}:{match.group(2)}: {match.group(3)}"


def _cache_key(path: Path, arch: str, options: tuple[str, ...]) -> str:
    digest = hashlib.sha256()
    for part in (arch, "\0".join(options), nvrtc_version(), *cuda_include_dirs()):
        digest.update(part.encode() + b"\0")
    for source in source_files(path):
        digest.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    return digest.hexdigest()


def source_files(path: Path, seen: set[Path] | None = None) -> list[Path]:
    """`path` and every file it includes (transitively) from its own folder tree."""
    seen = set() if seen is None else seen
    if path in seen or not path.is_file():
        return []
    seen.add(path)
    found = [path]
    for name in _INCLUDE.findall(path.read_text()):
        found += source_files((path.parent / name).resolve(), seen)
    return found


def integer_defines(source: str | Path) -> dict[str, int]:
    """The integer macros a source defines (`#define X 8`, or a default under `#ifndef X`),
    its own before its includes', the first definition of a name winning, as the
    preprocessor's `#ifndef` guards make it: what a launcher needs to size its grid."""
    found: dict[str, int] = {}
    for path in source_files(Path(source).resolve()):
        for name, value in re.findall(r"^\s*#\s*define\s+(\w+)\s+(\d+)\b", path.read_text(), re.MULTILINE):
            found.setdefault(name, int(value))
    return found


def write_atomically(target: Path, data: bytes) -> None:
    """Write to a temporary file, then rename: a reader never sees half a cubin."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@cache
def nvrtc_version() -> str:
    from cuda.bindings import nvrtc

    _, major, minor = nvrtc.nvrtcVersion()
    return f"nvrtc {major}.{minor}"


@cache
def cuda_include_dirs() -> tuple[str, ...]:
    """The CUDA toolkit's header folders (cudart's, then CCCL's), where they can be found."""
    from cuda import pathfinder

    found = []
    for lib in ("cudart", "cccl"):
        try:
            folder = pathfinder.find_nvidia_header_directory(lib)
        except Exception:  # noqa: BLE001 - a missing toolkit only matters to sources that include it
            folder = None
        if folder:
            found.append(str(folder))
    return tuple(found)


def device_arch(index: int | None = None) -> str:
    """The NVRTC architecture of a CUDA device: sm_90a on Hopper (wgmma, TMA), else sm_XY."""
    import torch

    if not torch.cuda.is_available():
        raise KforgeError("no CUDA device: name an architecture (e.g. arch='sm_90a') to compile only")
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm_{major}{minor}" + ("a" if major >= 9 else "")


# --- resources (compile-only) ------------------------------------------------------------


def resources(cubin: Cubin) -> dict[str, Resources]:
    """Registers, shared memory, stack and spills of every kernel in a cubin.

    Read with cuobjdump (the copy Triton's wheel ships, else the one on PATH); spills
    come from ptxas's own report, which NVRTC returns with the cubin.
    """
    tool = _cuobjdump()
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin.code)
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    spills = _spills_per_kernel(cubin.ptxas_log)
    found = {}
    for name, fields in re.findall(r"Function ([^:\s]+):\s*\n\s*(.+)", text):
        values = dict(re.findall(r"([A-Z]+(?:\[\d+\])?):(\d+)", fields))
        stores, loads = spills.get(name, (0, 0))
        found[name] = Resources(registers=int(values.get("REG", 0)), shared_bytes=int(values.get("SHARED", 0)),
                                stack_bytes=int(values.get("STACK", 0)), local_bytes=int(values.get("LOCAL", 0)),
                                spill_stores=stores, spill_loads=loads)
    return found


def sass(cubin: Cubin) -> str:
    """The cubin's machine code as text (cuobjdump -sass): what the tests grep for HGMMA or UTMALDG."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin.code)
        f.flush()
        return subprocess.run([_cuobjdump(), "-sass", f.name], capture_output=True, text=True, check=True).stdout


_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);")


def sass_loop_instructions(code: str) -> list[list[str]]:
    """Each loop of `sass` text as its instructions (operands kept, predicates dropped): every
    instruction from a backward branch's target up to the branch."""
    lines = _SASS_LINE.findall(code)
    position = {int(address, 16): i for i, (address, _) in enumerate(lines)}
    loops = []
    for i, (address, text) in enumerate(lines):
        target = re.search(r"\bBRA\s+(?:`\()?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < int(address, 16):
            body = lines[position[int(target.group(1), 16)]:i]
            loops.append([re.sub(r"^@!?U?P\w+\s+", "", t).strip() for _, t in body])
    return loops


def sass_loops(code: str) -> list[list[str]]:
    """Each loop of `sass` text as its opcodes (with their modifiers, without predicates)."""
    return [[instruction.split()[0] for instruction in loop] for loop in sass_loop_instructions(code)]


def loop_opcodes(code: str) -> list[str]:
    """The opcodes of all the loops in `sass` text (`sass_loops`), one after another. What a
    kernel's steady state issues; the tests count them per value a loop consumes."""
    return [opcode for loop in sass_loops(code) for opcode in loop]


def _spills_per_kernel(log: str) -> dict[str, tuple[int, int]]:
    spills, current = {}, None
    for line in log.splitlines():
        entry = re.search(r"Function properties for (\S+)", line)
        if entry:
            current = entry.group(1)
        match = _PTXAS_SPILLS.search(line)
        if match and current:
            spills[current] = (int(match.group(1)), int(match.group(2)))
    return spills


@cache
def _cuobjdump() -> str:
    import shutil

    try:
        import triton

        bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        if bundled.is_file():
            return str(bundled)
    except ImportError:
        pass
    on_path = shutil.which("cuobjdump")
    if on_path is None:
        raise KforgeError("cuobjdump not found: install triton (its wheel ships one) or the CUDA toolkit")
    return on_path


# --- launching -------------------------------------------------------------------------


class CudaKernel:
    """One `__global__` function of a compiled source, launched on torch tensors."""

    def __init__(self, cubin: Cubin, name: str):
        self.cubin = cubin
        self.name = name
        self._loaded: dict[int, object] = {}  # per device index
        self._shared_allowed: dict[int, int] = {}  # dynamic shared memory opted in to, per device
        self._max_clusters: dict[tuple, int] = {}
        self._prepared: dict[tuple, Callable[..., None]] = {}

    @classmethod
    def from_file(cls, source: str | Path, name: str, *, defines: Mapping[str, object] | None = None,
                  options: Sequence[str] = (), arch: str | None = None) -> CudaKernel:
        return cls(compile_cuda(source, arch=arch, defines=defines, options=options), name)

    def launch(self, grid: int | Sequence[int], block: int | Sequence[int], args: Sequence, *,
               shared_bytes: int = 0, cluster: int | Sequence[int] | None = None) -> None:
        """Launch on torch's current stream of the device holding the tensor arguments.

        Tensors are passed as pointers (they must be CUDA tensors on one device), Python
        ints as 32-bit ints, floats as 32-bit floats; numpy scalars keep their own type;
        cuda.core tensor maps (`TensorMapDescriptor`) by value, for `__grid_constant__` parameters. `cluster`
        groups blocks into thread-block clusters (the grid must be a multiple of it).
        Everything is checked before the launch; the launch's own status is checked by
        cuda.core, and faults inside the kernel surface at the next synchronization.
        """
        import numpy as np
        import torch

        self._shape(grid, block, cluster)
        packed = []
        for position, arg in enumerate(args):
            if isinstance(arg, torch.Tensor):
                packed.append(arg.data_ptr())  # a Python int travels as a 64-bit pointer
            elif type(arg).__name__ == "TensorMapDescriptor":
                packed.append(arg)  # cuda.core copies its 128 bytes into the parameter buffer
            elif isinstance(arg, bool) or not isinstance(arg, (int, float, np.generic)):
                raise LaunchError(f"{self.name}: argument {position} is a {type(arg).__name__}; pass tensors, "
                                  "ints, floats, numpy scalars or tensor maps")
            elif isinstance(arg, int):
                if not -(2**31) <= arg < 2**31:
                    raise LaunchError(f"{self.name}: argument {position} = {arg} does not fit a 32-bit int; "
                                      "pass np.int64 for a 64-bit parameter")
                packed.append(np.int32(arg))
            elif isinstance(arg, float):
                packed.append(np.float32(arg))
            else:
                packed.append(arg)
        devices = {a.device for a in args if isinstance(a, torch.Tensor)}
        if any(d.type != "cuda" for d in devices) or len(devices) > 1:
            raise LaunchError(f"{self.name}: tensor arguments must all be on one CUDA device, got "
                              f"{sorted(str(d) for d in devices)}")
        if not torch.cuda.is_available():
            raise LaunchError(f"{self.name}: no CUDA device to launch on")
        index = devices.pop().index if devices else torch.cuda.current_device()
        self.prepare(grid, block, index, shared_bytes=shared_bytes, cluster=cluster)(*packed)

    def _shape(self, grid, block, cluster) -> tuple:
        grid, block = _dims(grid, "grid"), _dims(block, "block")
        if cluster is not None:
            cluster = _dims(cluster, "cluster")
            if any(g % c for g, c in zip(grid, cluster)):
                raise LaunchError(f"{self.name}: grid {grid} is not a whole number of clusters {cluster}")
        if block[0] * block[1] * block[2] > _MAX_THREADS_PER_BLOCK:
            raise LaunchError(f"{self.name}: block {block} has more than {_MAX_THREADS_PER_BLOCK} threads")
        return grid, block, cluster

    def prepare(self, grid: int | Sequence[int], block: int | Sequence[int], index: int, *, shared_bytes: int = 0,
                cluster: int | Sequence[int] | None = None) -> Callable[..., None]:
        """Check a launch's shape once and return a function that launches it on torch's
        current stream of device `index` with arguments already packed (ints for pointers,
        numpy scalars, tensor maps). `launch` goes through here; a hot path keeps the
        function and skips re-checking (a launch through `launch` costs ~50 us of Python)."""
        import torch
        from cuda.core import LaunchConfig, launch

        grid, block, cluster = self._shape(grid, block, cluster)
        key = (grid, block, index, shared_bytes, cluster)
        if key not in self._prepared:
            kernel = self._kernel(index, shared_bytes)
            if cluster is None:
                config = LaunchConfig(grid=grid, block=block, shmem_size=shared_bytes)
            else:  # cuda.core counts the grid in clusters when a cluster shape is given
                clusters = tuple(g // c for g, c in zip(grid, cluster))
                config = LaunchConfig(grid=clusters, cluster=cluster, block=block, shmem_size=shared_bytes)

            def go(*packed) -> None:
                launch(_stream(index, torch.cuda.current_stream(index).cuda_stream), config, kernel, *packed)

            self._prepared[key] = go
        return self._prepared[key]

    def lean(self, grid: int | Sequence[int], block: int | Sequence[int], index: int, *, kinds: Sequence[str],
             shared_bytes: int = 0, cluster: int | Sequence[int] | None = None):
        """A `driver.LeanLaunch` of this kernel on device `index`: the same checks as `prepare`,
        then every later call is a few ctypes calls (see `kforge.runtime.driver`)."""
        from cuda.bindings import driver
        from cuda.core import Device

        from kforge.runtime.driver import LeanLaunch, function_of

        grid, block, cluster = self._shape(grid, block, cluster)
        kernel = self._kernel(index, shared_bytes)
        handle = int(kernel.handle)
        if isinstance(kernel.handle, driver.CUkernel):
            Device(index).set_current()  # torch's primary context, current on this thread (a new thread has none)
            handle = function_of(handle)
        return LeanLaunch(handle, grid, block, shared_bytes, cluster, kinds)

    def max_active_clusters(self, block: int, cluster: int, shared_bytes: int, index: int) -> int:
        """How many clusters of `cluster` blocks can run at once on device `index` (the
        grid of a persistent kernel: more would run as a second wave)."""
        from cuda.core import Device, LaunchConfig

        key = (index, block, cluster, shared_bytes)
        if key not in self._max_clusters:
            config = LaunchConfig(grid=1, cluster=cluster, block=block, shmem_size=shared_bytes)
            self._max_clusters[key] = self._kernel(index, shared_bytes).occupancy.max_active_clusters(
                config, stream=Device(index).default_stream)
        return self._max_clusters[key]

    def _kernel(self, index: int, shared_bytes: int):
        from cuda.core import Device, ObjectCode

        kernel = self._loaded.get(index)
        if kernel is None:
            Device(index).set_current()  # torch's primary context: the one torch's tensors live in
            kernel = ObjectCode.from_cubin(self.cubin.code).get_kernel(self.name)
            self._loaded[index] = kernel
        if shared_bytes > max(_DEFAULT_SHARED_LIMIT, self._shared_allowed.get(index, 0)):
            _allow_dynamic_shared(kernel, shared_bytes, index)
            self._shared_allowed[index] = shared_bytes
        return kernel


def _allow_dynamic_shared(kernel, shared_bytes: int, index: int) -> None:
    """Opt a kernel in to more than 48 KB of dynamic shared memory (up to 227 KB on Hopper)."""
    from cuda.bindings import driver

    attribute = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    if isinstance(kernel.handle, driver.CUkernel):  # cuda.core loads cubins as libraries: a CUkernel
        (status,) = driver.cuKernelSetAttribute(attribute, shared_bytes, kernel.handle, driver.CUdevice(index))
    else:
        (status,) = driver.cuFuncSetAttribute(kernel.handle, attribute, shared_bytes)
    if status != driver.CUresult.CUDA_SUCCESS:
        raise LaunchError(f"cannot give the kernel {shared_bytes} bytes of shared memory: {status.name}")


def _dims(value: int | Sequence[int], what: str) -> tuple[int, int, int]:
    dims = (value,) if isinstance(value, int) else tuple(value)
    if not 1 <= len(dims) <= 3 or any(not isinstance(d, int) or d < 1 for d in dims):
        raise LaunchError(f"{what} must be 1 to 3 positive ints, got {value!r}")
    return (*dims, *(1,) * (3 - len(dims)))


class _TorchStream:
    """Hands a torch stream's handle to cuda.core (the __cuda_stream__ protocol)."""

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


_STREAMS: dict[tuple[int, int], object] = {}


def _stream(index: int, handle: int):
    """A cuda.core view of a torch stream (made once per stream: it costs a driver call)."""
    from cuda.core import LEGACY_DEFAULT_STREAM, Device

    key = (index, handle)
    if key not in _STREAMS:
        # torch's default stream is the legacy default stream, whose handle is 0
        _STREAMS[key] = LEGACY_DEFAULT_STREAM if handle == 0 else Device(index).create_stream(_TorchStream(handle))
    return _STREAMS[key]

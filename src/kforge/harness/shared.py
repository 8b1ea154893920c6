"""Memory the two workers share, and the plain-JSON descriptions that cross the pipes.

The reference worker owns one block of memory (the arena) and lends it to the
candidate's worker: on a GPU one CUDA allocation opened through CUDA IPC, on a CPU one
file (which the judge creates in its scratch folder) mapped by both. Every tensor that crosses between them is a view into the
arena at a known offset, described in JSON by a TensorSpec. Nothing the candidate's
process sends is unpickled or executed: a spec is numbers and a dtype name, and the
arena's bounds are checked before any view is made.

    inputs    the reference worker draws a fresh input set, keeps its own copy and a
              pristine one, and writes the candidate's copy into the input slots
    mailbox   the candidate's worker copies each output it returned into the mailbox
              (slots shaped like the reference's outputs); the reference worker reads
              them there and compares
"""

from __future__ import annotations

import base64
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

ALIGN = 256  # bytes: every view starts on a boundary any dtype (and a vectorized kernel) accepts

DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.complex64, torch.complex128, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
    torch.bool,
)}


class SharedError(Exception):
    """A description that does not fit the arena, or names what cannot be shared."""


@dataclass(frozen=True)
class TensorSpec:
    """A tensor as a view into the arena: `offset` bytes in, with its own shape and strides."""

    offset: int
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=DTYPES[self.dtype]).element_size()

    @property
    def extent(self) -> int:
        """Elements of storage the view reaches (0 for an empty tensor)."""
        if any(s == 0 for s in self.shape):
            return 0
        return 1 + sum((n - 1) * st for n, st in zip(self.shape, self.stride))

    @property
    def nbytes(self) -> int:
        return self.extent * self.itemsize

    def to_json(self) -> dict:
        return {"offset": self.offset, "dtype": self.dtype, "shape": list(self.shape), "stride": list(self.stride)}

    @classmethod
    def from_json(cls, value) -> TensorSpec:
        """Parse a spec from an untrusted message: every field type-checked."""
        if not isinstance(value, dict) or set(value) != {"offset", "dtype", "shape", "stride"}:
            raise SharedError(f"not a tensor spec: {value!r:.200}")
        shape, stride = value["shape"], value["stride"]
        if (not _ints(shape) or not _ints(stride) or len(shape) != len(stride) or not isinstance(value["offset"], int)
                or value["dtype"] not in DTYPES or value["offset"] < 0 or min(shape, default=0) < 0
                or min(stride, default=0) < 0):
            raise SharedError(f"malformed tensor spec: {value!r:.200}")
        return cls(value["offset"], value["dtype"], tuple(shape), tuple(stride))


def _ints(values) -> bool:
    return isinstance(values, list) and all(type(v) is int for v in values)


def _overlaps(t: torch.Tensor) -> bool:
    """Whether two elements of `t` share memory (an expanded view): such a view cannot be written."""
    dims = sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1)
    reach = 1
    for st, n in dims:
        if st < reach:
            return True
        reach = st * n
    return False


class Layout:
    """Places tensors in an arena, one aligned region each, keeping their strides."""

    def __init__(self) -> None:
        self.size = 0

    def place(self, like: torch.Tensor) -> TensorSpec:
        t = like.contiguous() if _overlaps(like) else like
        spec = TensorSpec(self.size, str(t.dtype).removeprefix("torch."), tuple(t.shape), tuple(t.stride()))
        if spec.dtype not in DTYPES:
            raise SharedError(f"tensors of {t.dtype} cannot cross between the workers")
        self.size += math.ceil(max(spec.nbytes, 1) / ALIGN) * ALIGN
        return spec


class Arena:
    """One block of bytes both workers map; `view(spec)` is a tensor inside it."""

    def __init__(self, buffer: torch.Tensor, handle: dict):
        self.buffer = buffer  # uint8, 1-D
        self.handle = handle  # what the other worker needs to open it (JSON)

    @classmethod
    def create(cls, nbytes: int, device: torch.device, path: Path) -> Arena:
        """The arena: on a GPU a fresh allocation; on a CPU the file at `path`, which the
        judge created empty (opened without following links, sized here)."""
        nbytes = max(nbytes, ALIGN)
        if device.type == "cuda":
            # CUDA IPC opens the allocator's whole segment: an emptied cache and a size in
            # its 2 MiB granules make the arena a segment of its own (docs/harness.md).
            torch.cuda.empty_cache()
            nbytes = math.ceil(nbytes / (2 << 20)) * (2 << 20)
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
            fields = buffer.untyped_storage()._share_cuda_()
            handle = {"kind": "cuda_ipc", "nbytes": nbytes,
                      "ipc": [base64.b64encode(f).decode() if isinstance(f, bytes) else f for f in fields],
                      "ipc_bytes": [isinstance(f, bytes) for f in fields]}
            return cls(buffer, handle)
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        buffer = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
        return cls(buffer, {"kind": "file", "nbytes": nbytes, "path": str(path)})

    @classmethod
    def open(cls, handle: dict, device: torch.device) -> Arena:
        """Map the arena the reference worker created (in the candidate's worker)."""
        nbytes = handle["nbytes"]
        if handle["kind"] == "cuda_ipc":
            fields = [base64.b64decode(f) if is_bytes else f for f, is_bytes in zip(handle["ipc"], handle["ipc_bytes"])]
            storage = torch.UntypedStorage._new_shared_cuda(*fields)
            buffer = torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (nbytes,), (1,))
        else:
            buffer = torch.from_file(handle["path"], shared=True, size=nbytes, dtype=torch.uint8)
        return cls(buffer, handle)

    def view(self, spec: TensorSpec) -> torch.Tensor:
        if spec.offset % ALIGN or spec.offset + spec.nbytes > self.buffer.numel():
            raise SharedError(f"a tensor spec reaches outside the shared memory: {spec}")
        dtype = DTYPES[spec.dtype]
        if spec.extent == 0:
            return torch.empty(spec.shape, dtype=dtype, device=self.buffer.device)
        flat = self.buffer[spec.offset:spec.offset + spec.nbytes].view(dtype)
        return flat.as_strided(spec.shape, spec.stride)


# --- argument lists and output structures as JSON ------------------------------------------

def describe(value, place) -> object:
    """JSON for an argument list or an output: tensors become {"tensor": spec} through
    `place(tensor) -> TensorSpec`; numbers, strings, None and dtypes go as they are."""
    if isinstance(value, torch.Tensor):
        return {"tensor": place(value).to_json()}
    if isinstance(value, (list, tuple)):
        return {type(value).__name__: [describe(v, place) for v in value]}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    raise SharedError(f"a value of type {type(value).__name__} cannot cross between the workers "
                      "(tensors, numbers, strings, None, dtypes and lists or tuples of them can)")


def rebuild(value, arena: Arena) -> object:
    """The values `describe` described, tensors as views into `arena`."""
    if not isinstance(value, dict) or len(value) != 1:
        raise SharedError(f"not a described value: {value!r:.200}")
    (kind, body), = value.items()
    if kind == "tensor":
        return arena.view(TensorSpec.from_json(body))
    if kind in ("list", "tuple") and isinstance(body, list):
        items = [rebuild(v, arena) for v in body]
        return items if kind == "list" else tuple(items)
    if kind == "dtype" and body in DTYPES:
        return DTYPES[body]
    if kind == "value" and (body is None or isinstance(body, (bool, int, float, str))):
        return body
    raise SharedError(f"not a described value: {value!r:.200}")


def write_values(value, arena: Arena, described) -> None:
    """Copy the tensors of `value` into their places in the arena (as `describe` laid them)."""
    if isinstance(value, torch.Tensor):
        arena.view(TensorSpec.from_json(described["tensor"])).copy_(value)
    elif isinstance(value, (list, tuple)):
        for v, d in zip(value, next(iter(described.values()))):
            write_values(v, arena, d)


def tensor_leaves(described) -> list[TensorSpec]:
    """The tensor specs of a described value, in order."""
    (kind, body), = described.items()
    if kind == "tensor":
        return [TensorSpec.from_json(body)]
    if kind in ("list", "tuple"):
        return [spec for item in body for spec in tensor_leaves(item)]
    return []


_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def digest(t: torch.Tensor) -> int:
    """The sum of a contiguous tensor's bits, read as integers: what the candidate's worker
    says its mailbox holds when it replies, checked by the reference worker when it reads
    the mailbox. Bytes written after the reply change it; matching it with other bytes
    means knowing the output's sum, i.e. having computed the output."""
    if t.numel() == 0:
        return 0
    flat = t.reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    return int(torch.sum(flat.view(_INT_OF_SIZE[flat.element_size()]), dtype=torch.int64))


def scratch_root() -> Path:
    """Where the judge makes each evaluation's private folder: not /dev/shm, which the
    candidate's worker may write (torch keeps CUDA IPC reference counts there)."""
    return Path(tempfile.gettempdir())

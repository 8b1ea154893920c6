"""The lean launch path: ctypes straight into the CUDA driver for what a kernel needs per call.

Why: at small and medium GEMM shapes the harness times a call as max(device, host), and
the host side of a launch through cuda.core (argument packing in Python objects, a
`StridedMemoryView` and validation per TMA descriptor) cost ~140 us more per call than
torch.matmul's cuBLAS launch on the H100 (`kforge bench gemm`, 2026-11-21): our 1024^3
kernel took 18 us on the device and 201 us on the host. The driver itself needs well under
a microsecond to encode a descriptor and a few to launch; everything else was Python.

So a `LeanLaunch` is made once per (kernel, grid, block, shared memory, cluster) and holds
the C structures a launch reads: the `CUlaunchConfig` (cluster shape as an attribute) and a
`void*` per argument; `TensorMaps` keeps an operand's TMA descriptors (64-byte-aligned,
128 bytes, `cuTensorMapEncodeTiled`) by address. A call points the argument array at the
descriptors and the scalars and calls `cuLaunchKernelEx` on torch's current stream. The
driver copies the parameters at launch, so everything is free again when the call returns.
A lock holds the slots from packing to launch, so threads may share a launch object (the
kernels keep one per shape; the GEMM's plans are per thread for their workspaces anyway).

Struct layouts are those of CUDA 12/13's cuda.h on x86-64 and aarch64 (checked by the tests
against the header where a C compiler is available): CUlaunchConfig 56 bytes,
CUlaunchAttribute 72, CUtensorMap 128 aligned to 64.
"""

from __future__ import annotations

import ctypes
import operator
import struct
import threading
from collections.abc import Sequence
from functools import cache

from kforge.errors import KforgeError

CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4
TENSOR_MAP_BYTES, TENSOR_MAP_ALIGN = 128, 64
DATA_TYPES = {"uint8": 0, "float16": 6, "bfloat16": 9}  # CUtensorMapDataType (fp8 travels as uint8)
SWIZZLES = {0: 0, 32: 1, 64: 2, 128: 3}  # swizzle bytes -> CUtensorMapSwizzle
L2_PROMOTIONS = {0: 0, 64: 1, 128: 2, 256: 3}  # bytes -> CUtensorMapL2promotion
SCALAR_SLOTS = {"ptr": "Q", "i32": "i4x", "f32": "f4x"}  # struct formats: each scalar in 8 bytes, little-endian


class DriverError(KforgeError):
    """A CUDA driver call failed; the message names the call and the CUresult."""


class _ClusterDim(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint), ("pad", ctypes.c_char * 52)]


class LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: an id, padding, a 64-byte union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("cluster", _ClusterDim)]


class LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


@cache
def libcuda() -> ctypes.CDLL:
    """The driver library torch has already loaded, with the prototypes we call."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise DriverError(f"cannot load the CUDA driver (libcuda.so.1): {exc}") from None
    u32, u64p, u32p = ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32)
    lib.cuTensorMapEncodeTiled.argtypes = [ctypes.c_void_p, ctypes.c_int, u32, ctypes.c_void_p, u64p, u64p, u32p,
                                           u32p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.cuKernelGetFunction.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    for fn in (lib.cuTensorMapEncodeTiled, lib.cuLaunchKernelEx, lib.cuKernelGetFunction, lib.cuGetErrorName):
        fn.restype = ctypes.c_int
    return lib


def _fail(call: str, status: int) -> DriverError:
    name = ctypes.c_char_p()
    libcuda().cuGetErrorName(status, ctypes.byref(name))
    return DriverError(f"{call} failed: {(name.value or b'unknown').decode()} ({status})")


def function_of(kernel_handle: int) -> int:
    """The CUfunction of a library-loaded CUkernel in the current context (torch's primary one)."""
    function = ctypes.c_void_p()
    status = libcuda().cuKernelGetFunction(ctypes.byref(function), kernel_handle)
    if status:
        raise _fail("cuKernelGetFunction", status)
    return function.value


class TensorMaps:
    """The TMA descriptors of one operand whose type, shape, row stride, box, swizzle and L2
    promotion are fixed (one GEMM plan's A, B or C), one per address asked for.

    A descriptor encodes only those fields and the address, so the address is a complete
    key. Finding one costs a dictionary lookup; encoding one, a driver call and ~3-5 us of
    Python. Inputs come back to the same few addresses (the harness's rotating input sets,
    a serving loop's recycled allocator blocks), so most calls find theirs. Oldest first out
    beyond `capacity`, its buffer encoded again for the newcomer.
    """

    def __init__(self, dtype: str, rows: int, cols: int, row_stride_bytes: int, box: Sequence[int], *,
                 swizzle_bytes: int = 128, l2_promotion_bytes: int = 0, capacity: int = 32):
        self._dtype, self._swizzle = DATA_TYPES[dtype], SWIZZLES[swizzle_bytes]
        self._l2 = L2_PROMOTIONS[l2_promotion_bytes]
        self._dims = (ctypes.c_uint64 * 2)(cols, rows)  # innermost dimension first
        self._strides = (ctypes.c_uint64 * 1)(row_stride_bytes)
        self._box = (ctypes.c_uint32 * 2)(box[1], box[0])
        self._unit = (ctypes.c_uint32 * 2)(1, 1)
        self._encode = libcuda().cuTensorMapEncodeTiled
        self.shape = (rows, cols, row_stride_bytes)
        self.capacity = capacity
        self._by_pointer: dict[int, int] = {}  # data pointer -> descriptor address
        self._buffers: list = []  # keeps the descriptors' storage alive

    def address_of(self, data_ptr: int) -> int:
        """The address of a descriptor of this operand at `data_ptr` (encoded on first sight)."""
        found = self._by_pointer.get(data_ptr)
        return found if found is not None else self._add(data_ptr)

    def _add(self, data_ptr: int) -> int:
        if len(self._by_pointer) >= self.capacity:
            address = self._by_pointer.pop(next(iter(self._by_pointer)))
        else:
            raw = ctypes.create_string_buffer(TENSOR_MAP_BYTES + TENSOR_MAP_ALIGN)
            self._buffers.append(raw)
            address = -(-ctypes.addressof(raw) // TENSOR_MAP_ALIGN) * TENSOR_MAP_ALIGN
        status = self._encode(address, self._dtype, 2, data_ptr, self._dims, self._strides, self._box, self._unit,
                              0, self._swizzle, self._l2, 0)
        if status:
            rows, cols, stride = self.shape
            raise _fail(f"cuTensorMapEncodeTiled ({rows} x {cols} at {data_ptr:#x}, stride {stride} B)", status)
        self._by_pointer[data_ptr] = address
        return address


class LeanLaunch:
    """A prepared launch of one kernel: fixed grid, block, shared memory and cluster. Its
    arguments, in order, are described by `kinds`: "map" (the address of a 128-byte TMA
    descriptor, `TensorMaps.address_of`, passed by value to a `__grid_constant__`
    parameter), "ptr" (a 64-bit address), "i32" (a 32-bit int) or "f32" (a float)."""

    def __init__(self, function: int, grid: Sequence[int], block: Sequence[int], shared_bytes: int,
                 cluster: Sequence[int] | None, kinds: Sequence[str]):
        if any(kind not in ("map", "ptr", "i32", "f32") for kind in kinds):
            raise KforgeError(f"LeanLaunch: argument kinds are 'map', 'ptr', 'i32' or 'f32', got {tuple(kinds)}")
        self.function = function
        self._launch = libcuda().cuLaunchKernelEx
        self.config = LaunchConfig(*grid, *block, shared_bytes, None, None, 0)
        if cluster is not None:
            self._attribute = LaunchAttribute(CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, b"", _ClusterDim(*cluster))
            self.config.attrs = ctypes.pointer(self._attribute)
            self.config.numAttrs = 1
        # A map's parameter is its descriptor's own address. The scalars live in 8-byte slots of one
        # buffer that a call fills with a single struct.pack_into (setting ctypes values one by one
        # cost ~0.3 us an argument on the H100's host); a scalar's parameter is its slot's address.
        self._count = len(kinds)
        self._maps = tuple(i for i, kind in enumerate(kinds) if kind == "map")
        scalars = [i for i, kind in enumerate(kinds) if kind != "map"]
        self._pick_scalars = operator.itemgetter(*scalars) if len(scalars) > 1 else lambda args: tuple(
            args[i] for i in scalars)
        self._pack = struct.Struct("<" + "".join(SCALAR_SLOTS[kinds[i]] for i in scalars)).pack_into
        self._slots = (ctypes.c_uint64 * max(len(scalars), 1))()
        base = ctypes.addressof(self._slots)
        slot_of = {i: base + 8 * n for n, i in enumerate(scalars)}
        self._params = (ctypes.c_void_p * self._count)(*(slot_of.get(i, 0) for i in range(self._count)))
        self._lock = threading.Lock()

    def __call__(self, stream: int, *args: int) -> None:
        """Launch on `stream` (a raw CUstream handle) with every argument, in order."""
        if len(args) != self._count:
            raise KforgeError(f"LeanLaunch: {self._count} arguments expected, got {len(args)}")
        scalars = args
        if self._maps:
            scalars = self._pick_scalars(args)
        with self._lock:  # another thread's arguments must not land in the slots before the driver copies them
            if self._maps:
                params = self._params
                for i in self._maps:
                    params[i] = args[i]
            try:
                self._pack(self._slots, 0, *scalars)
            except struct.error as error:
                raise KforgeError(f"LeanLaunch: an argument does not fit its kind: {error}") from None
            self.config.hStream = stream
            status = self._launch(ctypes.byref(self.config), self.function, self._params, None)
        if status:
            raise _fail("cuLaunchKernelEx", status)

"""The lean launch path: ctypes straight into the CUDA driver for what a kernel needs per call.

Why: at small and medium GEMM shapes the harness times a call as max(device, host), and
the host side of a launch through cuda.core (argument packing in Python objects, a
`StridedMemoryView` and validation per TMA descriptor) cost ~140 us more per call than
torch.matmul's cuBLAS launch on the H100 (`kforge bench gemm`, 2026-11-21): our 1024^3
kernel took 18 us on the device and 201 us on the host. The driver itself needs well under
a microsecond to encode a descriptor and a few to launch; everything else was Python.

So a `LeanLaunch` is made once per (kernel, grid, block, shared memory, cluster) and holds
the C structures a launch reads: the `CUlaunchConfig` (cluster shape as an attribute), one
64-byte-aligned 128-byte buffer per tensor map, a `void*` per argument. A call writes the
new addresses into those buffers, encodes the maps (`cuTensorMapEncodeTiled`) and calls
`cuLaunchKernelEx` on torch's current stream. The driver copies the parameters at launch,
so the buffers are free again when the call returns; a launch object is not shared between
threads (the GEMM keys its plans by thread).

Struct layouts are those of CUDA 12/13's cuda.h on x86-64 and aarch64 (checked by the tests
against the header where a C compiler is available): CUlaunchConfig 56 bytes,
CUlaunchAttribute 72, CUtensorMap 128 aligned to 64.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from functools import cache

from kforge.errors import KforgeError

CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4
TENSOR_MAP_BYTES, TENSOR_MAP_ALIGN = 128, 64
DATA_TYPES = {"float16": 6, "bfloat16": 9}  # CUtensorMapDataType
SWIZZLES = {0: 0, 32: 1, 64: 2, 128: 3}  # swizzle bytes -> CUtensorMapSwizzle
L2_PROMOTIONS = {0: 0, 64: 1, 128: 2, 256: 3}  # bytes -> CUtensorMapL2promotion


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


class TensorMapSlot:
    """One TMA descriptor's storage and its fixed parts (type, box, swizzle); `encode`
    fills it for a 2-D row-major tensor at a given address and shape."""

    def __init__(self, dtype: str, box: Sequence[int], swizzle_bytes: int = 128, l2_promotion_bytes: int = 0):
        self._raw = ctypes.create_string_buffer(TENSOR_MAP_BYTES + TENSOR_MAP_ALIGN)
        self.address = -(-ctypes.addressof(self._raw) // TENSOR_MAP_ALIGN) * TENSOR_MAP_ALIGN
        rows, cols = box
        self._dtype, self._swizzle, self._l2 = DATA_TYPES[dtype], SWIZZLES[swizzle_bytes], L2_PROMOTIONS[l2_promotion_bytes]
        self._dims = (ctypes.c_uint64 * 2)()
        self._strides = (ctypes.c_uint64 * 1)()
        self._box = (ctypes.c_uint32 * 2)(cols, rows)  # innermost dimension first
        self._unit = (ctypes.c_uint32 * 2)(1, 1)
        self._encode = libcuda().cuTensorMapEncodeTiled

    def encode(self, data_ptr: int, rows: int, cols: int, row_stride_bytes: int) -> None:
        self._dims[0], self._dims[1] = cols, rows
        self._strides[0] = row_stride_bytes
        status = self._encode(self.address, self._dtype, 2, data_ptr, self._dims, self._strides,
                                                  self._box, self._unit, 0, self._swizzle, self._l2, 0)
        if status:
            raise _fail(f"cuTensorMapEncodeTiled ({rows} x {cols} at {data_ptr:#x}, stride {row_stride_bytes} B)",
                        status)


class LeanLaunch:
    """A prepared launch of one kernel: fixed grid, block, shared memory and cluster; the
    arguments described by `kinds` ("map" for a tensor map slot given at construction in
    `maps`, "ptr" for a 64-bit address, "i32" for a 32-bit int), set per call."""

    def __init__(self, function: int, grid: Sequence[int], block: Sequence[int], shared_bytes: int,
                 cluster: Sequence[int] | None, kinds: Sequence[str], maps: Sequence[TensorMapSlot] = ()):
        self.function = function
        self._launch = libcuda().cuLaunchKernelEx
        self.config = LaunchConfig(*grid, *block, shared_bytes, None, None, 0)
        if cluster is not None:
            self._attribute = LaunchAttribute(CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, b"", _ClusterDim(*cluster))
            self.config.attrs = ctypes.pointer(self._attribute)
            self.config.numAttrs = 1
        maps = list(maps)
        self._values, addresses = [], []
        for kind in kinds:
            if kind == "map":
                addresses.append(maps.pop(0).address)
                self._values.append(None)
            else:
                value = ctypes.c_uint64() if kind == "ptr" else ctypes.c_int32()
                self._values.append(value)
                addresses.append(ctypes.addressof(value))
        if maps:
            raise KforgeError(f"LeanLaunch: {len(maps)} tensor map slot(s) given but not used by kinds {kinds}")
        self._params = (ctypes.c_void_p * len(addresses))(*addresses)
        self._scalars = [(i, v) for i, v in enumerate(self._values) if v is not None]

    def __call__(self, stream: int, *scalars: int) -> None:
        """Launch on `stream` (a raw CUstream handle) with the non-map arguments in order;
        the caller has encoded the tensor map slots already."""
        for (_, slot), value in zip(self._scalars, scalars):
            slot.value = value
        self.config.hStream = stream
        status = self._launch(ctypes.byref(self.config), self.function, self._params, None)
        if status:
            raise _fail("cuLaunchKernelEx", status)

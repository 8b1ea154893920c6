"""The lean driver launch path on a machine without a GPU: the C structures against cuda.h,
and what a launch hands the driver (a fake libcuda records the calls and reads the memory
the real one would read)."""

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from kforge.errors import KforgeError
from kforge.runtime import driver
from kforge.runtime.driver import LaunchAttribute, LaunchConfig, LeanLaunch, TensorMaps


def test_structures_have_the_sizes_and_offsets_of_cuda_h():
    assert ctypes.sizeof(LaunchConfig) == 56 and ctypes.sizeof(LaunchAttribute) == 72
    assert LaunchConfig.sharedMemBytes.offset == 24 and LaunchConfig.hStream.offset == 32
    assert LaunchConfig.attrs.offset == 40 and LaunchConfig.numAttrs.offset == 48
    assert LaunchAttribute.cluster.offset == 8


def _cuda_h() -> Path | None:
    try:
        import triton
    except ImportError:
        return None
    header = Path(triton.__file__).parent / "backends" / "nvidia" / "include" / "cuda.h"
    return header if header.is_file() else None


@pytest.mark.skipif(shutil.which("cc") is None or _cuda_h() is None, reason="needs a C compiler and cuda.h")
def test_structures_match_the_header_compiled_by_a_c_compiler(tmp_path):
    program = tmp_path / "layout.c"
    program.write_text("""
#include <cuda.h>
#include <stdio.h>
#include <stddef.h>
int main(void) {
  printf("%zu %zu %zu %zu %zu %zu %zu %d\\n", sizeof(CUlaunchConfig), offsetof(CUlaunchConfig, sharedMemBytes),
         offsetof(CUlaunchConfig, hStream), offsetof(CUlaunchConfig, attrs), offsetof(CUlaunchConfig, numAttrs),
         sizeof(CUlaunchAttribute), offsetof(CUlaunchAttribute, value), (int)CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION);
  return 0;
}""")
    subprocess.run(["cc", f"-I{_cuda_h().parent}", str(program), "-o", str(tmp_path / "layout")], check=True)
    found = subprocess.run([str(tmp_path / "layout")], capture_output=True, text=True, check=True).stdout.split()
    assert [int(v) for v in found] == [
        ctypes.sizeof(LaunchConfig), LaunchConfig.sharedMemBytes.offset, LaunchConfig.hStream.offset,
        LaunchConfig.attrs.offset, LaunchConfig.numAttrs.offset, ctypes.sizeof(LaunchAttribute),
        LaunchAttribute.cluster.offset, driver.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION]


def test_enum_values_match_cuda_bindings():
    from cuda.bindings import driver as cu

    assert driver.DATA_TYPES["bfloat16"] == int(cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16)
    assert driver.DATA_TYPES["float16"] == int(cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16)
    assert driver.SWIZZLES[128] == int(cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B)
    assert driver.L2_PROMOTIONS[256] == int(cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B)
    assert driver.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION == int(
        cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION)


class FakeDriver:
    """Stands in for libcuda: records what each call would have read."""

    def __init__(self, status=0):
        self.status, self.launches, self.encodes = status, [], []

    def cuLaunchKernelEx(self, config_ref, function, params, extra):
        config = ctypes.cast(config_ref, ctypes.POINTER(LaunchConfig)).contents
        cluster = [(a.id, a.cluster.x, a.cluster.y, a.cluster.z) for a in config.attrs[:config.numAttrs]]
        self.launches.append(dict(grid=(config.gridDimX, config.gridDimY, config.gridDimZ),
                                  block=(config.blockDimX, config.blockDimY, config.blockDimZ),
                                  shared=config.sharedMemBytes, stream=config.hStream, cluster=cluster,
                                  function=function, params=[params[i] for i in range(len(params))]))
        return self.status

    def cuTensorMapEncodeTiled(self, address, dtype, rank, data, dims, strides, box, unit, interleave, swizzle,
                               l2, oob):
        self.encodes.append(dict(address=address, dtype=dtype, rank=rank, data=data, dims=(dims[0], dims[1]),
                                 stride=strides[0], box=(box[0], box[1]), swizzle=swizzle))
        return self.status

    def cuGetErrorName(self, status, name_ref):
        ctypes.cast(name_ref, ctypes.POINTER(ctypes.c_char_p))[0] = b"CUDA_ERROR_INVALID_VALUE"
        return 0


@pytest.fixture
def fake(monkeypatch):
    fake = FakeDriver()
    monkeypatch.setattr(driver, "libcuda", lambda: fake)
    return fake


def test_a_launch_passes_each_argument_by_address_and_the_cluster_as_an_attribute(fake):
    launch = LeanLaunch(0xF00, (132, 1, 1), (384, 1, 1), 200_000, (2, 1, 1), ("map", "ptr", "map", "i32", "i32"))
    launch(0x5EED, 0x1000, 0xDEAD0000, 0x2000, 4096, -7)
    call = fake.launches[-1]
    assert call["grid"] == (132, 1, 1) and call["block"] == (384, 1, 1) and call["shared"] == 200_000
    assert call["stream"] == 0x5EED and call["function"] == 0xF00 and call["cluster"] == [(4, 2, 1, 1)]
    params = call["params"]
    assert params[0] == 0x1000 and params[2] == 0x2000  # a descriptor is passed as its own address
    assert ctypes.c_uint64.from_address(params[1]).value == 0xDEAD0000
    assert [ctypes.c_int32.from_address(p).value for p in params[3:]] == [4096, -7]
    launch(0, 0x3000, 0xBEEF0000, 0x4000, 1, 2)  # a second call rewrites the same slots
    params = fake.launches[-1]["params"]
    assert params[0] == 0x3000 and ctypes.c_uint64.from_address(params[1]).value == 0xBEEF0000


def test_a_launch_without_a_cluster_has_no_attribute_and_counts_its_arguments(fake):
    launch = LeanLaunch(1, (4, 2, 1), (128, 1, 1), 0, None, ("i32",))
    launch(0, 5)
    assert fake.launches[-1]["cluster"] == [] and fake.launches[-1]["grid"] == (4, 2, 1)
    with pytest.raises(Exception, match="1 arguments expected, got 2"):
        launch(0, 5, 6)
    with pytest.raises(Exception, match="argument kinds"):
        LeanLaunch(1, (1, 1, 1), (32, 1, 1), 0, None, ("f64",))


def test_a_float_argument_is_passed_as_four_bytes_of_float(fake):
    import ctypes

    launch = LeanLaunch(1, (1, 1, 1), (32, 1, 1), 0, None, ("i32", "f32"))
    launch(0, 3, 1e-5)
    value = ctypes.c_float.from_address(launch._params[1])
    assert value.value == pytest.approx(1e-5, rel=1e-6) and ctypes.sizeof(value) == 4


def test_maps_with_one_scalar_or_none_and_a_value_out_of_its_kind(fake):
    """The scalars are packed into their slots in one go: with one scalar among maps, with none,
    and an i32 that does not fit 32 bits is refused with a message, not wrapped around."""
    launch = LeanLaunch(1, (1, 1, 1), (32, 1, 1), 0, None, ("map", "i32", "map"))
    launch(0, 0x1000, -5, 0x2000)
    params = fake.launches[-1]["params"]
    assert params[0] == 0x1000 and params[2] == 0x2000 and ctypes.c_int32.from_address(params[1]).value == -5
    LeanLaunch(1, (1, 1, 1), (32, 1, 1), 0, None, ("map",))(0, 0x3000)
    assert fake.launches[-1]["params"][0] == 0x3000
    with pytest.raises(KforgeError, match="does not fit its kind"):
        LeanLaunch(1, (1, 1, 1), (32, 1, 1), 0, None, ("ptr", "i32"))(0, 0x1000, 2**31)


def test_threads_sharing_a_launch_each_launch_their_own_arguments(monkeypatch):
    """The driver reads the argument slots during the launch call; a thread switch inside it (the
    fake sleeps between its two reads) must not let another thread's arguments into them."""
    import threading
    import time

    seen = []

    class SlowDriver:
        def cuLaunchKernelEx(self, config_ref, function, params, extra):
            first = ctypes.c_uint64.from_address(params[0]).value
            time.sleep(0)  # lets another thread run between the driver's reads
            seen.append((first, ctypes.c_uint64.from_address(params[1]).value, config_ref._obj.hStream))
            return 0

    monkeypatch.setattr(driver, "libcuda", lambda: SlowDriver())
    launch = LeanLaunch(1, (1, 1, 1), (32, 1, 1), 0, None, ("ptr", "ptr"))

    def work(thread):
        for i in range(300):
            value = thread << 32 | i
            launch(thread, value, value)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == 1200
    assert all(a == b and a >> 32 == stream for a, b, stream in seen), "a launch read another thread's arguments"


def test_a_descriptor_is_encoded_once_per_address_innermost_dimension_first(fake):
    maps = TensorMaps("bfloat16", 300, 520, 1040, (128, 64), swizzle_bytes=128)
    first = maps.address_of(0x1000)
    assert first % 64 == 0 and maps.address_of(0x1000) == first and len(fake.encodes) == 1
    assert fake.encodes[-1] == dict(address=first, dtype=9, rank=2, data=0x1000, dims=(520, 300), stride=1040,
                                    box=(64, 128), swizzle=3)
    second = maps.address_of(0x2000)
    assert second != first and len(fake.encodes) == 2 and fake.encodes[-1]["data"] == 0x2000


def test_past_capacity_the_oldest_descriptor_is_encoded_again_for_the_newcomer(fake):
    maps = TensorMaps("float16", 64, 64, 128, (64, 64), capacity=2)
    a, b = maps.address_of(0xA000), maps.address_of(0xB000)
    c = maps.address_of(0xC000)  # evicts 0xA000, reuses its buffer
    assert c == a and fake.encodes[-1]["data"] == 0xC000 and fake.encodes[-1]["dtype"] == 6
    assert maps.address_of(0xB000) == b and len(fake.encodes) == 3
    maps.address_of(0xA000)  # seen before but evicted: encoded again
    assert len(fake.encodes) == 4 and fake.encodes[-1]["data"] == 0xA000


def test_driver_failures_raise_with_the_error_name(fake):
    fake.status = 1
    with pytest.raises(driver.DriverError, match=r"cuLaunchKernelEx failed: CUDA_ERROR_INVALID_VALUE \(1\)"):
        LeanLaunch(1, (1, 1, 1), (32, 1, 1), 0, None, ())(0)
    with pytest.raises(driver.DriverError, match="cuTensorMapEncodeTiled .*300 x 520"):
        TensorMaps("bfloat16", 300, 520, 1040, (128, 64)).address_of(0x1000)

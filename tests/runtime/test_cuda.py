"""The CUDA runtime on a machine with no GPU: NVRTC compiles, the cubin cache, the errors.

Launching needs a GPU (tests/kernels/test_gemm_fp32.py); everything a launch checks
before it touches the device is tested here.
"""

import os
from pathlib import Path

import pytest
import torch

from kforge.errors import KforgeError
from kforge.runtime.cuda import (CudaCompileError, CudaKernel, LaunchError, compile_cuda, integer_defines, loop_opcodes,
                                 resources)

KERNELS = Path(__file__).parents[2] / "src" / "kforge" / "kernels"
ALL_SOURCES = sorted(KERNELS.rglob("*.cu"))

FILL = """#include "value.cuh"
extern "C" __global__ void fill(float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = VALUE * SCALE;
}
"""


@pytest.fixture
def source(tmp_path):
    (tmp_path / "value.cuh").write_text("#define VALUE 2.0f\n")
    path = tmp_path / "fill.cu"
    path.write_text(FILL)
    return path


@pytest.mark.slow
def test_every_kernel_source_in_the_package_compiles_for_sm90a():
    assert len(ALL_SOURCES) >= 9
    for path in ALL_SOURCES:
        cubin = compile_cuda(path, arch="sm_90a")
        found = resources(cubin)
        assert found, f"{path.name}: no kernel in the cubin"
        assert all(0 < r.registers <= 255 for r in found.values()), (path.name, found)


def test_second_compile_is_read_from_the_disk_cache(source):
    first = compile_cuda(source, arch="sm_90a", defines={"SCALE": 3})
    second = compile_cuda(source, arch="sm_90a", defines={"SCALE": 3})
    assert not first.from_cache and second.from_cache
    assert second.code == first.code and second.key == first.key
    cached = list((Path(os.environ["KFORGE_CACHE_DIR"]) / "cubins").glob("fill-*.cubin"))
    assert len(cached) == 1


@pytest.mark.parametrize("change", ["defines", "arch", "header", "source"])
def test_anything_that_changes_the_code_misses_the_cache(source, change):
    before = compile_cuda(source, arch="sm_90a", defines={"SCALE": 3})
    arch, defines = "sm_90a", {"SCALE": 3}
    if change == "defines":
        defines = {"SCALE": 4}
    elif change == "arch":
        arch = "sm_80"
    elif change == "header":
        (source.parent / "value.cuh").write_text("#define VALUE 5.0f\n")
    else:
        source.write_text(FILL.replace("blockDim.x", "(int)blockDim.x"))
    after = compile_cuda(source, arch=arch, defines=defines)
    assert not after.from_cache and after.key != before.key


def test_a_damaged_cache_entry_is_compiled_again(source):
    first = compile_cuda(source, arch="sm_90a", defines={"SCALE": 1})
    for meta in (Path(os.environ["KFORGE_CACHE_DIR"]) / "cubins").glob("fill-*.json"):
        meta.unlink()
    again = compile_cuda(source, arch="sm_90a", defines={"SCALE": 1})
    assert not again.from_cache and again.code == first.code


def test_compile_error_names_file_and_line_and_keeps_the_log(tmp_path):
    bad = tmp_path / "bad.cu"
    bad.write_text('extern "C" __global__ void k(float* x) {\n    x[0] = undefined_name;\n}\n')
    with pytest.raises(CudaCompileError) as caught:
        compile_cuda(bad, arch="sm_90a")
    assert caught.value.reason.startswith("bad.cu does not compile: bad.cu:2: error")
    assert "undefined_name" in caught.value.reason
    assert "undefined_name" in caught.value.details and "^" in caught.value.details  # NVRTC's own log


def test_missing_source_and_unknown_option_are_clear_errors(source, tmp_path):
    with pytest.raises(KforgeError, match="no CUDA source"):
        compile_cuda(tmp_path / "nope.cu", arch="sm_90a")
    with pytest.raises(KforgeError, match="unsupported NVRTC option"):
        compile_cuda(source, arch="sm_90a", defines={"SCALE": 1}, options=["--frobnicate"])


def test_ptxas_report_counts_spills(tmp_path):
    path = tmp_path / "spill.cu"  # a big dynamically indexed array under a tight register cap
    path.write_text('extern "C" __global__ void __launch_bounds__(1024, 2) k(float* x, int n) {\n'
                    "  float a[256];\n  for (int j = 0; j < 256; ++j) a[j] = x[j * n + threadIdx.x];\n"
                    "  float s = 0.f;\n  for (int j = 0; j < 256; ++j) s += a[(j * 7 + n) & 255] * a[j];\n"
                    "  x[threadIdx.x] = s;\n}\n")
    found = resources(compile_cuda(path, arch="sm_90a"))["k"]
    assert found.local_bytes > 0 or found.spill_stores > 0 or found.stack_bytes > 0


def test_integer_defines_reads_defaults_and_includes_first_definition_wins(tmp_path):
    (tmp_path / "base.cuh").write_text("#ifndef BM\n#define BM 128\n#endif\n#ifndef BK\n#define BK 8\n#endif\n"
                                       "#define DERIVED (BM * 2)\n")
    top = tmp_path / "top.cu"
    top.write_text('#define BM 64\n#include "base.cuh"\n')
    assert integer_defines(top) == {"BM": 64, "BK": 8}


def test_launch_checks_arguments_before_touching_a_device(source):
    kernel = CudaKernel(compile_cuda(source, arch="sm_90a", defines={"SCALE": 1}), "fill")
    x = torch.zeros(8)
    with pytest.raises(LaunchError, match="one CUDA device"):
        kernel.launch(1, 8, (x, 8))
    with pytest.raises(LaunchError, match="more than 1024 threads"):
        kernel.launch(1, (64, 32), (8,))
    with pytest.raises(LaunchError, match="grid must be"):
        kernel.launch((0, 1), 32, (8,))
    with pytest.raises(LaunchError, match="does not fit a 32-bit int"):
        kernel.launch(1, 32, (2**31,))
    with pytest.raises(LaunchError, match="argument 0 is a str"):
        kernel.launch(1, 32, ("x",))
    with pytest.raises(LaunchError, match="not a whole number of clusters"):
        kernel.launch(3, 32, (8,), cluster=2)
    assert kernel._loaded == {}  # nothing was loaded, let alone launched


def test_loop_opcodes_reads_the_body_of_each_backward_branch():
    """From the branch's target to the branch, predicates dropped, modifiers kept; code before
    the loop and forward branches are not counted."""
    code = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/               @P0 BRA 0x0060 ;
        /*0020*/                   LDG.E.NA.128.CONSTANT R4, desc[UR4][R2.64] ;
        /*0030*/                   HFMA2 R8, R4, R5, R8 ;
        /*0040*/              @!P1 IADD3 R2, R2, 0x10, RZ ;
        /*0050*/               @P2 BRA 0x0020 ;
        /*0060*/                   EXIT ;
    """
    assert loop_opcodes(code) == ["LDG.E.NA.128.CONSTANT", "HFMA2", "IADD3"]
    assert loop_opcodes(code.replace("BRA 0x0020", "BRA 0x0060")) == []

"""Programmatic dependent launch (kforge/runtime/pdl.py) on a machine without a GPU: when it is
on, that each launcher takes the build that waits together with the attribute, and, read off
the sm_90a SASS of every decode kernel built for it, that the wait (ACQBULK) comes before any
global memory instruction and that no kernel signals the next one early (PREEXIT). The GPU test
(tests/models/test_decode_graphs.py) checks that a PDL step gives the serialized step's bits."""

import contextlib

import pytest
import torch

from kforge.runtime import pdl
from kforge.runtime.cuda import compile_cuda, memory_before_wait, sass


@pytest.fixture
def capabilities(monkeypatch):
    """cuda:0 a Hopper, cuda:1 an Ampere."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: {0: (9, 0), 1: (8, 0)}[index])
    monkeypatch.setattr(pdl, "_CAPABLE", {})


def test_pdl_is_on_only_inside_chained_and_only_on_a_hopper_or_later(capabilities):
    hopper, ampere = torch.device("cuda", 0), torch.device("cuda", 1)
    assert not pdl.enabled(hopper)
    with pdl.chained():
        assert pdl.enabled(hopper) and not pdl.enabled(ampere) and not pdl.enabled(torch.device("cpu"))
        with pdl.chained(False):
            assert not pdl.enabled(hopper)
        assert pdl.enabled(hopper)
    assert not pdl.enabled(hopper)
    with pytest.raises(RuntimeError), pdl.chained():
        raise RuntimeError("a failed step")
    assert not pdl.enabled(hopper)


def test_a_triton_launch_takes_the_waiting_build_and_the_attribute_together():
    assert pdl.triton_options(True) == {"PDL": True, "launch_pdl": True}
    assert pdl.triton_options(False) == {}


class _Recorder:
    """Stands in for CudaKernel: records the defines of each build and the `pdl` of each launch."""

    builds: list[dict] = []
    launches: list[bool] = []

    @classmethod
    def from_file(cls, source, name, *, defines=None, **_):
        cls.builds.append(dict(defines or {}))
        return cls()

    def lean(self, grid, block, index, *, kinds, pdl=False, **_):
        type(self).launches.append(pdl)
        return lambda stream, *args: None

    def max_active_clusters(self, *_):
        return 132


def _bf16_rows():
    from kforge.kernels.serving import gemv

    x, w = torch.randn(1, 64, dtype=torch.bfloat16), torch.randn(32, 64, dtype=torch.bfloat16)
    gemv.launch_rows_kernel(x, w, torch.empty(1, 32, dtype=torch.bfloat16))


def _w4a16_one_token():
    from kforge.kernels.quant import w4a16

    w4a16.launch_cuda_gemv(torch.randn(1, 256, dtype=torch.bfloat16), torch.zeros(32, 128, dtype=torch.uint8),
                           torch.ones(32, 2, dtype=torch.bfloat16), 128, torch.empty(1, 32, dtype=torch.bfloat16))


def _w4a16_bulk():
    from kforge.kernels.quant import w4a16

    w4a16.launch_bulk_gemv(torch.randn(1, 1024, dtype=torch.bfloat16), torch.zeros(32, 512, dtype=torch.uint8),
                           torch.ones(32, 8, dtype=torch.bfloat16), torch.empty(1, 32, dtype=torch.bfloat16))


def _fp8():
    from kforge.kernels.quant import fp8_gemv

    fp8_gemv.launch_cuda_gemv(torch.randn(1, 256, dtype=torch.bfloat16),
                              torch.zeros(128, 256, dtype=torch.float8_e4m3fn), torch.ones(1, 2),
                              torch.empty(1, 128, dtype=torch.bfloat16))


@pytest.mark.parametrize("launch", [_bf16_rows, _w4a16_one_token, _w4a16_bulk, _fp8],
                         ids=["bf16 rows", "w4a16", "w4a16 bulk", "fp8"])
def test_each_cuda_launcher_builds_with_pdl_exactly_when_it_launches_with_it(launch, monkeypatch):
    """A launch with the attribute and a build without the wait would race: the launchers take
    both from one `pdl.enabled`, and keep the two launches apart."""
    from kforge.runtime import cuda

    monkeypatch.setattr(cuda, "CudaKernel", _Recorder)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0, raising=False)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    for chained in (False, True, False):
        monkeypatch.setattr(pdl, "enabled", lambda device, on=chained: on)
        _Recorder.builds, _Recorder.launches = [], []
        launch()
        assert [build.get("PDL") for build in _Recorder.builds] in ([int(chained)], [])
        assert _Recorder.launches in ([chained], [])
    # the first call of each setting built and prepared; the third found the first's launch again
    monkeypatch.setattr(pdl, "enabled", lambda device: True)
    _Recorder.builds, _Recorder.launches = [], []
    launch()
    assert _Recorder.builds == [] and _Recorder.launches == []


# each build, and how its weights start on their way before the wait: an L2 prefetch, or (the bulk
# kernel's producer, which reads nothing but W) the bulk copies into shared memory themselves
_CUDA_BUILDS = {
    "bf16 rows, SwiGLU": ("serving/gemv_rows.cu", {"EPILOGUE": 2}, "UBLKPF.L2"),
    "bf16 rows, residual": ("serving/gemv_rows.cu", {"EPILOGUE": 1}, "UBLKPF.L2"),
    "w4a16, residual": ("quant/w4a16_gemv.cu", {"ROWS": 2, "WARPS": 4, "RESIDUAL": 1}, "UBLKPF.L2"),
    "w4a16 bulk": ("quant/w4a16_gemv_bulk.cu", {}, "UBLKCP"),
    "fp8, residual": ("quant/fp8_gemv.cu", {"RESIDUAL": 1}, "UBLKPF.L2"),
}


@pytest.mark.parametrize("label", list(_CUDA_BUILDS))
def test_the_cuda_decode_kernels_wait_before_any_global_access_under_pdl_and_not_otherwise(label):
    from pathlib import Path

    import kforge.kernels

    source, defines, early = _CUDA_BUILDS[label]
    path = Path(kforge.kernels.__file__).parent / source
    chained, plain = (sass(compile_cuda(path, arch="sm_90a", defines={**defines, "PDL": on}, cache=False))
                      for on in (1, 0))
    assert memory_before_wait(chained) == 0, "a global load or store before griddepcontrol.wait"
    assert chained.count("ACQBULK") == 1 and "PREEXIT" not in chained  # no early launch_dependents
    assert early in chained
    assert memory_before_wait(plain) is None and "PREEXIT" not in plain and "UBLKPF" not in plain


def test_the_triton_decode_kernels_wait_before_any_global_access_under_pdl():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "kernels"))
    from triton_sm90 import compile_sm90, spec

    serving = "kforge.kernels.serving."
    i32 = "i32"
    gemv = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "gamma_ptr": "*bf16", "residual_ptr": "*bf16",
            "eps": "fp32", **{n: i32 for n in ("batch", "n_out", "k_in", "stride_xb", "stride_wn", "stride_yb",
                                                "stride_rb", "weight_rows")}}
    norm = {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16",
            "new_res_ptr": "*bf16", "eps": "fp32", **{n: i32 for n in ("n_rows", "hidden", "x_stride", "res_stride")}}
    swiglu = {"x_ptr": "*bf16", "out_ptr": "*bf16", "n_rows": i32, "hidden": i32, "x_stride": i32}
    rope_ints = ("n_q_heads", "n_kv_heads", "new_tokens", "max_position", "half", "max_pages", "stride_table",
                 "q_batch_stride", "q_seq_stride", "q_head_stride", "k_batch_stride", "k_seq_stride", "k_head_stride",
                 "v_batch_stride", "v_seq_stride", "v_head_stride", "stride_kp", "stride_kh", "stride_kt",
                 "stride_vp", "stride_vh", "stride_vt")
    rope = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "pos_ptr": "*i64", "table_ptr": "*fp32",
            "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "block_tables_ptr": "*i32", "context_lens_ptr": "*i32",
            **{n: i32 for n in rope_ints}}
    part_ints = ("stride_qb", "stride_qh", "stride_kp", "stride_kh", "stride_kt", "stride_vp", "stride_vh",
                 "stride_vt", "stride_table", "kv_heads", "max_pages", "num_partitions", "partition_size")
    partition = {"q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "block_tables_ptr": "*i32",
                 "context_lens_ptr": "*i32", "out_ptr": "*bf16", "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32",
                 "part_acc_ptr": "*fp32", "counters_ptr": "*i32", "qk_scale": "fp32", **{n: i32 for n in part_ints}}
    reduce = {"part_max_ptr": "*fp32", "part_sum_ptr": "*fp32", "part_acc_ptr": "*fp32", "context_lens_ptr": "*i32",
              "out_ptr": "*bf16", **{n: i32 for n in ("q_heads", "max_tokens", "num_partitions", "partition_size")}}
    on = {"PDL": True}
    specs = [  # Llama-3-8B's decode step at batch 1, the tiles its launchers pick
        spec("gemv + norm", serving + "gemv", "gemv_kernel", gemv,
             {"BLOCK_B": 1, "BLOCK_N": 8, "BLOCK_K": 1024, "USE_DOT": False, "NORM": True, "DOT_PRECISION": "tf32",
              **on}, num_stages=1),
        spec("norm", serving + "norms", "norm_kernel", norm,
             {"RMS": True, "HAS_RESIDUAL": True, "HAS_BIAS": False, "BLOCK_ROWS": 1, "BLOCK_H": 4096,
              "LOOPED": False, **on}, num_warps=8),
        spec("rope + append", serving + "rope_append", "rope_append_kernel", rope,
             {"HEADS_BLOCK": 16, "HALF_BLOCK": 64, "HEAD_DIM": 128, "PAGE_SIZE": 16, "PARTIAL": False,
              "INTERLEAVED": False, **on}, num_warps=8, num_stages=1),
        spec("partition", serving + "paged_decode", "paged_decode_partition_kernel", partition,
             {"GROUP": 4, "BLOCK_G": 16, "HEAD_DIM": 128, "PAGE_SIZE": 16, "BLOCK_N": 64, "SPLIT": True,
              "FUSED": False, "BLOCK_H": 1, "BLOCK_M": 1, "BLOCK_P": 1, "DOT_PRECISION": "tf32", **on}),
        spec("reduce", serving + "paged_decode", "paged_decode_reduce_kernel", reduce,
             {"HEAD_DIM": 128, "BLOCK_M": 32, "BLOCK_P": 32, **on}),
        spec("swiglu", serving + "swiglu", "swiglu_kernel", swiglu, {"BLOCK_ROWS": 1, "BLOCK_H": 2048, **on},
             num_warps=8),
        spec("swiglu, no PDL", serving + "swiglu", "swiglu_kernel", swiglu, {"BLOCK_ROWS": 1, "BLOCK_H": 2048},
             num_warps=8),
    ]
    found = compile_sm90(specs)
    for label, kernel in found.items():
        if label.endswith("no PDL"):
            assert kernel["acqbulk"] == 0 and kernel["preexit"] == 0, (label, kernel)
        else:
            assert kernel["acqbulk"] >= 1 and kernel["preexit"] == 0, (label, kernel)
            assert kernel["memory_before_wait"] == 0, (label, kernel)

"""The abstraction ladder (kforge/kernels/abstraction, `kforge ladder abstraction`) where there is
no GPU: the Gluon, CUDA, TileLang and CuTe DSL kernels compiled for sm_90a with their SASS read
(TileLang's and CuTe DSL's only where they are installed: CI has neither), the Triton levels
under the interpreter against fp32 references, the line counter, the skip of a missing tool,
the table from scripted records and the command's errors. On a GPU: every level against torch."""

import dataclasses
import os
import shutil
import subprocess
import sys

import pytest
import torch
from rich.console import Console

from kforge.errors import KforgeError
from kforge.kernels import abstraction
from kforge.kernels.abstraction import Level, levels, lines_of_code
from kforge.kernels.abstraction.compiling import CompileReport, measure, shuffles_branched_around
from kforge.ladder import abstraction_rows, get_ladder
from kforge.views import abstraction_view


def level(kernel, tool):
    (found,) = [x for x in levels(kernel) if x.tool == tool]
    return found


def compilable(kernel, tool):
    """The level, or a skip saying why it cannot compile here: its tool is not installed, or
    (TileLang) there is no nvcc to compile its CUDA with."""
    found = level(kernel, tool)
    if found.missing():
        pytest.skip(found.missing())
    if tool == "tilelang" and shutil.which("nvcc") is None:
        pytest.skip("TileLang compiles with nvcc, which is not on PATH")
    return found


# --- compiled for the H100 without a GPU ---------------------------------------------------


@pytest.mark.slow
def test_gluon_gemm_compiles_to_wgmma_fed_by_tma_and_stored_by_tma_without_spills():
    report = measure(level("gemm", "gluon"), 4096)
    assert report.error is None and report.seconds > 0
    assert report.spills == 0 and report.registers <= 255
    # 4 wgmma a 64-deep k-tile (k16 each) in the loop; A and B by TMA in the prologue and the loop
    assert report.sass["wgmma"] >= 4 and report.sass["tma_loads"] >= 4 and report.sass["tma_stores"] >= 1


def test_tilelang_gemm_compiles_to_tma_and_wgmma_without_spills_where_tilelang_and_nvcc_are_installed():
    report = measure(compilable("gemm", "tilelang"), 4096)
    assert report.error is None and report.spills == 0
    # TileLang made the pipeline a TMA producer and wgmma consumers from T.copy, T.gemm and T.Pipelined
    assert report.sass["wgmma"] >= 4 and report.sass["tma_loads"] >= 2


def test_cute_gemm_compiles_to_a_warp_specialized_wgmma_kernel_fed_by_tma_where_cute_dsl_is_installed():
    cute_level = compilable("gemm", "cute")
    from kforge.kernels.abstraction import cute_gemm

    report = measure(cute_level, 4096)
    assert report.error is None and report.seconds > 0 and report.spills == 0
    assert report.registers * cute_gemm.THREADS <= 65536  # the 3 warpgroups fit the SM's register file at launch
    # the mainloop's 4 wgmma (m64 n256 k16) a k-tile; A's and B's TMA loads; the 8 TMA stores of a C tile
    assert report.sass["wgmma"] >= 4 and report.sass["tma_loads"] >= 2 and report.sass["tma_stores"] >= 8
    assert report.sass["setmaxnreg"] >= 2  # the producer gives registers up, the consumers take them


def test_cute_gemm_compiles_from_torch_tensors_as_it_does_on_the_gpu():
    compilable("gemm", "cute")
    import cuda.bindings.driver as cuda

    from kforge.kernels.abstraction import cute_gemm

    # partial tiles in M, N and K; B's transpose is a strided view: the path `gemm` takes, short of the launch
    a, b, c = (torch.empty(rows, cols, dtype=torch.bfloat16) for rows, cols in ((1000, 264), (264, 520), (1000, 520)))
    kernel = cute_gemm.compiled_for(a, b, c, sm_count=132, stream=cuda.CUstream(0))
    assert callable(kernel)
    with pytest.raises(ValueError, match="multiples of 8"):
        cute_gemm.gemm(a[:, :260].contiguous(), b[:260])


@pytest.mark.parametrize("tool", ["tilelang", "gluon", "cute", "cuda"])
@pytest.mark.slow
def test_softmax_levels_compile_to_16_byte_accesses_without_spills(tool):
    report = measure(compilable("softmax", tool), 128256)
    assert report.error is None and report.spills == 0
    assert report.sass["ldg128"] >= 2 and report.sass["stg128"] >= 1  # both passes' loads, pass 2's store
    assert report.sass["wgmma"] == 0
    assert report.sass["shfl_branched_around"] == 0  # a shuffle under `lane == 0` hangs the warp


# The CuTe DSL softmax's first build (38676b2) as ptxas laid out its cross-warp reduction: the warp
# index, a full-warp shuffle, read under `lane == 0`; it hung on the H200. Then the fixed build.
HUNG_REDUCTION = """
        /*05a0*/                   ISETP.NE.U32.AND P0, PT, R21, RZ, PT ;
        /*05c0*/               @P0 BRA 0x620 ;
        /*05d0*/                   SHF.R.U32.HI R17, RZ, 0x5, R2 ;
        /*05e0*/                   WARPSYNC.ALL ;
        /*05f0*/                   SHFL.IDX PT, R17, R17, RZ, 0x1f ;
        /*0610*/                   STS [R21], R26 ;
        /*0620*/                   WARPSYNC.ALL ;
        /*0630*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0650*/                   SHFL.BFLY PT, R21, R28, 0x8, 0x1f ;
"""
FIXED_REDUCTION = """
        /*05f0*/                   SHFL.BFLY PT, R26, R21, 0x1, 0x1f ;
        /*0610*/              @!P0 STS [R16], R29 ;
        /*0620*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0650*/                   SHFL.BFLY PT, R21, R28, 0x8, 0x1f ;
        /*0c80*/               @P0 BRA 0xcd0 ;
        /*0cc0*/                   BRA 0xd10 ;
        /*0d00*/                   BRA 0x0c80 ;
"""


def test_a_shuffle_that_a_predicated_branch_skips_is_counted():
    assert shuffles_branched_around(HUNG_REDUCTION) == 1
    assert shuffles_branched_around(FIXED_REDUCTION) == 0
    # a backward branch (a loop) skips nothing; a shuffle past the branch's target is reached by all
    assert shuffles_branched_around(HUNG_REDUCTION.replace("BRA 0x620", "BRA 0x500")) == 0
    assert shuffles_branched_around(HUNG_REDUCTION.replace("BRA 0x620", "BRA 0x5f0")) == 0
    # the other conditional forms: a uniform predicate, the predicate as an operand, a divergent branch
    for branch in ("@UP0 BRA.U 0x620", "BRA !UP0, 0x620", "@P0 BRA.DIV 0x620"):
        assert shuffles_branched_around(HUNG_REDUCTION.replace("@P0 BRA 0x620", branch)) == 1, branch
    assert shuffles_branched_around(HUNG_REDUCTION.replace("@P0 BRA 0x620", "BRA 0x620")) == 0  # every lane jumps
    # addresses restart in each function: a branch of one skips nothing of the next
    assert shuffles_branched_around("        Function : a\n        /*0010*/   @P0 BRA 0x100 ;\n"
                                    "        Function : b\n        /*0050*/   SHFL.IDX PT, R1, R1, RZ, 0x1f ;\n") == 0


def test_cute_softmax_fills_the_sm_with_32_registers_a_thread_where_cute_dsl_is_installed():
    cute_level = compilable("softmax", "cute")
    from kforge.kernels.abstraction import cute_softmax

    report = measure(cute_level, 128256)
    assert report.error is None and report.spills == 0
    # the launch bounds: 4 CTAs of 512 threads (every thread an SM holds) fit its 64K registers
    assert report.registers * cute_softmax.THREADS * cute_softmax.CTAS_PER_SM <= 65536


def test_cute_softmax_compiles_from_torch_tensors_as_it_does_on_the_gpu():
    compilable("softmax", "cute")
    import cuda.bindings.driver as cuda

    from kforge.kernels.abstraction import cute_softmax

    # an odd row count, rows ending in a part of a CTA's sweep: the path `softmax` takes, short of the launch
    x = torch.empty(37, 4104, dtype=torch.bfloat16)
    assert callable(cute_softmax.compiled_for(x, torch.empty_like(x), cuda.CUstream(0), arch="sm_90a"))
    with pytest.raises(ValueError, match="multiple of 8 columns"):
        cute_softmax.softmax(x[:, :4100].contiguous())
    with pytest.raises(ValueError, match="runs on a CUDA GPU, got a tensor on cpu"):
        cute_softmax.softmax(x)


def test_a_compile_that_fails_is_one_line_in_the_report_not_an_exception():
    unknown = Level("no_such_tool", "gemm", abstraction.HERE / "gluon_gemm.py", None, None, "-")
    report = measure(unknown, 64)  # the child finds no such level and exits non-zero
    assert report.seconds is None and report.error and "\n" not in report.error


# --- the Triton levels under the interpreter ------------------------------------------------


@pytest.mark.parametrize("shape, chunk", [((3, 37), 16), ((5, 300), 64), ((1, 8), 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_softmax_matches_float32_on_odd_shapes(shape, chunk, dtype):
    from kforge.kernels.abstraction.triton_softmax import softmax

    x = (3 * torch.randn(shape)).to(dtype)
    expected = torch.softmax(x.float(), dim=-1)
    got = softmax(x, chunk=chunk)
    assert got.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # one bf16 rounding (the interpreter truncates)
    torch.testing.assert_close(got.float(), expected, rtol=tolerance, atol=1e-6)


def test_triton_softmax_gives_minus_infinity_probability_zero_and_an_all_masked_row_nan():
    from kforge.kernels.abstraction.triton_softmax import softmax

    x = torch.randn(2, 40)
    x[0, ::3] = -float("inf")
    x[1] = -float("inf")
    got = softmax(x, chunk=16)
    assert torch.equal(got[0, ::3], torch.zeros(14))
    torch.testing.assert_close(got[0], torch.softmax(x[0], dim=-1))
    assert torch.isnan(got[1]).all() and torch.isnan(torch.softmax(x[1], dim=-1)).all()


def test_triton_gemm_level_matches_float32_on_an_odd_shape():
    from kforge.kernels.gemm_bf16.triton_matmul import matmul

    # fp16: the interpreter's tensor descriptors take no bf16 (the same kernel, 2-byte floats either way)
    a, b = torch.randn(37, 40, dtype=torch.float16), torch.randn(40, 24, dtype=torch.float16)
    got = matmul(a, b, config=dict(BM=16, BN=16, BK=16, GROUP_M=2))
    torch.testing.assert_close(got.float(), a.float() @ b.float(), rtol=2e-3, atol=2e-2)


# --- lines of code ----------------------------------------------------------------------------


def test_lines_of_code_skip_blanks_comments_and_docstrings_in_python(tmp_path):
    source = tmp_path / "k.py"
    source.write_text('"""Module docstring,\nover two lines."""\n\nimport torch  # a comment after code counts\n\n'
                      '# a comment line\ndef f(x):\n    """Doc."""\n    text = """a string\nthat is code"""\n'
                      '    return x\n')
    assert lines_of_code(source) == 5  # import, def, and the 2-line string assignment, return


def test_lines_of_code_skip_comments_but_not_strings_in_cuda(tmp_path):
    source = tmp_path / "k.cu"
    source.write_text('// header\n/* a block\n   comment */\n#define X 1\n\n__global__ void k() {  // trailing\n'
                      '    printf("// not a comment");  /* inline */\n}\n')
    assert lines_of_code(source) == 4


def test_every_level_counts_its_own_file():
    assert {x.tool for x in levels("gemm")} >= {"triton", "gluon", "cuda"}
    for x in (*levels("gemm"), *levels("softmax")):
        assert x.source.is_file() and 20 < lines_of_code(x.source) < 1000, x


# --- a missing tool, the table, the errors ------------------------------------------------------


def test_a_missing_tool_is_skipped_with_how_to_install_it(monkeypatch):
    absent = dataclasses.replace(level("gemm", "cute"), package="kforge_no_such_tool")
    assert absent.missing() == "cute: skipped, kforge_no_such_tool is not installed (pip install 'kforge[cute]')"
    assert level("gemm", "gluon").missing() is None
    monkeypatch.setattr(abstraction, "LEVELS", tuple(absent if x == level("gemm", "cute") else x
                                                     for x in abstraction.LEVELS))
    ladder = get_ladder("abstraction")
    assert "cute" not in [label for label, _ in ladder.steps(None)]
    with pytest.raises(KforgeError, match=r"^cute: skipped, .*pip install 'kforge\[cute\]'"):
        ladder.steps(["cute"])
    with pytest.raises(KforgeError, match="no rung 'tvm' in the abstraction gemm ladder"):
        ladder.steps(["tvm"])


def record(name, ms, library_ms, flops=2 * 4096**3, moved=None, status="slower"):
    return {"status": status, "candidate": {"name": name}, "reason": None,
            "gate2": {"stats": {"candidate": {"median_ms": ms}, "reference": {"median_ms": library_ms}}},
            "roofline": {"flops": flops, "bytes": moved, "ceilings": {"matmul_tflops": {"bf16": 790.0}}}}


def test_the_table_from_scripted_records_and_compile_reports():
    ladder = get_ladder("abstraction", None, "gemm")
    records = [record("triton", 0.187, 0.180), record("gluon", 0.360, 0.180),
               {"status": "incorrect", "candidate": {"name": "cuda"}, "reason": "gate 1 failed: values",
                "gate2": None, "roofline": None}]
    compiled = {"triton": CompileReport(1.26), "gluon": CompileReport(None, error="ptxas: too much shared memory"),
                "cuda": CompileReport(0.5)}
    rows = abstraction_rows(ladder, records, compiled)
    assert [r.level for r in rows] == ["triton", "gluon", "cuda"]  # the ladder's order
    assert rows[0].rate == pytest.approx(2 * 4096**3 / 0.187e-3 / 1e12)
    assert rows[0].pct_library == pytest.approx(100 * 0.180 / 0.187)
    assert rows[0].compile_s == 1.26 and rows[0].lines == lines_of_code(level("gemm", "triton").source)
    assert rows[1].compile_s is None and rows[1].reason == "ptxas: too much shared memory"
    assert rows[2].status == "incorrect" and rows[2].ms is None and rows[2].reason == "gate 1 failed: values"
    console = Console(width=200, record=True)
    console.print(abstraction_view(rows, title="t", library=ladder.library, rate_unit="TFLOP/s",
                                   skipped=["cute: skipped, x (pip install 'kforge[cute]')"], results_path=None))
    text = console.export_text()
    for shown in ("% of cuBLAS bf16", "TFLOP/s", "lines", "compile", "what this level lets you control",
                  "1.3 s", "96.3%", "gluon: ptxas: too much shared memory", "cuda: gate 1 failed: values",
                  "cute: skipped"):
        assert shown in text, shown


def test_the_softmax_rate_is_gigabytes_a_second():
    ladder = get_ladder("abstraction", "bf16", "softmax")
    moved = 2 * 2048 * 128256 * 2
    (row,) = abstraction_rows(ladder, [record("gluon", 0.4, 0.5, flops=5, moved=moved)], {})
    assert row.rate == pytest.approx(moved / 0.4e-3 / 1e9) and row.compile_s is None


def test_bad_ladder_choices_are_clear_errors():
    with pytest.raises(KforgeError, match="bf16 only"):
        get_ladder("abstraction", "fp32")
    with pytest.raises(KforgeError, match="no abstraction ladder for kernel 'conv'"):
        get_ladder("abstraction", None, "conv")
    with pytest.raises(KforgeError, match="--kernel is for the abstraction ladder"):
        get_ladder("gemm", None, "softmax")
    with pytest.raises(KforgeError, match="--sweep is for the gemm ladders"):
        get_ladder("abstraction").sweep()


def kforge(*args, cwd):
    return subprocess.run([sys.executable, "-m", "kforge", *map(str, args)], cwd=cwd,
                          env={**os.environ, "COLUMNS": "200"}, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_compile_only_prints_lines_and_compile_time_of_every_level_without_a_gpu(tmp_path):
    done = kforge("ladder", "abstraction", "--kernel", "softmax", "--compile-only", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    for tool in ("triton", "gluon", "cuda"):
        assert f"│ {tool}" in done.stdout
    assert "NOT RUN" in done.stdout and " s │" in done.stdout
    assert "softmax bf16: compiled for sm_90a, nothing run" in done.stdout  # no device's name on what ran nowhere


@pytest.mark.slow
def test_the_commands_errors_are_one_line_and_exit_2(tmp_path):
    for args, message in ((("--kernel", "conv"), "no abstraction ladder for kernel 'conv'"),
                          (("--dtype", "fp32"), "the abstraction ladder is bf16 only"),
                          (("--replot", "--compile-only"), "pick one")):
        done = kforge("ladder", "abstraction", *args, cwd=tmp_path)
        assert done.returncode == 2 and message in done.stderr, (args, done.stderr)
        assert "Traceback" not in done.stderr
    if not torch.cuda.is_available():
        no_gpu = kforge("ladder", "abstraction", "--rungs", "gluon", cwd=tmp_path)
        assert no_gpu.returncode == 2 and "no CUDA device" in no_gpu.stderr


# --- on a GPU ------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("tool", [x.tool for x in levels("gemm")])
@pytest.mark.parametrize("m, n, k", [(4096, 4096, 4096), (1000, 520, 264)])
def test_every_gemm_level_matches_torch_on_the_gpu(tool, m, n, k):
    this = level("gemm", tool)
    if this.missing():
        pytest.skip(this.missing())
    a = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    b = torch.randn(k, n, device="cuda").to(torch.bfloat16)
    torch.testing.assert_close(this.run(a, b).float(), (a.float() @ b.float()), rtol=1.6e-2, atol=0.125)


@pytest.mark.gpu
@pytest.mark.parametrize("tool", [x.tool for x in levels("softmax")])
@pytest.mark.parametrize("shape", [(3, 128256), (64, 1000), (2, 8)])
def test_every_softmax_level_matches_torch_on_the_gpu(tool, shape):
    this = level("softmax", tool)
    if this.missing():
        pytest.skip(this.missing())
    x = (2 * torch.randn(shape, device="cuda")).to(torch.bfloat16)
    torch.testing.assert_close(this.run(x).float(), torch.softmax(x.float(), dim=-1), rtol=1e-2, atol=1e-9)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(5, 4104), (7, 4088), (129, 8), (2, 128264)])
def test_cute_softmax_matches_float32_on_odd_shapes_on_the_gpu(shape):
    this = level("softmax", "cute")
    if this.missing():
        pytest.skip(this.missing())
    # a sweep and one vector, less than a sweep, one vector a row, a long row ending in a partial sweep
    x = (3 * torch.randn(shape, device="cuda")).to(torch.bfloat16)
    for _ in range(2):  # the second call runs the kernel compiled for this shape by the first
        torch.testing.assert_close(this.run(x).float(), torch.softmax(x.float(), dim=-1), rtol=1e-2, atol=1e-9)
    rest = x[1:]  # a view from the second row on: contiguous, its rows still 16-byte aligned
    torch.testing.assert_close(this.run(rest).float(), torch.softmax(rest.float(), dim=-1), rtol=1e-2, atol=1e-9)


@pytest.mark.gpu
def test_cute_softmax_rejects_what_its_16_byte_vectors_cannot_read_on_the_gpu():
    this = level("softmax", "cute")
    if this.missing():
        pytest.skip(this.missing())
    x = torch.zeros(4, 32, dtype=torch.bfloat16, device="cuda")
    # fp32; 1-D; rows 64 bytes apart, not contiguous; 12 columns; rows 8 bytes off 16-byte alignment
    for bad in (x.float(), x[0], x[:, :16], x[:, :12].contiguous(), x.flatten()[4:124].view(15, 8)):
        with pytest.raises(ValueError, match=r"^cute_softmax: needs a contiguous, 16-byte aligned 2-D bf16 tensor"):
            this.run(bad)


@pytest.mark.gpu
@pytest.mark.parametrize("tool", [x.tool for x in levels("softmax")])
def test_every_softmax_level_gives_minus_infinity_probability_zero_and_an_all_masked_row_nan_on_the_gpu(tool):
    this = level("softmax", tool)
    if this.missing():
        pytest.skip(this.missing())
    x = torch.randn(2, 4104, device="cuda").to(torch.bfloat16)  # one full chunk of 4096 and a partial one
    x[0, ::3] = -float("inf")
    x[1] = -float("inf")
    got = this.run(x).float()
    assert torch.equal(got[0, ::3], torch.zeros(1368, device="cuda"))
    torch.testing.assert_close(got[0], torch.softmax(x[0].float(), dim=-1), rtol=1e-2, atol=1e-9)
    assert torch.isnan(got[1]).all()

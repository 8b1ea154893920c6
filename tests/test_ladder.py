"""`kforge ladder` and `kforge resources` where there is no GPU: the table, the chart, the
replot of committed records, and clear errors; the GPU runs are in tests/kernels."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kforge.errors import ProblemError
from kforge.harness.problem import load_problem
from kforge.ladder import get_ladder, ladder_rows, latest_per_step, save_chart

H100_LADDER = Path(__file__).parent.parent / "benchmarks" / "results" / "nvidia-h100-80gb-hbm3" / "ladder-gemm-fp32.jsonl"


def kforge(*args, cwd):
    return subprocess.run([sys.executable, "-m", "kforge", *map(str, args)], cwd=cwd, env={**os.environ, "COLUMNS": "200"},
                          capture_output=True, text=True, timeout=300)


def record(name, ms, library_ms, flops=2 * 4096**3, status="slower"):
    return {"status": status, "candidate": {"name": name}, "reason": None,
            "gate2": {"stats": {"candidate": {"median_ms": ms}, "reference": {"median_ms": library_ms}}},
            "roofline": {"flops": flops, "ceilings": {"datasheet": {"tflops": {"fp32": 67.0}}}}}


def test_rows_give_percent_of_library_and_peak_and_the_step_over_the_last_timed_rung():
    failed = {"status": "incorrect", "candidate": {"name": "broken"}, "reason": "gate 1 failed: values",
              "gate2": None, "roofline": None}
    rows = ladder_rows([record("a", 10.0, 2.5), failed, record("b", 4.0, 2.0)], "fp32")
    assert [r.label for r in rows] == ["a", "broken", "b"]
    assert rows[0].pct_library == pytest.approx(25.0) and rows[2].pct_library == pytest.approx(50.0)
    assert rows[0].gflops == pytest.approx(2 * 4096**3 / 10e-3 / 1e9)
    assert rows[0].pct_peak == pytest.approx(100 * rows[0].gflops / 67_000)
    assert rows[1].ms is None and rows[1].step_speedup is None
    assert rows[2].step_speedup == pytest.approx(2.5)  # over "a": the failed rung is skipped


def test_latest_record_of_each_step_replaces_the_earlier_in_place():
    latest = latest_per_step([record("01", 9, 1), record("02", 5, 1), record("01", 8, 1)])
    assert [(r["candidate"]["name"], r["gate2"]["stats"]["candidate"]["median_ms"]) for r in latest] == \
        [("01", 8), ("02", 5)]


def test_chart_is_a_png_and_refuses_when_nothing_was_timed(tmp_path):
    rows = ladder_rows([record("01_naive", 200.0, 2.7), record("09_tuned", 3.1, 2.7)], "fp32")
    path = save_chart(rows, tmp_path / "c.png", title="t", library="cuBLAS")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from kforge.errors import KforgeError

    with pytest.raises(KforgeError, match="nothing to chart"):
        save_chart(ladder_rows([{"status": "crash", "candidate": {"name": "x"}}], "fp32"), tmp_path / "d.png",
                   title="t", library="cuBLAS")


@pytest.mark.slow
def test_replot_redraws_the_committed_h100_ladder_without_a_gpu(tmp_path):
    shutil.copy(H100_LADDER, tmp_path / "ladder.jsonl")
    done = kforge("ladder", "gemm", "--replot", "--results", "ladder.jsonl", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "10_tuned" in done.stdout and "% of cuBLAS SGEMM" in done.stdout
    assert (tmp_path / "ladder.png").is_file()


@pytest.mark.slow
def test_ladder_errors_are_one_line_and_exit_2(tmp_path):
    missing = kforge("ladder", "gemm", "--replot", "--results", "none.jsonl", cwd=tmp_path)
    assert missing.returncode == 2 and missing.stderr.startswith("error: nothing to replot")
    wrong = kforge("ladder", "gemm", "--dtype", "fp64", cwd=tmp_path)
    assert wrong.returncode == 2 and "no ladder 'gemm' for dtype 'fp64'" in wrong.stderr
    import torch

    if not torch.cuda.is_available():
        no_gpu = kforge("ladder", "gemm", cwd=tmp_path)
        assert no_gpu.returncode == 2 and "no CUDA device" in no_gpu.stderr
        assert "Traceback" not in no_gpu.stderr
        # and what the machine can do instead, for the command that was asked
        assert "`kforge resources` compiles the rungs" in no_gpu.stderr
        abstraction = kforge("ladder", "abstraction", cwd=tmp_path)
        assert abstraction.returncode == 2 and "--compile-only compiles every rung" in abstraction.stderr
        bench = kforge("bench", "attention", cwd=tmp_path)
        assert bench.returncode == 2 and "--replot redraws the chart" in bench.stderr and "rungs" not in bench.stderr


@pytest.mark.slow
def test_resources_reports_each_kernel_and_a_compile_error_is_one_line(tmp_path):
    good = tmp_path / "ok.cu"
    good.write_text('extern "C" __global__ void twice(float* x) { x[threadIdx.x] *= 2.f; }\n')
    bad = tmp_path / "bad.cu"
    bad.write_text('extern "C" __global__ void k(float* x) {\n  x[0] = nope;\n}\n')
    shown = kforge("resources", good, cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "twice" in shown.stdout and "registers" in shown.stdout
    failed = kforge("resources", bad, cwd=tmp_path)
    assert failed.returncode == 2
    assert failed.stderr.splitlines()[0] == 'error: bad.cu does not compile: bad.cu:2: error: identifier "nope" is undefined'
    # a Python file is not fed to NVRTC (33 lines of its errors, once)
    (tmp_path / "kernel.py").write_text("import triton\n")
    python = kforge("resources", "kernel.py", cwd=tmp_path)
    assert python.returncode == 2 and python.stderr.splitlines() == [
        "error: kernel.py is not a CUDA source (.cu): `kforge resources` compiles CUDA with NVRTC"]


def test_the_ladder_problem_takes_the_requested_size_and_refuses_unknown_constants():
    path = get_ladder("gemm", "fp32").problem
    problem = load_problem(path, "full", {"M": 96, "N": 80, "K": 64})
    assert problem.size == "M=96,N=80,K=64"
    import torch

    a, b = problem.make_inputs(0, torch.device("cpu"))
    assert a.shape == (96, 64) and b.shape == (64, 80)
    with pytest.raises(ProblemError, match="names 'Q'"):
        load_problem(path, "full", {"Q": 1})
    assert json.dumps(problem.tolerance)  # the ladder's own tolerance, not the fp32 default

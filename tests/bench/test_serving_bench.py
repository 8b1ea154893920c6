"""`kforge bench serving`: every problem file's eager Model against our kernel on CPU (gate 1
under Triton's interpreter, tiny sizes), the rows built from records (bytes over device
time, % of the copy ceiling, one row per shape from its two evaluations), the view, the
chart and the command line without a GPU."""

import os
import subprocess
import sys

import pytest

from kforge.bench.serving import (BASELINES, KERNELS, serving_groups, serving_jobs, serving_label, serving_rows,
                                  serving_shapes)
from kforge.harness.evaluate import evaluate
from kforge.harness.problem import load_problem
from kforge.harness.record import sealed_line
from kforge.ladder import source_candidate

SHAPES = serving_shapes()
ONE_PER_PROBLEM = list({s.problem: s for s in SHAPES}.values())
FLAGS = ("RESIDUAL", "HALF_SPLIT", "RAGGED", "CAUSAL")  # constants that change what is computed, kept at tiny size


def test_shapes_cover_every_kernel_of_the_issue_at_llama_sizes():
    groups = serving_groups(SHAPES)
    assert set(groups) == {"norms", "swiglu", "rope", "gemv", "paged", "norm_qkv", "varlen"}
    labels = [s.label for s in SHAPES]
    assert len(labels) == len(set(labels))
    assert "paged decode B=64 ctx=4096" in labels  # the issue's target shape
    assert {s.sizes.get("BATCH") for s in groups["gemv"]} == {1, 16}
    assert {s.sizes["M"] for s in groups["norm_qkv"]} == {1, 16, 4096}  # decode and prefill
    for shape in SHAPES:
        assert shape.problem.is_file() and (KERNELS / shape.kernel).is_file()


def test_every_shape_is_evaluated_against_eager_and_compiled():
    jobs = list(serving_jobs(SHAPES[:2]))
    assert [j.baseline for j in jobs] == list(BASELINES) * 2
    assert jobs[0].candidate.sha256 != jobs[2].candidate.sha256  # sizes are part of the identity


@pytest.mark.parametrize("shape", ONE_PER_PROBLEM, ids=lambda s: s.problem.stem)
@pytest.mark.slow
def test_our_kernel_passes_gate_1_against_the_problems_eager_model(shape, cpu, cpu_ceilings, fast_timing):
    problem = load_problem(shape.problem, "tiny", {k: v for k, v in shape.sizes.items() if k in FLAGS})
    candidate = source_candidate("ours", shape.ours, [shape.problem])
    record = evaluate(problem, candidate, device=cpu, ceilings=cpu_ceilings, timing=fast_timing)
    assert record.gate1["passed"], record.reason
    assert record.roofline["bytes"] > 0


def _record(shape_label, baseline, ours_ms, ours_device_ms, ref_ms, ref_device_ms, bytes_, status="passed"):
    shape = next(s for s in SHAPES if s.label == shape_label)
    size = load_problem(shape.problem, "full", shape.sizes).size
    return {"problem": {"name": shape.problem.stem, "size": size}, "baseline": baseline, "status": status,
            "device": {"name": "NVIDIA H100 80GB HBM3"},
            "gate2": {"speedup": ref_ms / ours_ms,
                      "stats": {"candidate": {"median_ms": ours_ms}, "reference": {"median_ms": ref_ms}},
                      "profile": {"candidate": {"median_device_ms": ours_device_ms},
                                  "reference": {"median_device_ms": ref_device_ms}}},
            "roofline": {"bytes": bytes_, "ceilings": {"copy_gbps": 3000.0}}}


def test_rows_compute_bandwidth_from_device_time_and_keep_both_baselines():
    label = "paged decode B=64 ctx=4096"
    records = [_record(label, "eager", 0.5, 0.5, 2.0, 2.0, 1_000_000_000),  # superseded below
               _record(label, "eager", 0.40, 0.36, 2.6, 2.6, 1_080_000_000),
               _record(label, "compile", 0.38, 0.38, 1.1, 1.1, 1_080_000_000),
               _record("gemv B=1 N=4096 K=4096", "eager", 0.030, 0.012, 0.028, 0.011, 33_570_816, "slower")]
    assert serving_label(records[0]) == label
    paged, gemv = serving_rows(records)
    assert paged.shape == label and paged.bytes == 1_080_000_000
    # our times: the medians over both evaluations' runs of our kernel
    assert paged.ours_device_ms == pytest.approx(0.37) and paged.ours_ms == pytest.approx(0.39)
    assert paged.gbps(paged.ours_device_ms) == pytest.approx(1.08e9 / 0.37e-3 / 1e9)
    assert paged.pct_of_copy(paged.ours_device_ms) == pytest.approx(100 * 1.08e9 / 0.37e-3 / 1e9 / 3000)
    assert paged.speedup == {"eager": pytest.approx(6.5), "compile": pytest.approx(1.1 / 0.38)}
    assert paged.baseline_ms == {"eager": 2.6, "compile": 1.1}
    assert gemv.status == {"eager": "slower"} and gemv.speedup.get("compile") is None


@pytest.mark.slow
def test_replot_draws_the_table_and_chart_without_a_gpu(tmp_path):
    results = tmp_path / "serving.jsonl"
    rows = [_record("swiglu 16384x14336", "eager", 0.50, 0.49, 1.20, 1.19, 1_409_286_144),
            _record("swiglu 16384x14336", "compile", 0.50, 0.49, 0.52, 0.51, 1_409_286_144)]
    results.write_text("".join(sealed_line(r) + "\n" for r in rows))
    done = subprocess.run([sys.executable, "-m", "kforge", "bench", "serving", "--replot", "--results", str(results)],
                          capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr
    assert "swiglu 16384x14336" in done.stdout and "2.40x" in done.stdout and "1.04x" in done.stdout
    assert "95.9%" in done.stdout  # 1.409 GB / 0.49 ms = 2,876 GB/s of 3,000
    assert results.with_suffix(".png").stat().st_size > 10_000


@pytest.mark.slow
def test_an_unknown_serving_group_is_one_line_and_exit_2(tmp_path):
    done = subprocess.run([sys.executable, "-m", "kforge", "bench", "serving", "--shapes", "norms,nope",
                           "--results", str(tmp_path / "x.jsonl")], capture_output=True, text=True)
    assert done.returncode != 0 and "unknown shape" in done.stderr and "Traceback" not in done.stderr


def test_results_markdown_gives_serving_its_own_table(tmp_path):
    from kforge.views import results_markdown

    device = tmp_path / "nvidia-h100"
    device.mkdir()
    rows = [_record("rope 16384 tok 32/8x128 interleaved", "eager", 0.133, 0.123, 2.5, 2.5, 344_064_000),
            _record("rope 16384 tok 32/8x128 interleaved", "compile", 0.133, 0.123, 0.349, 0.349, 344_064_000)]
    (device / "bench-serving.jsonl").write_text("".join(sealed_line(r) + "\n" for r in rows))
    text = results_markdown(tmp_path)
    line = next(x for x in text.splitlines() if x.startswith("| rope 16384 tok 32/8x128 interleaved"))
    assert "133 us (123 us)" in line and "93.2%" in line and "18.80x" in line and "2.62x" in line

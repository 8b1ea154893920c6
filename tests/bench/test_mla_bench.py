"""`kforge bench mla` without a GPU: FlashMLA's shapes, the label a record gets back, the
rows (shared with the serving bench) and the command line's replot and errors."""

import os
import subprocess
import sys

import pytest

from kforge.bench.mla import BASELINES, PROBLEM, mla_jobs, mla_label, mla_shapes
from kforge.bench.serving import serving_rows
from kforge.harness.problem import load_problem
from kforge.harness.record import sealed_line


def test_the_shapes_are_flashmlas_24_and_two_ragged_batches():
    shapes = mla_shapes()
    assert len(shapes) == 26 and len({s.label for s in shapes}) == 26
    dense = [s for s in shapes if not s.ragged]
    assert {(s.s_k, s.h_q, s.s_q) for s in dense} == {(k, h, q) for k in (4096, 8192, 16384)
                                                      for h in (16, 32, 64, 128) for q in (1, 2)}
    assert all(s.batch == 128 for s in shapes)


def _record(shape, baseline, ours_ms, ref_ms, bytes_):
    size = load_problem(PROBLEM, "full", shape.sizes).size
    return {"problem": {"name": PROBLEM.stem, "size": size}, "baseline": baseline, "status": "passed",
            "device": {"name": "NVIDIA H100 80GB HBM3"},
            "gate2": {"speedup": ref_ms / ours_ms,
                      "stats": {"candidate": {"median_ms": ours_ms}, "reference": {"median_ms": ref_ms}},
                      "profile": {"candidate": {"median_device_ms": ours_ms},
                                  "reference": {"median_device_ms": ref_ms}}},
            "roofline": {"bytes": bytes_, "ceilings": {"copy_gbps": 3000.0}}}


def test_a_record_gets_its_shape_back_and_one_row_holds_both_baselines():
    first, ragged = mla_shapes()[0], mla_shapes()[-1]
    records = [_record(first, "eager", 0.5, 2.0, 1_200_000_000), _record(first, "compile", 0.5, 1.0, 1_200_000_000),
               _record(ragged, "eager", 0.3, 0.9, 600_000_000)]
    assert [mla_label(r) for r in records] == [first.label, first.label, ragged.label]
    rows = serving_rows(records, mla_label)
    assert [r.shape for r in rows] == [first.label, ragged.label]
    assert rows[0].speedup == {"eager": pytest.approx(4.0), "compile": pytest.approx(2.0)}
    assert rows[0].pct_of_copy(rows[0].ours_device_ms) == pytest.approx(100 * 1.2e9 / 0.5e-3 / 1e9 / 3000)
    assert set(BASELINES) == {"eager", "compile"}


def test_every_shape_is_evaluated_against_eager_and_compiled():
    shapes = mla_shapes()[:2]
    jobs = list(mla_jobs(shapes))
    assert [(j.label, j.baseline) for j in jobs] == [(f"{s.label} vs {b}", b) for s in shapes for b in BASELINES]


@pytest.mark.slow
def test_replot_draws_the_table_without_a_gpu(tmp_path):
    results = tmp_path / "mla.jsonl"
    shape = mla_shapes()[0]
    rows = [_record(shape, "eager", 0.50, 1.20, 1_350_000_000), _record(shape, "compile", 0.50, 0.60, 1_350_000_000)]
    results.write_text("".join(sealed_line(r) + "\n" for r in rows))
    done = subprocess.run([sys.executable, "-m", "kforge", "bench", "mla", "--replot", "--results", str(results)],
                          capture_output=True, text=True, env={**os.environ, "COLUMNS": "220"})
    assert done.returncode == 0, done.stderr
    assert "MLA decode" in done.stdout and "2.40x" in done.stdout and "1.20x" in done.stdout
    assert "90.0%" in done.stdout  # 1.35 GB / 0.5 ms = 2,700 GB/s of 3,000


@pytest.mark.slow
def test_an_unknown_mla_shape_is_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "kforge", "bench", "mla", "--shapes", "mla B=1",
                           "--results", str(tmp_path / "x.jsonl")], capture_output=True, text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "unknown shape in 'mla B=1'" in done.stderr and "mla B=128 s_k=4096 h_q=16 s_q=1" in done.stderr

"""`kforge suite` on the built-in levels: `level1 --solutions builtin` runs kforge's own
solutions (here two of them, chosen with --only, at the tiny size, each in its own worker); --baseline both runs
every pair against eager PyTorch and against torch.compile and reports each; bad
arguments are one-line errors."""

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from kforge.cli import app
from kforge.errors import KforgeError
from kforge.harness.suite import FAST_P, SuiteRow, SuiteSummary


@pytest.fixture
def cli(tmp_path, cpu, cpu_ceilings):
    """Runs kforge in tmp_path, with the CPU's ceilings already cached (no measuring)."""
    from kforge.harness.roofline import save_ceilings

    cache = tmp_path / "kforge-cache"
    os.environ["KFORGE_CACHE_DIR"] = str(cache)
    save_ceilings(cpu, cpu_ceilings)
    env = {**os.environ, "KFORGE_CACHE_DIR": str(cache), "COLUMNS": "200"}
    return lambda *args: subprocess.run([sys.executable, "-m", "kforge", *args], cwd=tmp_path, env=env,
                                        capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_builtin_level1_runs_the_chosen_problems_with_kforges_solutions(cli, tmp_path):
    done = cli("suite", "level1", "--solutions", "builtin", "--only", "transpose_bf16,matmul_fp32",
               "--time-budget", "0.1", "--json")
    scores = json.loads(done.stdout)
    rows = {row["name"]: row for row in scores["rows"]}
    assert set(rows) == {"transpose_bf16", "matmul_fp32"}  # only those, from the package's level1 folder
    assert all(row["status"] in ("passed", "tie", "slower") and row["speedup"] > 0 for row in rows.values()), rows
    # 0 only when every pair passed; on a CPU an interpreted kernel may well be slower
    assert done.returncode == (0 if all(row["status"] == "passed" for row in rows.values()) else 1), done.stderr
    assert scores["fast_p"]["fast_0"] == 1.0 and scores["ran"] == 2
    records = [json.loads(line) for line in (tmp_path / "kforge-suite.jsonl").read_text().splitlines()]
    assert {r["problem"]["size"] for r in records} == {"tiny"} and {r["baseline"] for r in records} == {"eager"}
    assert all(r["candidate"]["path"].endswith(f"solutions/level1/{r['problem']['name']}.py") for r in records)


def test_bad_suite_arguments_are_refused_before_anything_runs(tmp_path):
    # KforgeError: `kforge` prints its reason as one line and exits with status 2
    unknown = CliRunner().invoke(app, ["suite", "level1", "--solutions", "builtin", "--only",
                                       "transpose_bf16,no_such_problem"])
    assert isinstance(unknown.exception, KforgeError)
    assert "--only names no problem" in unknown.exception.reason and "no_such_problem" in unknown.exception.reason
    folder = CliRunner().invoke(app, ["suite", str(tmp_path), "--solutions", "builtin"])
    assert isinstance(folder.exception, KforgeError)
    assert "--solutions builtin needs PROBLEMS to be one of level1" in folder.exception.reason


def _summary(speedup: float) -> SuiteSummary:
    row = SuiteRow("transpose_bf16", "passed" if speedup > 1 else "slower", speedup=speedup, reference_ms=1.0,
                   candidate_ms=1.0 / speedup)
    return SuiteSummary(rows=[row], fast_p={p: float(speedup > p) for p in FAST_P}, geomean_speedup=speedup, ran=1)


def test_baseline_both_runs_each_pair_against_eager_then_compile_and_reports_both(monkeypatch, tmp_path):
    calls = []

    def fake_run_suite(pairs, store, *, options, **kwargs):
        calls.append((tuple(pair.name for pair in pairs), store.path, options["baseline"]))
        return _summary(1.7 if options["baseline"] == "eager" else 0.9)

    monkeypatch.setattr("kforge.harness.suite.run_suite", fake_run_suite)
    store = tmp_path / "both.jsonl"
    args = ["suite", "level1", "--solutions", "builtin", "--only", "transpose_bf16", "--baseline", "both",
            "--results", str(store)]
    shown = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert shown.exit_code == 1, shown.output  # slower against torch.compile: not every pair passed
    assert calls == [(("transpose_bf16",), store, "eager"), (("transpose_bf16",), store, "compile")]
    eager, compiled = shown.output.split("against torch.compile")
    assert "against eager PyTorch" in eager and "fast_1 = 1.00" in eager and "1.700x" in eager
    assert "fast_1 = 0.00" in compiled and "0.900x" in compiled

    as_json = CliRunner().invoke(app, [*args, "--json"])
    assert as_json.exit_code == 1
    scores = json.loads(as_json.output)["baselines"]
    assert scores["eager"]["geomean_speedup"] == 1.7 and scores["compile"]["fast_p"]["fast_1"] == 0.0

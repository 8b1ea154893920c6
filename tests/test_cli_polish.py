"""The command line's manners: --version, one error style, a spinner only where it helps,
--json on every command that prints a result, tables that fit 80 columns, a suite that CI
can hold to a fast_1, result files in one place, a wrong shape named as such, charts
that degrade without matplotlib, and the interpreter's loop bounds under any numpy."""

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console
from rich.table import Table
from typer.testing import CliRunner

import kforge.cli as cli
from conftest import FIXTURES
from kforge.cli import app
from kforge.fit import Fitted
from kforge.harness.suite import FAST_P, SuiteRow, SuiteSummary

REPO = Path(__file__).parent.parent
ROW_SUMS = FIXTURES / "problems" / "row_sums.py"
H100 = REPO / "benchmarks" / "results" / "nvidia-h100-80gb-hbm3"
SUM_ROWS = "import torch\nclass ModelNew(torch.nn.Module):\n    def forward(self, x):\n        return x.sum(dim=1)\n"


def kforge(*args, cwd, env=None):
    """`python -m kforge ARGS` in CWD, stdout and stderr pipes (not a terminal), 80 columns."""
    env = {**os.environ, "COLUMNS": "80", **(env or {})}
    return subprocess.run([sys.executable, "-m", "kforge", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def run_main(monkeypatch, capsys, *args) -> tuple[int, str, str]:
    """kforge's console entry point in this process: (exit status, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["kforge", *map(str, args)])
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit) as exited:
        cli.main()
    captured = capsys.readouterr()
    return exited.value.code, captured.out, captured.err


@pytest.fixture
def cached_ceilings(cpu, cpu_ceilings):
    from kforge.harness.roofline import save_ceilings

    save_ceilings(cpu, cpu_ceilings)  # into the test's KFORGE_CACHE_DIR (conftest): nothing is measured


def test_version_names_kforge_torch_and_triton(monkeypatch, capsys):
    status, stdout, stderr = run_main(monkeypatch, capsys, "--version")
    assert status == 0, stderr
    assert stdout.startswith("kforge 0.1.0 (torch ") and f"torch {torch.__version__}" in stdout
    assert "triton " in stdout and stderr == ""


@pytest.mark.parametrize("args, message", [
    (["eval", ROW_SUMS, ROW_SUMS, "--trials", "2"], "error: Invalid value for '--trials'"),
    (["no-such-command"], "error: No such command 'no-such-command'."),
    (["--no-such-option"], "error: No such option: --no-such-option"),
    (["eval"], "error: Missing argument 'problem'."),
    (["suite", "level1", "--solutions", "builtin", "--require-fast-1", "1.5"],
     "error: Invalid value for '--require-fast-1'"),
])
def test_a_usage_error_is_one_error_line_and_exit_2(monkeypatch, capsys, args, message):
    status, _, stderr = run_main(monkeypatch, capsys, *args)
    assert status == 2
    assert stderr.count("\n") == 1 and stderr.startswith(message), stderr
    assert "Usage:" not in stderr and "Error:" not in stderr and "Traceback" not in stderr
    assert "--help" in stderr  # where to look next


def test_an_unusable_input_uses_the_same_style(monkeypatch, capsys, tmp_path):
    status, _, stderr = run_main(monkeypatch, capsys, "eval", ROW_SUMS, tmp_path / "nope.py")
    assert status == 2 and stderr.startswith("error: candidate file not found")


def test_a_folder_given_for_a_file_is_named_as_a_folder(monkeypatch, capsys, tmp_path):
    status, _, stderr = run_main(monkeypatch, capsys, "eval", tmp_path, ROW_SUMS)
    assert status == 2 and stderr.count("\n") == 1, stderr
    assert stderr.startswith(f"error: problem {tmp_path} is a folder: an evaluation takes one file"), stderr


def test_the_console_command_prints_a_usage_error_in_one_line(tmp_path):
    done = kforge("eval", "--no-such-option", cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.startswith("error: No such option: --no-such-option"), done.stderr
    assert done.stderr.count("\n") == 1 and done.stdout == ""


def test_help_documents_the_exit_statuses_and_the_results_folder():
    for args in ([], ["eval"], ["suite"]):
        shown = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "200"})
        assert shown.exit_code == 0 and "Exit status" in shown.output, args
    top = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "200"}).output
    assert "KFORGE_RESULTS_DIR" in top and "./kforge-results/" in top and "--version" in top and "--quiet" in top


def test_eval_results_go_to_the_results_folder(tmp_path, write, cached_ceilings, monkeypatch, capsys):
    candidate = write("fast.py", SUM_ROWS)
    args = ["eval", ROW_SUMS, candidate, "--in-process", "--time-budget", "0.1", "--json"]
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("KFORGE_RESULTS_DIR")
    status, stdout, stderr = run_main(monkeypatch, capsys, *args)
    assert json.loads(stdout)["gate1"]["passed"], stderr
    assert (tmp_path / "kforge-results" / "kforge-results.jsonl").is_file()  # ./kforge-results/ by default
    assert not (tmp_path / "kforge-results.jsonl").exists()
    assert stderr == ""  # --json and not a terminal: no spinner, no progress line
    elsewhere = tmp_path / "elsewhere"
    monkeypatch.setenv("KFORGE_RESULTS_DIR", str(elsewhere))
    status, stdout, stderr = run_main(monkeypatch, capsys, *args)
    assert (elsewhere / "kforge-results.jsonl").is_file(), stderr


def test_the_results_folder_is_ignored_by_git():
    ignore = (REPO / ".gitignore").read_text().splitlines()
    assert "/kforge-results/" in ignore and cli.DEFAULT_RESULTS_DIR == Path("kforge-results")


def _terminal(monkeypatch) -> io.StringIO:
    """Make kforge's stderr console a terminal that writes into the returned buffer."""
    buffer = io.StringIO()
    monkeypatch.setattr(cli, "err", Console(file=buffer, force_terminal=True, width=80))
    return buffer


def test_eval_shows_a_spinner_on_a_terminal_unless_json_or_quiet(tmp_path, write, cached_ceilings, monkeypatch):
    candidate = write("fast.py", SUM_ROWS)
    args = ["eval", str(ROW_SUMS), str(candidate), "--in-process", "--time-budget", "0.1", "--no-save"]
    shown = _terminal(monkeypatch)
    done = CliRunner().invoke(app, args)
    assert done.exit_code in (0, 1), done.output
    assert "evaluating fast.py against row_sums.py" in shown.getvalue()
    for extra in (["--json"], ["--quiet"]):
        quiet = _terminal(monkeypatch)
        argv = [*extra, *args] if extra == ["--quiet"] else [*args, *extra]
        done = CliRunner().invoke(app, argv)
        assert done.exit_code in (0, 1), done.output
        assert "evaluating" not in quiet.getvalue(), extra


def test_a_wrong_shape_names_the_shapes_not_zero_errors(monkeypatch, capsys, write, cached_ceilings):
    candidate = write("wrong_shape.py", SUM_ROWS.replace("dim=1", "dim=0"))
    status, stdout, _ = run_main(monkeypatch, capsys, "eval", ROW_SUMS, candidate, "--in-process", "--no-save")
    assert status == 1
    gate1 = next(line for line in stdout.splitlines() if line.startswith("gate 1"))
    assert "FAIL" in gate1 and "max abs err" not in stdout and "mismatched" not in stdout
    assert "has shape (16,)" in " ".join(stdout.split()) and "expected (8,)" in stdout


def _summary(speedups: list[float]) -> SuiteSummary:
    rows = [SuiteRow(f"p{i}", "passed" if s > 1 else "slower", speedup=s, reference_ms=1.0, candidate_ms=1 / s)
            for i, s in enumerate(speedups)]
    fast_p = {p: sum(s > p for s in speedups) / len(speedups) for p in FAST_P}
    return SuiteSummary(rows=rows, fast_p=fast_p, geomean_speedup=None, ran=len(rows))


@pytest.mark.parametrize("speedups, require, status", [
    ([1.5, 0.9], None, 1),  # not every pair passed
    ([1.5, 0.9], "0.5", 0),  # fast_1 = 0.5: enough
    ([1.5, 0.9], "0.6", 1),
    ([1.5, 1.2], None, 0),
    ([1.5, 1.2], "1", 0),
])
def test_suite_require_fast_1_sets_the_exit_status(monkeypatch, tmp_path, speedups, require, status):
    monkeypatch.setattr("kforge.harness.suite.run_suite", lambda *args, **kwargs: _summary(speedups))
    args = ["suite", "level1", "--solutions", "builtin", "--only", "transpose_bf16", "--json"]
    done = CliRunner().invoke(app, args + (["--require-fast-1", require] if require else []))
    assert done.exit_code == status, done.output
    assert json.loads(done.output)["fast_p"]["fast_1"] == sum(s > 1 for s in speedups) / len(speedups)


def test_suite_require_fast_1_holds_for_each_baseline(monkeypatch):
    monkeypatch.setattr("kforge.harness.suite.run_suite", lambda *args, options, **kwargs:
                        _summary([1.5, 1.2] if options["baseline"] == "eager" else [1.5, 0.9]))
    args = ["suite", "level1", "--solutions", "builtin", "--only", "transpose_bf16", "--baseline", "both", "--json"]
    assert CliRunner().invoke(app, [*args, "--require-fast-1", "0.5"]).exit_code == 0
    assert CliRunner().invoke(app, [*args, "--require-fast-1", "0.75"]).exit_code == 1  # compile: 0.5


def test_suite_results_default_to_the_results_folder(monkeypatch, tmp_path):
    stores = []
    monkeypatch.setattr("kforge.harness.suite.run_suite",
                        lambda pairs, store, **kwargs: stores.append(store.path) or _summary([1.5]))
    monkeypatch.setenv("KFORGE_RESULTS_DIR", str(tmp_path / "results"))
    CliRunner().invoke(app, ["suite", "level1", "--solutions", "builtin", "--only", "transpose_bf16"])
    assert stores == [tmp_path / "results" / "kforge-suite.jsonl"]


# --- tables at 80 columns -----------------------------------------------------------------

def _render(view, width: int = 80) -> str:
    console = Console(file=io.StringIO(), width=width, force_terminal=False, color_system=None)
    console.print(Fitted(view))
    return console.file.getvalue()


def test_a_table_that_fits_once_wrapped_keeps_every_name_and_number_whole():
    table = Table(title="t")
    for header in ("rung", "status", "time", "GFLOP/s", "% of cuBLAS SGEMM", "% of peak", "step"):
        table.add_column(header)
    table.add_row("07_double_buffered", "correct, slower", "3.45 ms", "39,884", "76.8%", "59.5%", "1.41x")
    text = _render(table)
    assert all(len(line) <= 80 for line in text.splitlines())
    assert "…" not in text
    for whole in ("07_double_buffered", "3.45 ms", "39,884", "76.8%", "1.41x"):
        assert whole in text


def test_a_table_too_wide_for_80_columns_becomes_one_record_per_row():
    table = Table(title="wide")
    headers = [f"column {i}" for i in range(12)]
    for header in headers:
        table.add_column(header)
    table.add_row("first row", *[f"{1000 * i:,} us" for i in range(1, 12)])
    table.add_row("", *[f"{i}.5x" for i in range(1, 12)])
    text = _render(table)
    assert all(len(line) <= 80 for line in text.splitlines()) and "…" not in text
    assert text.splitlines()[1] == "first row"
    flat = " ".join(text.split())
    assert "column 1 1,000 us · column 2 2,000 us" in flat and "column 11 11,000 us" in flat
    assert "column 11 11.5x" in flat


def test_a_narrow_table_is_left_as_it_is():
    table = Table()
    table.add_column("a")
    table.add_row("1")
    assert _render(table) == _render_plain(table)


def _render_plain(view) -> str:
    console = Console(file=io.StringIO(), width=80, force_terminal=False, color_system=None)
    console.print(view)
    return console.file.getvalue()


@pytest.mark.skipif(not (H100 / "ladder-gemm-fp32.jsonl").is_file(), reason="no H100 ladder records")
def test_ladder_replot_at_80_columns_and_as_json(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # the chart is another test's
    args = ["ladder", "gemm", "--replot", "--results", H100 / "ladder-gemm-fp32.jsonl"]
    status, stdout, stderr = run_main(monkeypatch, capsys, *args)
    assert status == 0, stderr
    assert all(len(line) <= 80 for line in stdout.splitlines()) and "…" not in stdout
    assert "07_double_buffered" in stdout and "10_tuned" in stdout
    status, stdout, stderr = run_main(monkeypatch, capsys, *args, "--json")
    rows = json.loads(stdout)["rows"]
    assert [row["label"] for row in rows][:2] == ["01_naive", "02_coalesced"] and rows[0]["gflops"] > 0


@pytest.mark.slow  # a subprocess each, and each family's kernels imported
@pytest.mark.skipif(not (H100 / "bench-serving.jsonl").is_file(), reason="no H100 bench records")
@pytest.mark.parametrize("family", ["gemm", "serving", "quant", "attention"])
def test_bench_replot_fits_80_columns_and_has_json(tmp_path, family):
    records = H100 / f"bench-{family}.jsonl"
    if not records.is_file():
        pytest.skip(f"no {records.name}")
    args = ["bench", family, "--replot", "--results", records, "--chart", tmp_path / "b.png"]
    shown = kforge(*args, cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert all(len(line) <= 80 for line in shown.stdout.splitlines()) and "…" not in shown.stdout
    rows = json.loads(kforge(*args, "--json", cwd=tmp_path).stdout)["rows"]
    assert rows and all(isinstance(row, dict) for row in rows)


def test_charts_degrade_to_one_line_without_matplotlib(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    shown = _terminal(monkeypatch)
    chart = tmp_path / "l.png"
    done = CliRunner().invoke(app, ["ladder", "gemm", "--replot", "--results", str(H100 / "ladder-gemm-fp32.jsonl"),
                                    "--chart", str(chart)], env={"COLUMNS": "200"})
    assert done.exit_code == 0, done.output
    assert "01_naive" in done.output and not chart.exists()
    assert shown.getvalue().strip() == "note: no chart: matplotlib is not installed (pip install 'kforge[plot]')"


@pytest.mark.parametrize("args, check", [
    (["trace", "online-softmax", "--tiles", "1,3", "2,5", "--json"], lambda v: v["agrees"] is True),
    (["trace", "accumulate", "--terms", "8", "--json"], lambda v: len(v) == 8),
    (["roofline", "--json"], lambda v: "copy_gbps" in v),
])
def test_json_where_a_command_prints_a_result(args, check, cached_ceilings):
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 0, done.output
    assert check(json.loads(done.output))


# --- the interpreter's loop bounds under numpy 2.3+ ---------------------------------------

def test_a_loop_bound_from_a_scalar_argument_runs_under_the_interpreter():
    from kforge.runtime.interpreter import interpreter_active

    if not interpreter_active():
        pytest.skip("Triton compiles here: no interpreter")
    import triton
    import triton.language as tl

    @triton.jit
    def row_sums(x_ptr, out_ptr, K, BK: tl.constexpr):
        row = tl.program_id(0)
        acc = tl.zeros([BK], dtype=tl.float32)
        for k in range(0, K, BK):  # K arrives as a 1-element array: numpy 2.3 refused int() of it
            offsets = k + tl.arange(0, BK)
            acc += tl.load(x_ptr + row * K + offsets, mask=offsets < K, other=0.0)
        tl.store(out_ptr + row, tl.sum(acc, axis=0))

    x = torch.randn(3, 70)
    out = torch.empty(3)
    row_sums[(3,)](x, out, x.shape[1], BK=32)
    torch.testing.assert_close(out, x.sum(dim=1), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("triton_version, numpy_version, needed", [
    ("3.6.0", "2.4.6", True), ("3.6.0", "2.2.6", False), ("3.7.1", "2.4.6", False), ("3.5.1", "2.3.0", True),
    (None, "2.4.6", False),
])
def test_the_loop_bound_mend_is_applied_only_where_needed(monkeypatch, triton_version, numpy_version, needed):
    from importlib import metadata

    from kforge.runtime import interpreter

    def version(name):
        found = {"triton": triton_version, "numpy": numpy_version}[name]
        if found is None:
            raise metadata.PackageNotFoundError(name)
        return found

    monkeypatch.setattr(metadata, "version", version)
    assert interpreter.scalar_index_needs_mending() is needed

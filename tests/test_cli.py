"""`kforge` as a user runs it: exit statuses, one-line errors, records, --json."""

import json
import os
import subprocess
import sys

import pytest

from conftest import FIXTURES


def kforge(*args, cwd, env_extra=None):
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "kforge", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture
def cli(tmp_path, cpu, cpu_ceilings):
    """Runs kforge in tmp_path, with the CPU's ceilings already cached (no measuring)."""
    from kforge.harness.roofline import save_ceilings

    cache = tmp_path / "kforge-cache"
    os.environ["KFORGE_CACHE_DIR"] = str(cache)
    save_ceilings(cpu, cpu_ceilings)
    return lambda *args: kforge(*args, cwd=tmp_path, env_extra={"KFORGE_CACHE_DIR": str(cache)})


ROW_SUMS = FIXTURES / "problems" / "row_sums.py"


@pytest.mark.slow
def test_a_correct_candidate_exits_with_its_verdict_and_the_record_is_appended(cli, write, tmp_path):
    # Which verdict a shared CPU's clock gives is not the point (gate 2's logic is tested on
    # scripted timings): the exit status is the record's, and every run appends its record.
    candidate = write("fast.py", "import torch\nclass ModelNew(torch.nn.Module):\n"
                                 "    def forward(self, x):\n        return x.sum(dim=1)\n")
    runs = [cli("eval", ROW_SUMS, candidate, "--time-budget", "0.3", "--size", "full") for _ in range(2)]
    records = [json.loads(line) for line in (tmp_path / "kforge-results.jsonl").read_text().splitlines()]
    assert len(records) == 2
    for result, record in zip(runs, records):
        assert record["gate1"]["passed"] and record["status"] in ("passed", "tie", "slower"), record["reason"]
        assert result.returncode == (0 if record["status"] == "passed" else 1), result.stdout + result.stderr
        assert record["status"].upper() in result.stdout and "gate 1" in result.stdout and "of roof" in result.stdout
        assert "95% interval" in result.stdout
    assert records[0]["command"].startswith("kforge eval")


@pytest.mark.slow
def test_a_failed_gate_exits_1(cli, write):
    candidate = write("wrong.py", "import torch\nclass ModelNew(torch.nn.Module):\n"
                                  "    def forward(self, x):\n        return x.sum(dim=1) + 1\n")
    result = cli("eval", ROW_SUMS, candidate)
    assert result.returncode == 1 and "INCORRECT" in result.stdout


@pytest.mark.slow
def test_an_unusable_candidate_exits_2_with_a_one_line_reason(cli, write):
    candidate = write("broken.py", "import torch\nclass ModelNew(torch.nn.Module):\n"
                                   "    def forward(self, x):\n        return undefined_name\n")
    result = cli("eval", ROW_SUMS, candidate)
    assert result.returncode == 2
    assert "CANDIDATE ERROR" in result.stdout and "NameError" in result.stdout and "broken.py:4" in result.stdout


@pytest.mark.slow
def test_a_candidates_words_are_printed_as_text_not_markup(cli, write):
    # rich markup in an error message once crashed the verdict's table (and then the internal
    # error's handler, on the same text): exit 1 and a traceback where a candidate error is 2
    candidate = write("markup.py", "import torch\nclass ModelNew(torch.nn.Module):\n"
                                   "    def forward(self, x):\n"
                                   "        raise RuntimeError('[/] [bold]not bold[/bold]')\n")
    result = cli("eval", ROW_SUMS, candidate)
    assert result.returncode == 2, result.stderr
    assert "CANDIDATE ERROR" in result.stdout and "[/] [bold]not bold[/bold]" in " ".join(result.stdout.split())
    assert "Traceback" not in result.stderr


def test_a_results_path_that_is_a_folder_is_refused_before_anything_runs(cli, tmp_path):
    # (once: a whole evaluation, then an IsADirectoryError as an internal error, the record lost)
    folder = tmp_path / "records"
    folder.mkdir()
    result = cli("eval", ROW_SUMS, ROW_SUMS, "--results", folder)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"Invalid value for '--results': file '{folder}' is a directory" in result.stderr
    assert list(folder.iterdir()) == []


@pytest.mark.slow
def test_a_missing_file_exits_2_without_a_traceback_or_a_record(cli, tmp_path):
    result = cli("eval", ROW_SUMS, tmp_path / "nope.py")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[0] == f"error: candidate file not found: {tmp_path / 'nope.py'}"
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "kforge-results.jsonl").exists()


@pytest.mark.slow
def test_a_bad_option_exits_2(cli, write):
    result = cli("eval", ROW_SUMS, ROW_SUMS, "--trials", "2")
    assert result.returncode == 2 and "Traceback" not in result.stderr


@pytest.mark.slow
def test_json_prints_only_the_record(cli, write, tmp_path):
    candidate = write("fast.py", "import torch\nclass ModelNew(torch.nn.Module):\n"
                                 "    def forward(self, x):\n        return x.sum(dim=1)\n")
    result = cli("eval", ROW_SUMS, candidate, "--json", "--no-save", "--time-budget", "0.2")
    record = json.loads(result.stdout)
    # (the verdict is a shared CPU's clock's: a tie in 1 of 10 runs under load; the exit status follows it)
    assert record["status"] in ("passed", "tie", "slower") and result.returncode == (record["status"] != "passed")
    assert record["gate1"]["passed"] and record["problem"]["size"] == "tiny"
    assert not (tmp_path / "kforge-results.jsonl").exists()


@pytest.mark.slow
def test_roofline_shows_the_cached_ceilings_and_the_datasheet_table(cli):
    result = cli("roofline")
    assert result.returncode == 0, result.stderr
    assert "copy bandwidth" in result.stdout and "H100 SXM" in result.stdout and "989" in result.stdout


@pytest.mark.slow
def test_report_regenerates_markdown_from_the_records(cli, tmp_path, write):
    from kforge.harness.evaluate import evaluate
    from kforge.harness.record import append_record
    from kforge.harness.timing import TimingConfig

    candidate = write("fast.py", "import torch\nclass ModelNew(torch.nn.Module):\n"
                                 "    def forward(self, x):\n        return x.sum(dim=1)\n")
    record = evaluate(ROW_SUMS, candidate, timing=TimingConfig(budget_s=0.2), command="kforge eval row_sums.py fast.py")
    append_record(tmp_path / "results" / "some-device" / "bench.jsonl", record)
    result = cli("report", tmp_path / "results", "-o", tmp_path / "RESULTS.md")
    assert result.returncode == 0, result.stderr
    text = (tmp_path / "RESULTS.md").read_text()
    assert "## some-device" in text and "### bench" in text
    assert f"{record.speedup:.3f}x" in text and "kforge eval row_sums.py fast.py" in text
    # without -o: RESULTS.md in the results folder ($KFORGE_RESULTS_DIR here), never in the repository
    default = kforge("report", tmp_path / "results", cwd=tmp_path,
                     env_extra={"KFORGE_RESULTS_DIR": str(tmp_path / "out")})
    assert default.returncode == 0 and (tmp_path / "out" / "RESULTS.md").read_text() == text, default.stderr


@pytest.mark.slow
def test_a_crashing_candidate_is_reported_and_kforge_survives(cli, tmp_path):
    result = cli("eval", FIXTURES / "problems" / "add.py", FIXTURES / "candidates" / "crash_segfault.py")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "CRASH" in result.stdout and "SIGSEGV" in result.stdout
    assert '"status": "crash"' in (tmp_path / "kforge-results.jsonl").read_text()


@pytest.mark.slow
def test_a_fixed_seed_needs_the_in_process_mode(cli):
    result = cli("eval", ROW_SUMS, ROW_SUMS, "--seed", "3")
    assert result.returncode == 2 and "--seed needs --in-process" in result.stderr


@pytest.mark.slow
def test_report_names_each_rejected_line_in_one_warning_line(tmp_path):
    from kforge.harness.record import EvalRecord, append_record

    store = tmp_path / "results" / "some-device" / "bench.jsonl"
    for status in ("passed", "slower"):
        append_record(store, EvalRecord(status=status, problem={"name": f"p_{status}"}, candidate={"name": "c"},
                                        device={}, versions={}))
    lines = store.read_text().splitlines()
    lines[1] = lines[1].replace('"status": "slower"', '"status": "passed"')  # an edited record
    store.write_text("\n".join(lines) + '\n{"status": "pass')  # and a torn last line
    result = kforge("report", tmp_path / "results", "-o", tmp_path / "RESULTS.md", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert warnings == [f"warning: {store} line 2: checksum mismatch (edited or forged); left out",
                        f"warning: {store} line 3: torn line (not JSON); left out"]
    text = (tmp_path / "RESULTS.md").read_text()
    assert "p_passed" in text and "p_slower" not in text


ADD = FIXTURES / "problems" / "add.py"
HANG_IN_GATE1 = ("import torch\nclass ModelNew(torch.nn.Module):\n"
                 "    def forward(self, a, b):\n        while True:\n            pass\n")


@pytest.mark.slow  # a hang to wait out in each stage
@pytest.mark.parametrize("stage, candidate", [
    ("load", FIXTURES / "candidates" / "hang_import.py"),
    ("gate1", None),
    ("gate2", FIXTURES / "candidates" / "hang_timed.py"),
])
def test_stage_timeout_ends_a_hang_in_any_stage_naming_it(cli, write, tmp_path, stage, candidate):
    import time

    candidate = candidate or write("hang_gate1.py", HANG_IN_GATE1)
    started = time.monotonic()
    result = cli("eval", ADD, candidate, "--stage-timeout", "3", "--time-budget", "0.5", "--size", "full", "--json")
    elapsed = time.monotonic() - started
    record = json.loads(result.stdout)
    assert result.returncode == 2 and record["status"] == "timeout", result.stdout[-500:] + result.stderr[-500:]
    assert record["reason"].startswith(f"{stage} ran past its"), record["reason"]
    # 3 s (+ the 0.5 s budget in gate 2) plus starting Python and torch twice: well under 60 s
    assert elapsed < 60, elapsed


@pytest.mark.slow
def test_stage_timeout_cannot_be_used_in_process(cli):
    result = cli("eval", ADD, ADD, "--stage-timeout", "3", "--in-process")
    assert result.returncode == 2 and "--stage-timeout needs a worker" in result.stderr


@pytest.mark.parametrize("value, message", [
    ("fast", "--worker-cpu takes auto, none or a CPU number, not 'fast'"),
    ("100000", "worker CPU 100000 is not one this process may use"),
])
def test_a_worker_cpu_that_cannot_be_used_is_a_one_line_error(cli, value, message):
    result = cli("eval", ADD, ADD, "--worker-cpu", value)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_the_worker_cpu_reaches_the_record(cli):
    cpu = max(os.sched_getaffinity(0))
    candidate = FIXTURES / "candidates" / "held_to_one_cpu.py"  # fails unless its worker is on one CPU
    result = cli("eval", ADD, candidate, "--worker-cpu", str(cpu), "--time-budget", "0.3", "--json", "--no-save")
    record = json.loads(result.stdout)
    assert record["gate1"]["passed"], record["reason"]
    assert record["gate2"]["worker_cpus"] == [cpu], record["reason"]

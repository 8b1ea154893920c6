"""Suites: fast_p as KernelBench defines it, a store that survives SIGKILL, resumption."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import FIXTURES
from kforge.errors import KforgeError
from kforge.harness.isolation import StageLimits
from kforge.harness.suite import CORRECT_STATUSES, Pair, ResultStore, discover, run_suite, summarize
from kforge.harness.timing import TimingConfig


def record(status, speedup=None):
    rec = {"status": status, "defences": [], "reason": None, "gate2": None, "roofline": None}
    if speedup is not None:
        rec["gate2"] = {"speedup": speedup, "stats": {"reference": {"median_ms": speedup}, "candidate": {"median_ms": 1.0}}}
    return rec


def test_fast_p_counts_correct_and_strictly_faster_over_all_problems(tmp_path):
    pairs = [Pair(name, tmp_path / f"{name}.py", tmp_path / f"s_{name}.py") for name in "abcdef"]
    pairs.append(Pair("g", tmp_path / "g.py", None))  # no solution: counts as a failure
    statuses = {"a": record("passed", 2.5), "b": record("passed", 1.5), "c": record("passed", 1.2),
                "d": record("slower", 0.8), "e": record("incorrect"),
                "f": record("faster_than_hardware", 40.0)}
    keys = {name: f"k{name}" for name in statuses}
    summary = summarize(pairs, keys, {f"k{name}": rec for name, rec in statuses.items()})
    assert summary.correct == 4  # passed x3 and slower: gate 1 passed, no defence fired
    assert summary.fast_p == {0.0: 4 / 7, 1.0: 3 / 7, 1.5: 1 / 7, 2.0: 1 / 7}  # 1.5x is not > 1.5
    assert summary.geomean_speedup == pytest.approx((2.5 * 1.5 * 1.2 * 0.8) ** 0.25)
    assert [row.status for row in summary.rows][-1] == "missing"


def test_discover_matches_solutions_by_file_name(tmp_path):
    (tmp_path / "p").mkdir()
    (tmp_path / "s").mkdir()
    for name in ("one.py", "two.py", "_helper.py"):
        (tmp_path / "p" / name).write_text("")
    (tmp_path / "s" / "two.py").write_text("")
    pairs = discover(tmp_path / "p", tmp_path / "s")
    assert [(p.name, p.candidate is not None) for p in pairs] == [("one", False), ("two", True)]
    with pytest.raises(KforgeError, match=r"one.py is a file: a suite takes a problems folder"):
        discover(tmp_path / "p" / "one.py", tmp_path / "s")
    with pytest.raises(KforgeError, match=r"no solutions folder: .*/nowhere"):
        discover(tmp_path / "p", tmp_path / "nowhere")


def make_suite(tmp_path, solutions: dict[str, str]):
    """problems/NAME.py copied from fixtures, solutions/NAME.py from fixture candidates."""
    problems, sols = tmp_path / "problems", tmp_path / "solutions"
    problems.mkdir()
    sols.mkdir()
    for name, (problem, candidate) in solutions.items():
        shutil.copy(FIXTURES / "problems" / f"{problem}.py", problems / f"{name}.py")
        shutil.copy(FIXTURES / "candidates" / f"{candidate}.py", sols / f"{name}.py")
    return problems, sols


@pytest.mark.slow
def test_crashing_hanging_and_oom_candidates_leave_the_suite_running(tmp_path, cpu, cpu_ceilings):
    problems, sols = make_suite(tmp_path, {
        "a_crash": ("add", "crash_segfault"), "b_hang": ("add", "hang_timed"), "c_oom": ("add", "oom"),
        "d_fine": ("row_sums", "vectorized_row_sums"),
    })
    store = ResultStore(tmp_path / "suite.jsonl")
    options = dict(timing=TimingConfig(budget_s=0.3), ceilings=cpu_ceilings, size="full",
                   limits=StageLimits(load_s=20, gate1_s=20, gate2_s=5))
    summary = run_suite(discover(problems, sols), store, slots=[None], device_name=cpu.name, options=options)
    # (the fine pair's verdict is a shared CPU's clock's: a tie in 5 of 15 runs under load)
    assert [row.status for row in summary.rows][:3] == ["crash", "timeout", "oom"]
    assert summary.rows[3].status in CORRECT_STATUSES, summary.rows[3]
    assert summary.ran == 4 and len(store.latest()) == 4


SUITE_CMD = [sys.executable, "-m", "kforge", "suite", "problems", "--solutions", "solutions",
             "--time-budget", "0.3"]


@pytest.mark.slow
def test_a_suite_killed_with_sigkill_resumes_without_losing_or_redoing_pairs(tmp_path, cpu, cpu_ceilings):
    from kforge.harness.roofline import save_ceilings

    env = {**os.environ, "KFORGE_CACHE_DIR": str(tmp_path / "cache"), "COLUMNS": "200"}
    os.environ["KFORGE_CACHE_DIR"] = env["KFORGE_CACHE_DIR"]
    save_ceilings(cpu, cpu_ceilings)
    make_suite(tmp_path, {  # five distinct pairs; each slow import leaves time to kill the suite mid-run
        "p0": ("row_sums", "vectorized_row_sums"), "p1": ("add", "slow_import"), "p2": ("add", "zero_inputs"),
        "p3": ("add", "lazy_subclass"), "p4": ("linear", "slow_import"),
    })
    store = tmp_path / "kforge-suite.jsonl"
    run = subprocess.Popen(SUITE_CMD, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not store.exists() or len(store.read_text().splitlines()) < 2):
        time.sleep(0.2)
    os.killpg(run.pid, signal.SIGKILL)  # the suite and its worker, at once
    run.wait()
    before = [json.loads(line) for line in store.read_text().splitlines()]
    assert 2 <= len(before) < 5, "killed mid-run, with records of the finished pairs kept"

    resumed = subprocess.run(SUITE_CMD + ["--resume"], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=900)
    assert resumed.returncode == 1, resumed.stderr  # p2 and p3 are hostile: not every pair passed
    after = [json.loads(line) for line in store.read_text().splitlines()]
    assert len(after) == 5 and after[:len(before)] == before, "nothing lost, nothing redone"
    assert len({r["pair_key"] for r in after}) == 5

    again = subprocess.run(SUITE_CMD, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    table = lambda text: [line for line in text.splitlines() if "evaluated now" not in line]  # noqa: E731
    assert table(again.stdout) == table(resumed.stdout), "the same table from the store"
    assert "none evaluated now: every pair's record read from" in " ".join(again.stdout.split())


@pytest.mark.slow
def test_force_evaluates_again_and_the_latest_record_counts(tmp_path, cpu, cpu_ceilings):
    problems, sols = make_suite(tmp_path, {"one": ("row_sums", "vectorized_row_sums")})
    store = ResultStore(tmp_path / "suite.jsonl")
    options = dict(timing=TimingConfig(budget_s=0.2), ceilings=cpu_ceilings)
    pairs = discover(problems, sols)
    assert run_suite(pairs, store, slots=[None], device_name=cpu.name, options=options).ran == 1
    assert run_suite(pairs, store, slots=[None], device_name=cpu.name, options=options).ran == 0
    assert run_suite(pairs, store, slots=[None], device_name=cpu.name, options=options, force=True).ran == 1
    assert len(store.path.read_text().splitlines()) == 2 and len(store.latest()) == 1


@pytest.mark.slow
def test_resume_without_a_store_is_refused(tmp_path):
    make_suite(tmp_path, {"one": ("add", "vectorized_row_sums")})
    result = subprocess.run(SUITE_CMD + ["--resume"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "nothing to resume" in result.stderr


@pytest.mark.slow
def test_a_suite_of_honest_crashing_hanging_forging_and_leaking_candidates_ends_with_the_right_table(
        tmp_path, cpu, cpu_ceilings):
    from kforge.harness import containment
    from kforge.harness.roofline import save_ceilings

    token = f"kforge-suite-{os.getpid()}-{time.monotonic_ns()}"
    target = tmp_path / "results.jsonl"
    target.write_text("{}\n")
    env = {**os.environ, "KFORGE_CACHE_DIR": str(tmp_path / "cache"), "COLUMNS": "200",
           "KFORGE_HOSTILE_TOKEN": token, "KFORGE_TEST_TARGET": str(target)}
    os.environ["KFORGE_CACHE_DIR"] = env["KFORGE_CACHE_DIR"]
    save_ceilings(cpu, cpu_ceilings)
    make_suite(tmp_path, {
        "a_honest": ("row_sums", "vectorized_row_sums"), "b_crash": ("add", "crash_segfault"),
        "c_hang": ("add", "hang_timed"), "d_forge": ("add", "judge_forge_clock"),
        "e_leak": ("row_sums", "outlive_daemon"), "f_honest": ("row_sums", "vectorized_row_sums"),
    })
    done = subprocess.run(SUITE_CMD + ["--stage-timeout", "30", "--json"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    rows = {row["name"]: row for row in json.loads(done.stdout)["rows"]}
    honest = {"a_honest", "e_leak", "f_honest"}  # correct; their verdicts are a shared CPU's clock's
    assert all(rows[name]["status"] in CORRECT_STATUSES for name in honest), rows
    assert {name: row["status"] for name, row in rows.items() if name not in honest} == {
        "b_crash": "crash", "c_hang": "timeout", "d_forge": "rejected"}, rows
    assert rows["d_forge"]["defences"] == ["timing_claims"]
    assert done.returncode == 1, "not every pair passed"
    # the leaking candidate's daemon is gone, and wrote nothing
    alive = [int(p) for p in os.listdir("/proc") if p.isdigit() and containment.alive(int(p))
             and token.encode() in _environ(int(p))]
    assert alive == [] and target.read_text() == "{}\n"


def _environ(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read()
    except OSError:
        return b""

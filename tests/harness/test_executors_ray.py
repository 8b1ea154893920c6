"""The Ray executor on a local Ray cluster of two logical GPUs (the pairs run on the CPU):
pairs spread over the GPUs, one judge a GPU, the same table as the local executor, a
Ray worker killed under the judge (retried once, then a crash record), a node of another
device refused, and a driver killed with SIGKILL that resumes without redoing a pair."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

ray = pytest.importorskip("ray", reason="the Ray executor's tests need ray (pip install 'kforge[ray]')")

import conftest  # noqa: E402  (after the skip)
from conftest import FIXTURES, scripted_timing  # noqa: E402
from kforge.device import current_device  # noqa: E402
from kforge.errors import KforgeError  # noqa: E402
from kforge.harness import containment  # noqa: E402
from kforge.harness.executors import RayExecutor  # noqa: E402
from kforge.harness.roofline import Ceilings, save_ceilings  # noqa: E402
from kforge.harness.suite import CORRECT_STATUSES, ResultStore, discover, keys_for, run_suite  # noqa: E402

pytestmark = pytest.mark.slow
GPUS = 2
PAIRS = {  # name: (problem, candidate); None: no solution file
    "a_rows": ("row_sums", "vectorized_row_sums"), "b_exit": ("add", "crash_exit"),
    "c_zeroes": ("add", "zero_inputs"), "d_lazy": ("add", "lazy_subclass"), "e_missing": ("add", None),
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A local Ray instance with GPUS logical GPUs. Its workers inherit KFORGE_CACHE_DIR,
    where the CPU's stand-in ceilings are saved (for the command, which measures none)."""
    cache = tmp_path_factory.mktemp("ray-kforge-cache")
    before = os.environ.get("KFORGE_CACHE_DIR")
    os.environ["KFORGE_CACHE_DIR"] = str(cache)
    cpu = current_device("cpu")
    ceilings = Ceilings(device=cpu.name, kind="cpu", copy_gbps=10.0, matmul_tflops={"fp32": 0.5},
                        measured_on="2026-11-21")
    save_ceilings(cpu, ceilings)
    context = ray.init(num_cpus=2 * GPUS, num_gpus=GPUS, include_dashboard=False, log_to_driver=False,
                       object_store_memory=200 << 20)
    ray.cloudpickle.register_pickle_by_value(conftest)  # the scripted timings travel to the workers
    yield {"address": context.address_info["gcs_address"], "cache": cache, "ceilings": ceilings, "cpu": cpu}
    ray.shutdown()
    if before is None:
        os.environ.pop("KFORGE_CACHE_DIR", None)
    else:
        os.environ["KFORGE_CACHE_DIR"] = before


def make_suite(folder, pairs: dict):
    problems, solutions = folder / "problems", folder / "solutions"
    problems.mkdir(parents=True)
    solutions.mkdir()
    for name, (problem, candidate) in pairs.items():
        shutil.copy(FIXTURES / "problems" / f"{problem}.py", problems / f"{name}.py")
        if candidate:
            shutil.copy(FIXTURES / "candidates" / f"{candidate}.py", solutions / f"{name}.py")
    return discover(problems, solutions)


def options(cluster) -> dict:
    # the scripted clocks make each verdict, and so the table, independent of the machine's load;
    # 30 rounds decide it, and the budget only caps a loaded host (0.3 s left it 5 rounds: a tie)
    return dict(ceilings=cluster["ceilings"], timing=scripted_timing(2.0, budget_s=5.0))


@pytest.fixture(scope="module")
def both(cluster, tmp_path_factory):
    """The same pairs through the local executor (the CPU) and through the Ray executor."""
    folder = tmp_path_factory.mktemp("suite")
    pairs = make_suite(folder, PAIRS)
    local = run_suite(pairs, ResultStore(folder / "local.jsonl"), slots=[None], device_name=cluster["cpu"].name,
                      options=options(cluster))
    starts = []
    executor = RayExecutor(resources={"GPU": 1})
    on_ray = run_suite(pairs, ResultStore(folder / "ray.jsonl"), executor=executor, options=options(cluster),
                       on_start=lambda pair, where: starts.append((pair.name, where)))
    return dict(pairs=pairs, local=local, ray=on_ray, starts=starts, executor=executor,
                records=ResultStore(folder / "ray.jsonl").latest())


def test_pairs_spread_over_the_logical_gpus_one_judge_a_gpu(both):
    starts = both["starts"]
    assert sorted(name for name, _ in starts) == ["a_rows", "b_exit", "c_zeroes", "d_lazy"]  # each once
    assert {where.gpu for _, where in starts} == set(range(GPUS))
    assert all(where.attempt == 1 and where.node for _, where in starts)
    judges = {where.gpu: set() for _, where in starts}
    for _, where in starts:
        judges[where.gpu].add(where.pid)
    assert all(len(pids) == 1 for pids in judges.values()), "one judge process a GPU, for all its pairs"
    assert len({pid for pids in judges.values() for pid in pids}) == GPUS and os.getpid() not in judges[0]
    assert both["ray"].ran == 4
    assert all(_gone(pid) for pids in judges.values() for pid in pids), "the judges end with the run"


def test_records_from_ray_carry_the_suites_keys_the_driver_paths_and_the_device(both, cluster):
    keys = keys_for(both["pairs"], options(cluster), cluster["cpu"].name)
    records = both["records"]
    assert sorted(records) == sorted(keys.values())
    for pair in both["pairs"]:
        if pair.candidate is None:
            continue
        record = records[keys[pair.name]]
        assert record["candidate"]["path"] == str(pair.candidate) and record["problem"]["path"] == str(pair.problem)
        assert record["device"]["name"] == cluster["cpu"].name
        assert record["device"]["host"] == socket.gethostname()  # the node that judged it
    assert both["executor"].nodes() and set(both["executor"].nodes().values()) == {cluster["cpu"].name}


def test_the_local_and_the_ray_executor_give_the_same_table(both, cluster):
    local, on_ray = both["local"], both["ray"]
    table = lambda summary: [(row.name, row.status, row.defences, row.device) for row in summary.rows]  # noqa: E731
    assert table(on_ray) == table(local)
    assert [row.status for row in local.rows] == ["passed", "crash", "incorrect", "incorrect", "missing"]
    assert on_ray.fast_p == local.fast_p and on_ray.correct == local.correct == 1
    assert on_ray.geomean_speedup == pytest.approx(local.geomean_speedup)  # scripted: 2x
    assert on_ray.devices == local.devices == [cluster["cpu"].name]


def test_a_ray_worker_killed_under_the_judge_is_retried_once_then_recorded_as_a_crash(cluster, tmp_path):
    make_suite(tmp_path, {"killed_once": ("add", "slow_import"), "killed_twice": ("add", "slow_import"),
                          "spare": ("row_sums", "vectorized_row_sums")})
    # two distinct candidates (a line apart), so two pairs in the store
    (tmp_path / "solutions" / "killed_twice.py").write_text((FIXTURES / "candidates" / "slow_import.py").read_text()
                                                             + "# the second copy\n")
    pairs = discover(tmp_path / "problems", tmp_path / "solutions")
    starts, orphans = [], []

    def kill(pair, where):
        starts.append((pair.name, where.attempt))
        if pair.name == "spare" or (pair.name == "killed_once" and where.attempt > 1):
            return
        # mid-pair: once the judge has started its workers (the candidate sleeps in its import)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(containment.descendants(where.pid)) < 2:
            time.sleep(0.05)
        children = containment.descendants(where.pid)
        assert len(children) >= 2, "the judge's workers never started"
        orphans.extend(children)
        os.kill(where.pid, signal.SIGKILL)

    store = ResultStore(tmp_path / "suite.jsonl")
    summary = run_suite(pairs, store, executor=RayExecutor(), options=options(cluster), on_start=kill)
    rows = {row.name: row for row in summary.rows}
    assert sorted(starts) == [("killed_once", 1), ("killed_once", 2), ("killed_twice", 1), ("killed_twice", 2),
                              ("spare", 1)]
    for name in ("killed_once", "spare"):
        assert rows[name].status == "passed", (name, rows[name].reason)
    assert rows["killed_twice"].status == "crash"
    assert "died" in rows["killed_twice"].reason and "2 attempts" in rows["killed_twice"].reason
    assert len(store.path.read_text().splitlines()) == 3, "one record per pair, the retry's only"
    # the judge's workers died with the Ray worker they ran under
    assert len(orphans) >= 6 and all(_gone(pid) for pid in orphans)


def _gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and containment.alive(pid):
        time.sleep(0.1)
    return not containment.alive(pid)


def test_a_node_whose_device_is_not_the_suites_is_refused(cluster, tmp_path):
    pairs = make_suite(tmp_path, {"one": ("row_sums", "vectorized_row_sums")})
    store = ResultStore(tmp_path / "suite.jsonl")
    expected = re.escape(f"its device is {cluster['cpu'].name}, the suite's NVIDIA Imaginary")
    with pytest.raises(KforgeError, match=expected):
        run_suite(pairs, store, executor=RayExecutor(), device_name="NVIDIA Imaginary", options=options(cluster))
    assert not store.path.exists(), "nothing recorded"


def test_a_driver_killed_with_sigkill_resumes_without_losing_or_redoing_pairs(cluster, tmp_path):
    make_suite(tmp_path, {"p0": ("row_sums", "vectorized_row_sums"), "p1": ("add", "zero_inputs"),
                          "p2": ("add", "crash_exit")})
    env = {**os.environ, "KFORGE_CACHE_DIR": str(cluster["cache"]), "COLUMNS": "200"}
    command = [sys.executable, "-m", "kforge", "suite", "problems", "--solutions", "solutions", "--time-budget", "0.3",
               "--executor", "ray", "--address", cluster["address"], "--json"]
    store = tmp_path / "kforge-suite.jsonl"
    driver = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and (not store.exists() or not store.read_text().strip()):
        time.sleep(0.1)
    os.killpg(driver.pid, signal.SIGKILL)
    driver.wait()
    before = store.read_text().splitlines()
    assert 1 <= len(before) < 3, "killed mid-run, with the records of the finished pairs kept"

    resumed = subprocess.run(command + ["--resume"], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 1, resumed.stderr  # p1 and p2 do not pass
    scores = json.loads(resumed.stdout)
    assert scores["ran"] == 3 - len(before)
    statuses = {row["name"]: row["status"] for row in scores["rows"]}
    assert statuses["p0"] in CORRECT_STATUSES, statuses  # real clocks here: passed, tie or slower
    assert statuses["p1"] == "incorrect" and statuses["p2"] == "crash", statuses
    after = store.read_text().splitlines()
    assert len(after) == 3 and after[:len(before)] == before, "nothing lost, nothing redone"
    assert len({json.loads(line)["pair_key"] for line in after}) == 3


def test_the_machine_loops_evaluator_judges_pairs_as_they_come_on_every_judge(cluster):
    """`kforge machine --executor ray`: calls from the loop's threads at once, each on a free
    judge, a crash recorded as locally; the same statuses as the local executor's evaluator."""
    from concurrent.futures import ThreadPoolExecutor

    from kforge.harness.executors import LocalExecutor

    pairs = [(FIXTURES / "problems" / "row_sums.py", FIXTURES / "candidates" / "vectorized_row_sums.py"),
             (FIXTURES / "problems" / "add.py", FIXTURES / "candidates" / "crash_exit.py")] * 2
    executor = RayExecutor()
    with executor, executor.evaluator(options=options(cluster), device_name=cluster["cpu"].name) as judge:
        assert executor.slot_count == GPUS
        with ThreadPoolExecutor(max_workers=len(pairs)) as pool:
            on_ray = list(pool.map(lambda pair: judge(*pair), pairs))
        assert executor._judges is not None, "the judges serve the whole context"
    assert executor._judges is None
    local = LocalExecutor([None], cluster["cpu"].name)
    with local.evaluator(options=options(cluster), device_name=cluster["cpu"].name) as judge:
        here = [judge(*pair) for pair in pairs]
    reasons = [(r.status, r.reason) for r in on_ray + here]
    assert [r.status for r in on_ray] == [r.status for r in here] == ["passed", "crash"] * 2, reasons
    assert all(r.device["name"] == cluster["cpu"].name for r in on_ray if r.status == "passed")
    assert on_ray[0].speedup == pytest.approx(here[0].speedup)  # scripted: 2x


def test_no_cluster_at_the_address_is_one_line_not_a_traceback(monkeypatch):
    # (once: ray.init's ConnectionError reached the user as kforge's internal error)
    executor = RayExecutor(address="auto")

    def no_cluster(**_):
        raise ConnectionError("Could not find any running Ray instance.")

    monkeypatch.setattr(executor.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(executor.ray, "init", no_cluster)
    with pytest.raises(KforgeError, match=r"--address auto: no Ray cluster to join \(Could not find any running Ray "
                                          r"instance\.\); start one with `ray start --head`") as error:
        executor.connect()
    assert "\n" not in error.value.reason

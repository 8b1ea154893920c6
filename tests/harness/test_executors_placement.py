"""Pairs whose problem declares GPUS = N: the declaration read from the file's text, N local
slots taken together (fake GPU numbers: the pairs run on the CPU), a placement group of N
bundles on a local Ray instance of two logical GPUs, single- and multi-GPU pairs in one
suite, and a pair needing more GPUs than any machine has recorded as such, not waited on.

The fixture problem (problems/visible_devices.py) names its workers' CUDA_VISIBLE_DEVICES in
its tags, and its candidate passes gate 1 only if its own worker sees the same devices."""

import os
import shutil
import signal
import threading
import time

import pytest

import conftest
from conftest import FIXTURES, scripted_timing
from kforge.errors import KforgeError, ProblemError
from kforge.device import current_device
from kforge.harness.executors import LocalExecutor, Placement, RayExecutor, _Slots
from kforge.harness.problem import declared_gpus
from kforge.harness.record import gpus_used
from kforge.harness.roofline import Ceilings
from kforge.harness.suite import ResultStore, discover, run_suite

VISIBLE = FIXTURES / "problems" / "visible_devices.py"
DECLARES = {"one": 1, "two": 2, "three": 3}  # pair name: the GPUS its problem declares
SUITE_S = 180  # a suite that takes longer is taken to be stuck (waiting on GPUs no one frees)


# --- the declaration -----------------------------------------------------------------------

def test_a_problem_declares_its_gpus_in_its_text_without_running_it(write, tmp_path):
    marker = tmp_path / "imported"
    assert declared_gpus(write("plain.py", "import torch\nN = 4\n")) == 1
    assert declared_gpus(write("two.py", f"open({str(marker)!r}, 'w')\nGPUS = 2\n")) == 2
    assert not marker.exists(), "read, never run"
    assert declared_gpus(write("annotated.py", "GPUS: int = 4\n")) == 4
    assert declared_gpus(write("twice.py", "GPUS = 2\nGPUS = 8\n")) == 8  # the last, as on import
    assert declared_gpus(write("broken.py", "GPUS = 2\ndef (\n")) == 1  # its evaluation reports the problem
    assert declared_gpus(VISIBLE) == 2


@pytest.mark.parametrize("value", ["0", "-1", "2.0", "True", "'2'", "None", "int('2')", "N"])
def test_a_gpus_that_is_not_a_whole_number_of_at_least_one_is_one_clear_error(write, value):
    with pytest.raises(ProblemError, match=r"problem's `GPUS` must be a whole number of GPUs of at least 1.* in bad.py"):
        declared_gpus(write("bad.py", f"N = 2\nGPUS = {value}\n"))


def test_a_suite_with_a_bad_declaration_stops_before_any_pair_runs(tmp_path):
    pairs = make_suite(tmp_path, {"a_fine": 1, "b_bad": 0})
    store = ResultStore(tmp_path / "suite.jsonl")
    with pytest.raises(ProblemError, match="got 0 in b_bad.py"):
        run_suite(pairs, store, executor=LocalExecutor([0, 1], "NVIDIA Imaginary"))
    assert not store.path.exists(), "nothing ran"


def test_a_record_says_how_many_gpus_its_pair_held_and_older_records_read_as_their_device():
    assert gpus_used({"device": {"kind": "cuda", "gpus": 2}}) == 2
    assert gpus_used({"device": {"kind": "cpu", "gpus": 0}}) == 0
    assert gpus_used({"device": {"kind": "cuda", "name": "NVIDIA H100"}}) == 1  # before the field: its one GPU
    assert gpus_used({"device": {"kind": "cpu"}}) == 0
    assert gpus_used({"device": {"kind": "unknown"}}) == 0 and gpus_used({}) == 0


# --- the local executor's slots ------------------------------------------------------------

def test_slots_go_n_at_a_time_in_the_executors_order_and_first_come_first_served():
    slots = _Slots([1, 0, 2])
    assert slots.take(2) == [1, 0] and slots.take(1) == [2]
    slots.give([1, 0, 2])

    slots = _Slots([0, 1])
    first = slots.take(1)
    taken = []

    def take(count: int) -> None:
        held = slots.take(count)
        taken.append(held)
        time.sleep(0.05)
        slots.give(held)

    pair = threading.Thread(target=take, args=(2,))
    pair.start()
    _until(lambda: len(slots.queue) == 1)
    single = threading.Thread(target=take, args=(1,))
    single.start()
    _until(lambda: len(slots.queue) == 2)
    time.sleep(0.1)
    assert taken == [], "the single waits behind the pair, though a slot is free"
    slots.give(first)
    pair.join(10)
    single.join(10)
    assert taken == [[0, 1], [0]], "the pair first, then the single"


def test_a_local_executors_slots_are_gpus_or_the_cpu_not_both():
    with pytest.raises(KforgeError, match="GPUs or the CPU"):
        LocalExecutor([None, 0])


def _until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


# --- suites of one-, two- and three-GPU pairs ----------------------------------------------

def make_suite(folder, declares: dict[str, int]):
    """problems/NAME.py: the visible_devices problem declaring GPUS = N (a line apart, so each
    pair is its own); solutions/NAME.py: its honest candidate."""
    problems, solutions = folder / "problems", folder / "solutions"
    problems.mkdir(parents=True)
    solutions.mkdir()
    source = VISIBLE.read_text()
    assert "\nGPUS = 2\n" in source
    for name, gpus in declares.items():
        (problems / f"{name}.py").write_text(source.replace("\nGPUS = 2\n", f"\nGPUS = {gpus}\n") + f"# {name}\n")
        shutil.copy(FIXTURES / "candidates" / "visible_devices.py", solutions / f"{name}.py")
    return discover(problems, solutions)


def options(ceilings) -> dict:
    # the scripted clocks: each verdict (2x: passed) independent of the machine's load; 30
    # rounds decide it, and the budget only caps a loaded host (0.3 s left CI 5 rounds: a tie)
    return dict(ceilings=ceilings, timing=scripted_timing(2.0, budget_s=5.0))


def finishes(run, timeout_s: float = SUITE_S):
    """run() in a thread: its result, or a failure if it is still waiting after timeout_s."""
    out = {}
    thread = threading.Thread(target=lambda: out.update(result=run()), daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"the suite did not finish in {timeout_s} s: pairs wait on GPUs no one frees"
    assert "result" in out, "the suite raised (see the thread's traceback above)"
    return out["result"]


def seen(store: ResultStore) -> dict[str, str | None]:
    """{pair: the CUDA_VISIBLE_DEVICES its reference worker saw} from the stored records."""
    found = {}
    for record in store.latest().values():
        tags = record["problem"].get("tags") or []
        found[record["problem"]["name"]] = tags[0].partition("=")[2] if tags else None
    return found


@pytest.fixture(scope="module")
def machine():
    """The CPU, and stand-in ceilings (so no test spends seconds measuring it)."""
    cpu = current_device("cpu")
    return dict(cpu=cpu, ceilings=Ceilings(device=cpu.name, kind="cpu", copy_gbps=10.0,
                                           matmul_tflops={"fp32": 0.5}, measured_on="2026-11-21"))


@pytest.fixture(scope="module")
def local_suite(machine, tmp_path_factory):
    """The pairs through a LocalExecutor of fake GPUs 1 and 0 (listed in that order)."""
    folder = tmp_path_factory.mktemp("local")
    pairs = make_suite(folder, DECLARES)
    store = ResultStore(folder / "suite.jsonl")
    starts = {}
    executor = LocalExecutor([1, 0], machine["cpu"].name)
    summary = finishes(lambda: run_suite(pairs, store, executor=executor, options=options(machine["ceilings"]),
                                         on_start=lambda pair, where: starts.setdefault(pair.name, where)))
    return dict(pairs=pairs, store=store, summary=summary, starts=starts)


@pytest.mark.slow
def test_a_local_pair_of_two_gpus_takes_two_slots_and_its_workers_see_both_in_order(local_suite):
    rows = {row.name: row for row in local_suite["summary"].rows}
    assert rows["two"].status == "passed", rows["two"].reason  # the candidate's worker saw the reference's devices
    assert seen(local_suite["store"])["two"] == "1,0", "both slots, in the executor's order"
    assert local_suite["starts"]["two"] == Placement(gpu=1, gpus=(1, 0))
    assert rows["one"].status == "passed" and seen(local_suite["store"])["one"] in ("0", "1")
    assert (rows["one"].gpus, rows["two"].gpus) == (1, 2)


@pytest.mark.slow
def test_a_local_pair_needing_more_gpus_than_the_machine_has_is_recorded_not_waited_on(local_suite):
    three = next(row for row in local_suite["summary"].rows if row.name == "three")
    assert three.status == "problem_error" and three.gpus == 0
    assert "declares GPUS = 3" in three.reason and "2 GPU(s) of this machine (1, 0)" in three.reason
    assert "three" not in local_suite["starts"], "never started"


@pytest.mark.slow
def test_a_pair_recorded_as_needing_more_gpus_is_tried_again_where_it_fits(local_suite, machine):
    store = local_suite["store"]
    before = len(store.path.read_text().splitlines())
    executor = LocalExecutor([0, 1, 2], machine["cpu"].name)
    summary = finishes(lambda: run_suite(local_suite["pairs"], store, executor=executor,
                                         options=options(machine["ceilings"])))
    assert summary.ran == 1, "the other pairs' records stand"
    assert {row.name: row.status for row in summary.rows} == {"one": "passed", "two": "passed", "three": "passed"}
    assert seen(store)["three"] == "0,1,2"
    assert len(store.path.read_text().splitlines()) == before + 1


# --- on Ray --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster(machine):
    """A local Ray instance of two logical GPUs."""
    ray = pytest.importorskip("ray", reason="the Ray executor's tests need ray (pip install 'kforge[ray]')")
    ray.init(num_cpus=4, num_gpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=200 << 20)
    ray.cloudpickle.register_pickle_by_value(conftest)  # the scripted timings travel to the judges
    yield dict(machine, ray=ray)
    ray.shutdown()


@pytest.fixture(scope="module")
def on_ray(cluster, tmp_path_factory):
    """One suite of two single-GPU pairs, a pair of two GPUs and one of three, on the cluster."""
    folder = tmp_path_factory.mktemp("ray")
    pairs = make_suite(folder, {**DECLARES, "one_more": 1})
    store = ResultStore(folder / "suite.jsonl")
    starts = {}
    summary = finishes(lambda: run_suite(pairs, store, executor=RayExecutor(), options=options(cluster["ceilings"]),
                                         on_start=lambda pair, where: starts.setdefault(pair.name, where)))
    return dict(store=store, summary=summary, starts=starts)


@pytest.mark.slow
def test_a_ray_pair_of_two_gpus_runs_on_a_placement_group_seeing_both_logical_gpus(on_ray, cluster):
    rows = {row.name: row for row in on_ray["summary"].rows}
    assert rows["two"].status == "passed", rows["two"].reason  # the candidate's worker saw the reference's devices
    assert sorted(seen(on_ray["store"])["two"].split(",")) == ["0", "1"]
    where = on_ray["starts"]["two"]
    assert sorted(where.gpus) == [0, 1] and where.gpu == where.gpus[0] and where.node
    assert rows["two"].gpus == 2
    groups = cluster["ray"].util.placement_group_table().values()
    assert {(g["strategy"], len(g["bundles"])) for g in groups} == {("STRICT_PACK", 2)}
    assert all(g["state"] == "REMOVED" for g in groups), "each group is removed after its pairs"


@pytest.mark.slow
def test_single_and_multi_gpu_pairs_in_one_ray_suite_all_finish(on_ray):
    rows = {row.name: row for row in on_ray["summary"].rows}
    assert {name: row.status for name, row in rows.items()} == {
        "one": "passed", "one_more": "passed", "three": "problem_error", "two": "passed"}
    visible = seen(on_ray["store"])
    assert {visible["one"], visible["one_more"]} <= {"0", "1"}, "a single-GPU judge's workers see its GPU alone"
    assert (rows["one"].gpus, rows["one_more"].gpus) == (1, 1)
    assert [len(on_ray["starts"][name].gpus) for name in ("one", "one_more")] == [1, 1]


@pytest.mark.slow
def test_a_ray_pair_no_node_can_place_is_recorded_with_the_reason(on_ray):
    three = next(row for row in on_ray["summary"].rows if row.name == "three")
    assert three.status == "problem_error" and three.gpus == 0 and "three" not in on_ray["starts"]
    assert "declares GPUS = 3" in three.reason and "no node of the Ray cluster holds 3 bundles" in three.reason
    assert "GPU=2" in three.reason, "what the nodes offer"


@pytest.mark.slow
def test_a_judge_of_two_gpus_killed_mid_pair_is_replaced_in_its_group_and_the_pair_retried(cluster, tmp_path):
    pairs = make_suite(tmp_path, {"two": 2})
    starts = []

    def kill_the_first(pair, where):
        starts.append(where)
        if where.attempt == 1:  # the judge has started the pair
            os.kill(where.pid, signal.SIGKILL)

    summary = finishes(lambda: run_suite(pairs, ResultStore(tmp_path / "suite.jsonl"), executor=RayExecutor(),
                                         options=options(cluster["ceilings"]), on_start=kill_the_first))
    assert [where.attempt for where in starts] == [1, 2] and starts[0].pid != starts[1].pid
    assert sorted(starts[1].gpus) == [0, 1], "the new judge holds the group's two GPUs"
    assert summary.rows[0].status == "passed", summary.rows[0].reason


@pytest.mark.slow
def test_the_ray_evaluator_refuses_a_multi_gpu_pair_with_a_clear_reason(cluster):
    executor = RayExecutor()
    with executor, executor.evaluator(options=options(cluster["ceilings"]), device_name=cluster["cpu"].name) as judge, \
            pytest.raises(KforgeError, match="declares GPUS = 2: the Ray executor places multi-GPU pairs in a suite"):
        judge(VISIBLE, FIXTURES / "candidates" / "visible_devices.py")

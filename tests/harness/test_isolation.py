"""Isolation: whatever a candidate does to its worker, the caller gets a record."""

import time

import pytest

from conftest import FIXTURES, scripted_timing
from kforge.harness.isolation import StageLimits, evaluate_isolated
from kforge.harness.timing import TimingConfig

SHORT = StageLimits(load_s=5, gate1_s=5, gate2_s=5)


@pytest.fixture
def isolated(cpu, cpu_ceilings):
    def _run(candidate: str, problem: str = "add", **kwargs):
        kwargs.setdefault("limits", SHORT)
        return evaluate_isolated(FIXTURES / "problems" / f"{problem}.py", FIXTURES / "candidates" / f"{candidate}.py",
                                 timing=TimingConfig(budget_s=0.5), ceilings=cpu_ceilings, size="full",
                                 device_name=cpu.name, **kwargs)

    return _run


@pytest.mark.slow
def test_an_honest_candidate_comes_back_with_its_record(isolated, write, cpu, cpu_ceilings):
    path = write("honest.py", "import torch\nclass ModelNew(torch.nn.Module):\n"
                              "    def forward(self, a, b):\n        return torch.add(a, b)\n")
    stages = []
    record = evaluate_isolated(FIXTURES / "problems" / "add.py", path, timing=TimingConfig(budget_s=0.5),
                               ceilings=cpu_ceilings, device_name=cpu.name, on_stage=stages.append)
    assert record.gate1["passed"] and record.gate2 is not None, record.reason
    assert stages == ["load", "gate1", "gate2"]
    assert record.pair_key and len(record.pair_key) == 24


@pytest.mark.slow
def test_a_segfault_is_a_crash_with_its_traceback(isolated):
    record = isolated("crash_segfault")
    assert record.status == "crash" and record.exit_status == 2
    assert "SIGSEGV" in record.reason and "gate1" in record.reason
    assert "crash_segfault.py" in record.details, "faulthandler's traceback names the line"


@pytest.mark.slow
def test_os_exit_is_a_crash(isolated):
    record = isolated("crash_exit")
    assert record.status == "crash" and "status 7" in record.reason


@pytest.mark.slow
def test_a_hang_while_importing_times_out_the_load_stage(isolated):
    start = time.monotonic()
    record = isolated("hang_import")
    assert record.status == "timeout" and record.reason.startswith("load ran past its 5 s limit")
    assert time.monotonic() - start < 15, "the worker is killed at the limit, not later"


@pytest.mark.slow
def test_a_hang_once_timed_times_out_gate_2(isolated):
    record = isolated("hang_timed")
    assert record.status == "timeout" and record.reason.startswith("gate2 ran past")


@pytest.mark.slow
def test_out_of_memory_is_its_own_status(isolated):
    record = isolated("oom")
    assert record.status == "oom" and "can't allocate memory" in record.reason


@pytest.mark.slow
def test_speedups_above_the_threshold_are_measured_again_in_a_fresh_worker(cpu, cpu_ceilings):
    record = evaluate_isolated(FIXTURES / "problems" / "row_sums.py",
                               FIXTURES / "candidates" / "vectorized_row_sums.py",
                               timing=scripted_timing(speedup=4.0), ceilings=cpu_ceilings, size="full",
                               device_name=cpu.name, remeasure_above=2.0)
    assert record.status == "passed" and "excessive_speedup" in record.defences, record.reason
    assert any("measured twice in fresh workers: 4x, then 4x" in w for w in record.warnings), record.warnings


INPLACE_PROBLEM = """
    import torch
    class Model(torch.nn.Module):
        def forward(self, x):
            return x.mul_(2)  # the result is also left in its input
    def get_inputs():
        return [torch.rand(1000)]
    def get_init_inputs():
        return []
"""


@pytest.mark.slow
@pytest.mark.parametrize("body, correct", [("return x.mul_(2)", True), ("return x * 2", False)])
def test_a_reference_that_changes_its_inputs_holds_the_candidate_to_the_same(write, cpu, cpu_ceilings, body,
                                                                              correct):
    # the candidate's worker is then called on the arena's views, where the reference worker sees them
    problem = write("inplace.py", INPLACE_PROBLEM)
    candidate = write("candidate.py", f"import torch\nclass ModelNew(torch.nn.Module):\n"
                                      f"    def forward(self, x):\n        {body}\n")
    record = evaluate_isolated(problem, candidate, timing=scripted_timing(speedup=2.0), ceilings=cpu_ceilings,
                               size="full", device_name=cpu.name)
    if correct:
        assert record.status == "passed" and record.gate2["rechecked_rounds"] > 1, record.reason
    else:
        assert record.status == "incorrect" and record.gate1["failure"] == "mutated_inputs", record.reason


def test_the_judge_holds_a_cpu_device_to_its_floor_and_the_in_process_path_does_not(cpu, cpu_ceilings):
    """A 1.15x win, scripted: a tie under the judge on a CPU device (two processes there differ by
    up to that, verdict.CPU_DEVICE_FLOOR), passed in one process, whose own A/A pair sees its noise."""
    from kforge.harness.evaluate import evaluate
    from kforge.harness.verdict import CPU_DEVICE_FLOOR

    problem, candidate = FIXTURES / "problems" / "row_sums.py", FIXTURES / "candidates" / "vectorized_row_sums.py"
    judged = evaluate_isolated(problem, candidate, timing=scripted_timing(speedup=1.15), ceilings=cpu_ceilings,
                               size="full", device_name=cpu.name)
    verdict = judged.gate2["verdict"]
    assert judged.status == "tie" and verdict["cpu_device"], judged.reason
    assert verdict["noise_floor"] == CPU_DEVICE_FLOOR
    assert "on a CPU device" in judged.reason
    alone = evaluate(problem, candidate, timing=scripted_timing(speedup=1.15), ceilings=cpu_ceilings, size="full",
                     device=cpu)
    assert alone.status == "passed" and not alone.gate2["verdict"]["cpu_device"], alone.reason

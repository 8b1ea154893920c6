"""One hostile candidate per defence, each run as the CLI runs it: in a fresh worker.

The candidates live in tests/fixtures/candidates/, each opening with what it tries.
GPU-only attacks (work on another stream, an illegal address) are in test_gpu.py.
"""

import pytest

from conftest import FIXTURES
from kforge.harness.isolation import evaluate_isolated
from kforge.harness.roofline import Ceilings
from kforge.harness.timing import TimingConfig


@pytest.fixture
def isolated(cpu, cpu_ceilings):
    def _run(candidate: str, problem: str = "add", ceilings=cpu_ceilings):
        return evaluate_isolated(FIXTURES / "problems" / f"{problem}.py", FIXTURES / "candidates" / f"{candidate}.py",
                                 timing=TimingConfig(budget_s=0.5), ceilings=ceilings, size="full",
                                 device_name=cpu.name)

    return _run


@pytest.mark.parametrize("candidate, problem, status, defences", [
    # 1. results cached across calls: fresh inputs every timed call, sampled calls re-checked
    ("cache_once_timed", "add", "incorrect", {"recheck"}),
    ("cache_by_shape", "add", "incorrect", {"poison"}),
    # 2. work moved to a host thread the timer cannot see
    ("background_thread", "row_sums", "rejected", {"host_thread"}),
    ("slow_background_thread", "row_sums", "rejected", {"host_thread"}),  # still writing during gate 1
    # a thread started at import races the checks: whichever sees its late output first wins
    ("worker_thread", "row_sums", None, None),
    # 3. lazy outputs: a tensor subclass
    ("lazy_subclass", "add", "incorrect", {"plain_tensor"}),
    # 4. inputs mutated, so a reference sharing them would return zeros
    ("zero_inputs", "add", "incorrect", {"input_clones"}),
    # 5. output memory that may still hold the reference's result: caught either by the
    # poison it finds (if malloc hands the bait back) or by the garbage it returns; on a
    # GPU the caching allocator hands it back, and test_gpu.py expects the poison
    ("stale_memory", "add", "incorrect", None),
    # 6. patched timers or harness functions
    ("patch_timer", "add", "rejected", {"harness_integrity"}),
    ("patch_harness", "add", "rejected", {"harness_integrity"}),
    # 8. the library the problem asks to beat
    ("calls_cublas", "matmul_no_library", "rejected", {"forbidden_op"}),
])
def test_each_hostile_candidate_is_caught_by_its_defence(isolated, candidate, problem, status, defences):
    record = isolated(candidate, problem)
    assert record.status in ("incorrect", "rejected"), record.reason
    if status:
        assert record.status == status, record.reason
    if defences:
        assert set(record.defences) & defences, (record.defences, record.reason)
    assert record.exit_status == 1


def test_7_a_predicted_seed_buys_nothing(isolated):
    # precomputed answers for KernelBench's seed 42; kforge draws a secret seed per run
    record = isolated("predicted_seed")
    assert record.status == "incorrect" and record.gate1["failure"] == "values"


def test_7_the_seed_is_in_neither_the_environment_nor_the_arguments(isolated, tmp_path, write):
    probe = write("snoop.py", f"""
        import os, sys, torch
        with open({str(tmp_path / 'seen.txt')!r}, 'w') as f:
            f.write(repr(dict(os.environ)) + repr(sys.argv))
        class ModelNew(torch.nn.Module):
            def forward(self, a, b):
                return a + b
    """)
    from kforge.harness.isolation import evaluate_isolated as run

    record = run(FIXTURES / "problems" / "add.py", probe, timing=TimingConfig(budget_s=0.3), size="full",
                 ceilings=Ceilings(device="cpu", kind="cpu", copy_gbps=10.0, matmul_tflops={}, measured_on="x"))
    seen = (tmp_path / "seen.txt").read_text()
    assert str(record.seed) not in seen


def test_9_a_time_under_the_physical_floor_fails_gate_2(isolated, cpu):
    # A device whose fp32 peak makes the floor ~0.3 ms: the Python-loop reference is slower
    # than that, the vectorized candidate (correct) is timed faster, which this device
    # could not do; on a real device that means the timer was fooled.
    slow_device = Ceilings(device=cpu.name, kind="cpu", copy_gbps=10.0, matmul_tflops={"fp32": 2.9e-4},
                           measured_on="2026-11-21")
    record = isolated("vectorized_row_sums", "row_sums", ceilings=slow_device)
    assert record.status == "faster_than_hardware", record.reason
    assert "physical_floor" in record.defences
    floor = record.roofline["physical_floor_ms"]
    assert record.gate2["stats"]["candidate"]["median_ms"] < floor < record.gate2["stats"]["reference"]["median_ms"]


def test_a_candidate_using_torch_compile_is_not_mistaken_for_a_patcher(isolated, write, cpu, cpu_ceilings):
    candidate = write("compiled.py", """
        import torch
        class ModelNew(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.fn = torch.compile(lambda a, b: a + b)
            def forward(self, a, b):
                return self.fn(a, b)
    """)
    record = evaluate_isolated(FIXTURES / "problems" / "add.py", candidate, timing=TimingConfig(budget_s=0.3),
                               ceilings=cpu_ceilings, size="full", device_name=cpu.name)
    assert record.gate1["passed"] and "harness_integrity" not in record.defences, record.reason

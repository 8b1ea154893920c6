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
    # a cache keyed by shape returns the first trial's answer on the second trial's inputs
    ("cache_by_shape", "add", "incorrect", None),
    # 2. work moved to a host thread the timer cannot see: the output is copied into the
    # mailbox when the call returns, before the thread has written it. (A thread that races
    # the copy and wins did its work inside the judge's clock: no cheat, and no fixture, as
    # its outcome would be the scheduler's.)
    ("slow_background_thread", "row_sums", "incorrect", None),
    # 3. lazy outputs: a tensor subclass
    ("lazy_subclass", "add", "incorrect", {"plain_tensor"}),
    ("lazy_named_tensor", "add", "incorrect", {"plain_tensor"}),  # one that calls itself torch.Tensor
    # 4. inputs mutated, so a reference sharing them would return zeros
    ("zero_inputs", "add", "incorrect", {"input_clones"}),
    # 5. output memory that held the reference's result in a shared process: here it never did
    ("stale_memory", "add", "incorrect", None),
    # 6. a patched clock: the claimed call takes no time, which no call does
    ("patch_timer", "add", "rejected", {"timing_claims"}),
    # a patched comparison: it runs in the candidate's process, where nothing is compared
    ("patch_harness", "add", "incorrect", None),
    # 8. the library the problem asks to beat
    ("calls_cublas", "matmul_no_library", "rejected", {"forbidden_op"}),
])
@pytest.mark.slow
def test_each_hostile_candidate_is_caught_by_its_defence(isolated, candidate, problem, status, defences):
    record = isolated(candidate, problem)
    if candidate == "patch_timer" and record.device["kind"] == "cuda":
        # on a GPU the call costs the device's clock (CUDA events), which it did not patch
        assert record.status in ("passed", "tie", "slower") and record.speedup < 2, record.reason
        return
    assert record.status in ("incorrect", "rejected"), record.reason
    if status:
        assert record.status == status, record.reason
    if defences:
        assert set(record.defences) & defences, (record.defences, record.reason)
    assert record.exit_status == 1


@pytest.mark.slow
def test_7_a_predicted_seed_buys_nothing(isolated):
    # precomputed answers for KernelBench's seed 42; kforge draws a secret seed per run
    record = isolated("predicted_seed")
    assert record.status == "incorrect" and record.gate1["failure"] == "values"


@pytest.mark.slow
def test_7_the_seed_is_in_neither_the_environment_nor_the_arguments(isolated, write):
    # The candidate cannot write a file outside its scratch folder, so it reports what it saw
    # in the only channel it has: an exception, whose text the record keeps.
    probe = write("snoop.py", """
        import os, sys, torch
        raise RuntimeError("SEEN " + repr(dict(os.environ)) + repr(sys.argv) + repr(sys.stdin))
    """)
    from kforge.harness.isolation import evaluate_isolated as run

    record = run(FIXTURES / "problems" / "add.py", probe, timing=TimingConfig(budget_s=0.3), size="full",
                 ceilings=Ceilings(device="cpu", kind="cpu", copy_gbps=10.0, matmul_tflops={}, measured_on="x"))
    assert record.status == "candidate_error" and "SEEN" in record.details
    assert str(record.seed) not in record.details

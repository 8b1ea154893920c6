"""Gate 2 and gate 1's precision on the GPU: KernelBench's adversarial kernels (our own
versions), the timed window, an honest small win, and an identity that must not win."""

import pytest

from conftest import FIXTURES
from kforge.harness.isolation import evaluate_isolated
from kforge.harness.timing import TimingConfig

pytestmark = pytest.mark.gpu

SQUARE = FIXTURES / "problems" / "square_matmul_fp32.py"


def _judged(problem, candidate: str, gpu_ceilings, budget_s=3.0):
    return evaluate_isolated(problem, FIXTURES / "candidates" / f"{candidate}.py", ceilings=gpu_ceilings,
                             timing=TimingConfig(budget_s=budget_s), remeasure_above=None)


def test_work_on_a_non_blocking_stream_is_timed_as_what_it_is(gpu_ceilings):
    # KernelBench's evaluator measured this 1.22x faster than the same cuBLAS call
    record = _judged(SQUARE, "matmul_side_stream_fp32", gpu_ceilings)
    assert record.status != "passed", record.reason
    if record.gate2:
        assert 0.95 < record.speedup < 1.05, record.gate2["verdict"]


def test_an_output_never_computed_is_incorrect(gpu_ceilings):
    record = _judged(SQUARE, "matmul_result_reuse", gpu_ceilings)
    assert record.status == "incorrect", record.reason


def test_zeroed_inputs_and_a_zero_output_are_incorrect(gpu_ceilings):
    record = _judged(SQUARE, "matmul_zero_out", gpu_ceilings)
    assert record.status == "incorrect", record.reason


def test_an_fp16_matmul_fails_the_fp32_contract(gpu_ceilings):
    record = _judged(SQUARE, "matmul_fp16", gpu_ceilings)
    assert record.status == "incorrect", record.reason
    assert record.gate1["test"] in ("rel_l2", "rel_l2_exposed", "elementwise"), record.gate1


def test_an_honest_3_percent_win_passes(gpu_ceilings):
    record = _judged(FIXTURES / "problems" / "scale_with_waste.py", "scale_no_waste", gpu_ceilings, budget_s=10.0)
    assert record.status == "passed", record.reason
    assert 1.01 < record.gate2["verdict"]["low"] and record.speedup < 1.08, record.gate2["verdict"]


@pytest.fixture(scope="module")
def identity_record(gpu_ceilings, tmp_path_factory):
    source = SQUARE.read_text().replace("class Model(", "class ModelNew(")
    path = tmp_path_factory.mktemp("identity") / "identity.py"
    path.write_text(source)
    return evaluate_isolated(SQUARE, path, ceilings=gpu_ceilings, timing=TimingConfig(budget_s=3.0),
                             remeasure_above=None)


def test_the_same_code_is_never_faster(identity_record):
    assert identity_record.status in ("tie", "slower"), identity_record.reason


def test_the_same_code_measures_within_1_percent(identity_record):
    assert 0.99 <= identity_record.speedup <= 1.01, identity_record.gate2["verdict"]

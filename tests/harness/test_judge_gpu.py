"""The judge on a GPU: what only CUDA can show about its clock and its probe."""

import pytest

from conftest import EXAMPLES, FIXTURES
from kforge.harness.isolation import evaluate_isolated
from kforge.harness.timing import TimingConfig

pytestmark = pytest.mark.gpu


def _judged(candidate: str, gpu_ceilings, problem=EXAMPLES / "problems" / "matmul_bf16.py"):
    return evaluate_isolated(problem, FIXTURES / "candidates" / f"{candidate}.py", ceilings=gpu_ceilings,
                             timing=TimingConfig(budget_s=2.0))


def test_work_on_a_side_stream_passes_only_at_its_real_speed(gpu_ceilings):
    # the same cuBLAS call, hidden on a stream of its own: timed as what it is
    record = _judged("side_stream", gpu_ceilings)
    assert record.gate1["passed"], record.reason
    assert 0.9 < record.speedup < 1.1, record.gate2["stats"]
    assert record.status in ("tie", "slower"), record.reason
    assert "device_sync" in record.defences, record.gate2["profile"]["candidate"]


def test_a_worker_that_replies_before_the_gpu_is_done_is_caught(gpu_ceilings):
    # Either the judge's probe holds its queued matmuls inside the judge's clock (its claims
    # are forged), or its outputs are still unwritten when they are compared.
    record = _judged("gpu_early_reply", gpu_ceilings)
    assert record.status in ("rejected", "incorrect"), record.reason
    assert set(record.defences) & {"timing_claims", "recheck", "poison", "late_output"}, record.reason


def test_a_start_event_recorded_again_is_caught_by_the_judges_clock(gpu_ceilings):
    record = _judged("gpu_rerecord_start", gpu_ceilings)
    assert record.status == "rejected" and "timing_claims" in record.defences, record.reason


def test_an_honest_candidates_claims_sit_within_the_allowance(gpu_ceilings):
    # the reference itself, renamed: the two workers' gaps agree to well under the allowance
    record = _judged("identity_vector_add", gpu_ceilings, problem=EXAMPLES / "problems" / "vector_add.py")
    assert record.status == "tie", record.reason
    claims = record.gate2["claims"]
    assert abs(claims["excess_ms"]) < claims["allowed_ms"], claims
    # a 10 us kernel timed as its device time, launches hidden by the judge's cover, on both sides
    assert 0.97 <= record.speedup <= 1.03, record.gate2["verdict"]


@pytest.mark.parametrize("candidate", ["host_work_before_launch", "host_work_after_launch"])
def test_an_honest_host_heavy_candidate_is_not_called_hidden_work(candidate, gpu_ceilings):
    # 2 ms of host work around a 4 us add leaves the GPU idle before the call's end: its
    # closing synchronize costs ~25 us more than the null calls' (judge-tails.txt), which
    # flagged device_sync on all of them before the reference's tails set the allowance
    record = _judged(candidate, gpu_ceilings, problem=FIXTURES / "problems" / "add.py")
    assert record.status == "slower", record.reason
    assert record.defences == [], record.defences
    assert record.gate2["stats"]["candidate"]["median_ms"] > 0.5, "charged its host work past the cover: the GPU waited"

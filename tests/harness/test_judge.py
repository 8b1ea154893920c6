"""The judge's own arithmetic, on scripted numbers (its processes are tested in test_hostile.py)."""

import pytest

from kforge.errors import KforgeError

from kforge.harness.evaluate import AA
from kforge.harness.judge import NOISE_Z, ClaimsCheck, Ended, _claims, _clocks, median_difference_error


def gaps(reference_ms: float, candidate_ms: float, spread: float = 0.02,
         candidate_spread: float | None = None) -> dict[str, list[float]]:
    jitter = [(7 * i) % 11 - 5 for i in range(301)]  # symmetric, as a pipe's is
    wide = spread if candidate_spread is None else candidate_spread
    return {"reference": [reference_ms + spread * j for j in jitter], AA: [reference_ms + spread * j for j in jitter],
            "candidate": [candidate_ms + wide * j for j in jitter]}


def test_a_claim_shortened_by_more_than_the_allowance_fires_the_check():
    check = ClaimsCheck.for_device(is_cuda=True)
    excess, allowed, _ = check.excess_ms(gaps(1.6, 1.6 + 0.3), claimed_ms=0.05)
    assert excess == pytest.approx(0.3) and excess < allowed, "what honest candidates showed on the H100"
    excess, allowed, _ = check.excess_ms(gaps(1.6, 1.6 + 1.2), claimed_ms=0.05)
    assert excess > allowed
    # the relative part scales with what the candidate claims, which a liar keeps small
    assert check.excess_ms(gaps(1.6, 1.6), claimed_ms=100.0)[1] == pytest.approx(0.5 + 2.0, abs=0.05)


def test_the_allowance_grows_with_the_references_noise_and_not_with_the_candidates():
    check = ClaimsCheck.for_device(is_cuda=True)
    quiet = check.excess_ms(gaps(1.6, 1.6 + 1.2), claimed_ms=0.05)
    busy = check.excess_ms(gaps(1.6, 1.6 + 1.2, spread=2.0), claimed_ms=0.05)  # a host the scheduler keeps busy
    assert quiet[0] > quiet[1] and busy[0] < busy[1], "1.2 ms is a lie on a quiet host, noise on a busy one"
    assert busy[1] == pytest.approx(0.5 + 0.02 * 0.05 + NOISE_Z * busy[2]) and busy[2] > 0.1
    # a forger that scatters its own gaps widens nothing
    scattered = check.excess_ms(gaps(1.6, 1.6 + 1.2, candidate_spread=2.0), claimed_ms=0.05)
    assert scattered[1] == pytest.approx(quiet[1]) and scattered[0] > scattered[1]


def test_the_noise_of_a_median_difference_follows_the_spread_and_the_rounds():
    samples = [float(i) for i in range(1, 101)]  # quartiles 25.25 and 75.75
    one = median_difference_error(samples, 25)
    assert one == pytest.approx((2 / 25) ** 0.5 * 1.2533 * 50.5 / 1.349)
    assert median_difference_error(samples, 100) == pytest.approx(one / 2), "four times the rounds, half the error"
    assert median_difference_error([1.0, 2.0], 10) == 0.0, "too few samples to say: no allowance for noise"


@pytest.mark.parametrize("value", [None, [1, 2], [1, 2, "3"], [1, 2, float("nan")], [1, 2, -1], [True, 1, 1],
                                   [1, 2, 1e12]])
def test_clocks_that_are_not_three_sane_numbers_end_the_evaluation_as_a_crash(value):
    with pytest.raises(Ended) as ended:
        _clocks(value, "candidate's")
    assert ended.value.status == "crash"


@pytest.mark.parametrize("outputs", [float("nan"), "x" * 70000])
def test_claims_are_forwarded_only_as_strict_json_of_a_sane_size(outputs):
    with pytest.raises(Ended) as ended:
        _claims({"outputs": outputs, "digests": [1]})
    assert ended.value.status == "crash"
    assert _claims({"outputs": {"value": 1}, "digests": [3]}) == {"claims": {"value": 1}, "digests": [3]}


def test_worker_cpus_auto_gives_each_gpus_judge_its_own_cpu_from_the_top(monkeypatch):
    from kforge.harness import judge

    monkeypatch.setattr(judge.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert judge.worker_cpus("auto", None, on_gpu=True) == [3]
    assert [judge.worker_cpus("auto", gpu, on_gpu=True) for gpu in range(5)] == [[3], [2], [1], None, None], \
        "CPU 0 is never taken; two judges never share a CPU"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")  # as Ray sets it: the physical id decides
    assert judge.worker_cpus("auto", None, on_gpu=True) == [1]
    assert judge.worker_cpus("auto", 0, on_gpu=True) == [3], "an explicit GPU index wins"
    assert judge.worker_cpus("auto", 0, on_gpu=False) is None, "a CPU device's problems want every core"
    assert judge.worker_cpus(None, 0, on_gpu=True) is None
    assert judge.worker_cpus("auto", 0, on_gpu=True, gpus=2) is None, "NCCL places a multi-GPU problem's threads"
    assert judge.worker_cpus(2, 0, on_gpu=False) == [2]
    with pytest.raises(KforgeError, match=r"worker CPU 7 is not one this process may use \(0-3\)"):
        judge.worker_cpus(7, 0, on_gpu=True)
    monkeypatch.setattr(judge.os, "sched_getaffinity", lambda pid: {5})
    assert judge.worker_cpus("auto", 0, on_gpu=True) is None, "one CPU: nothing to choose"


def test_cpu_ranges_read_as_a_person_writes_them():
    from kforge.harness.judge import _ranges

    assert _ranges([0, 1, 2, 3, 8, 10, 11]) == "0-3,8,10-11"
    assert _ranges([5]) == "5"

"""The judge's own arithmetic, on scripted numbers (its processes are tested in test_hostile.py)."""

import pytest

from kforge.harness.judge import ClaimsCheck, Ended, _claims, _clocks


def gaps(reference_ms: float, candidate_ms: float) -> dict[str, list[float]]:
    jitter = [0.02 * ((7 * i) % 11 - 5) for i in range(301)]  # symmetric, as a pipe's is
    return {"reference": [reference_ms + j for j in jitter], "candidate": [candidate_ms + j for j in jitter]}


def test_a_claim_shortened_by_more_than_the_allowance_fires_the_check():
    check = ClaimsCheck.for_device(is_cuda=True)
    excess, allowed = check.excess_ms(gaps(1.6, 1.6 + 0.3), claimed_ms=0.05)
    assert excess == pytest.approx(0.3) and excess < allowed, "what honest candidates showed on the H100"
    excess, allowed = check.excess_ms(gaps(1.6, 1.6 + 1.2), claimed_ms=0.05)
    assert excess > allowed
    # the relative part scales with what the candidate claims, which a liar keeps small
    assert check.excess_ms(gaps(1.6, 1.6), claimed_ms=100.0)[1] == pytest.approx(0.5 + 2.0)


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

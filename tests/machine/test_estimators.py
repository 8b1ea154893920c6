"""pass@k and fast_p@k: the estimator's values by hand, and the tables built from attempt records."""

from math import comb

import pytest

from kforge.harness.suite import FAST_P
from kforge.machine.estimators import (
    attempts_of,
    estimate,
    fast_p_at_k,
    is_correct,
    is_fast,
    pass_at_k,
    samples,
    turn_curve,
)


def test_hand_computed_values():
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # 1 - (7/8)(8/9)(9/10)
    assert pass_at_k(10, 3, 2) == pytest.approx(1 - comb(7, 2) / comb(10, 2))  # 1 - 21/45
    assert pass_at_k(10, 0, 5) == 0.0
    assert pass_at_k(10, 10, 1) == 1.0
    assert pass_at_k(10, 1, 10) == 1.0  # k = n: all drawn, the one correct sample among them
    assert pass_at_k(10, 0, 10) == 0.0
    assert pass_at_k(5, 4, 2) == 1.0  # n - c < k: every pair holds a correct one
    assert fast_p_at_k(10, 3, 1) == pass_at_k(10, 3, 1)


@pytest.mark.parametrize("n", [1, 2, 7, 20])
def test_agrees_with_the_binomial_form(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k), abs=1e-12)


def test_large_n_stays_finite():
    value = pass_at_k(400, 3, 200)  # C(400, 200) overflows a float
    assert 0.87 < value < 0.88  # 1 - (1/2)^3 nearly: each correct sample is drawn with chance 1/2


def test_monotone_in_k_and_in_c():
    n = 12
    for c in range(n + 1):
        by_k = [pass_at_k(n, c, k) for k in range(1, n + 1)]
        assert by_k == sorted(by_k)
    for k in range(1, n + 1):
        by_c = [pass_at_k(n, c, k) for c in range(n + 1)]
        assert by_c == sorted(by_c)


@pytest.mark.parametrize("n, c, k, error", [
    (10, 3, 11, ValueError),  # k > n has no unbiased estimate
    (10, 3, 0, ValueError),
    (10, 11, 1, ValueError),
    (10, -1, 1, ValueError),
    (0, 0, 1, ValueError),
    (10, 3.0, 1, TypeError),
])
def test_refuses_what_it_cannot_estimate(n, c, k, error):
    with pytest.raises(error):
        pass_at_k(n, c, k)


# --- attempt records ----------------------------------------------------------------------

def attempt(sample: int, turn: int, status: str, speedup: float | None = None, low: float | None = None,
            problem: str = "softmax", run: str = "r1") -> dict:
    """An attempt record as loop.py writes it, with only what the estimators read in its EvalRecord."""
    record = None
    if status not in ("no_code", "ambiguous_code", "request_failed"):
        gate2 = None
        if speedup is not None:
            gate2 = {"passed": status == "passed", "speedup": speedup,
                     "verdict": {"speedup": speedup, "low": low if low is not None else speedup * 0.97,
                                 "high": speedup * 1.03},
                     "stats": {"reference": {"median_ms": speedup}, "candidate": {"median_ms": 1.0}}}
        record = {"status": status, "gate1": {"passed": gate2 is not None}, "gate2": gate2, "roofline": None,
                  "defences": [], "reason": None if status == "passed" else f"{status} here"}
    return {"kind": "machine_attempt", "schema": 1, "id": f"{run}/s{sample}/t{turn}", "run": run,
            "problem": {"name": problem, "path": f"{problem}.py", "sha256": problem * 4}, "sample": sample,
            "turn": turn, "status": status, "record": record}


def test_a_turn_is_judged_by_the_suites_own_rule():
    passed = attempt(0, 0, "passed", 1.6, low=1.45)
    assert is_correct(passed) and is_fast(passed, 0.0) and is_fast(passed, 1.0)
    assert not is_fast(passed, 1.5), "fast_1.5 needs the interval's low end above 1.5, not the median"
    tie = attempt(0, 0, "tie", 1.2)
    assert is_correct(tie) and is_fast(tie, 0.0) and not is_fast(tie, 1.0)  # a tie never counts for p >= 1
    slower = attempt(0, 0, "slower", 0.5)
    assert is_correct(slower) and is_fast(slower, 0.0)
    for failed in (attempt(0, 0, "incorrect"), attempt(0, 0, "no_code"), attempt(0, 0, "rejected", 3.0, low=2.9)):
        assert not is_correct(failed) and not any(is_fast(failed, p) for p in FAST_P)


def test_a_sample_succeeds_if_any_of_its_turns_does():
    records = [
        attempt(0, 0, "candidate_error"), attempt(0, 1, "incorrect"), attempt(0, 2, "passed", 2.4, low=2.2),
        attempt(1, 0, "passed", 1.3, low=1.2), attempt(1, 1, "incorrect"),  # (keep_going) a later turn broke it
        attempt(2, 0, "no_code"), attempt(2, 1, "tie", 1.01),
        attempt(3, 0, "incorrect"), attempt(3, 1, "slower", 0.7),
        attempt(4, 0, "request_failed"),  # no reply at all: not a sample
    ]
    table = estimate(records, ks=(1, 2, 4, 5))
    [row] = table.problems
    assert (row.problem, row.n, row.c) == ("softmax", 4, 4)
    assert row.f == {0.0: 4, 1.0: 2, 1.5: 1, 2.0: 1}
    assert row.pass_at[1] == 1.0
    assert row.fast_at[1.0][1] == pytest.approx(0.5)
    assert row.fast_at[1.0][2] == pytest.approx(1 - comb(2, 2) / comb(4, 2))
    assert row.fast_at[2.0][1] == pytest.approx(0.25)
    assert row.pass_at[5] is None and table.pass_at[5] is None, "k > n: no estimate"
    assert table.pass_at[1] == row.pass_at[1] and table.fast_at[1.0][2] == row.fast_at[1.0][2]


def test_the_suite_is_the_mean_over_problems():
    records = [attempt(s, 0, "passed" if s < 1 else "incorrect", 1.5, low=1.3, problem="a", run="ra")
               for s in range(4)]
    records += [attempt(s, 0, "passed" if s < 3 else "incorrect", 1.5, low=1.3, problem="b", run="rb")
                for s in range(6)]
    table = estimate(records, ks=(1, 5))
    assert [(r.problem, r.n, r.c) for r in table.problems] == [("a", 4, 1), ("b", 6, 3)]
    assert table.pass_at[1] == pytest.approx((0.25 + 0.5) / 2), "each problem weighs the same"
    assert table.pass_at[5] is None, "problem a has only 4 samples"
    assert table.problems[1].pass_at[5] == pytest.approx(1 - comb(3, 5) / comb(6, 5))


def test_samples_are_per_run_and_an_id_counts_once():
    first = attempt(0, 0, "incorrect")
    again = attempt(0, 0, "passed", 1.4, low=1.2)  # the same id asked again (--force): the latest counts
    other_run = attempt(0, 0, "incorrect", run="r2")
    assert len(attempts_of([first, again, other_run, {"kind": "something_else"}])) == 2
    found = samples([first, again, other_run])
    assert [(s.run, s.sample, len(s.turns)) for s in found] == [("r1", 0, 1), ("r2", 0, 1)]
    assert found[0].correct() and not found[1].correct()


def test_an_edited_problem_is_another_problem():
    old = attempt(0, 0, "passed", 1.4, low=1.2)
    new = attempt(0, 0, "incorrect", run="r2")
    new["problem"]["sha256"] = "f" * 64
    names = [row.problem for row in estimate([old, new], ks=(1,)).problems]
    assert len(names) == 2 and all(name.startswith("softmax@") for name in names)


def test_success_by_turn_is_cumulative():
    records = [
        attempt(0, 0, "incorrect"), attempt(0, 1, "passed", 1.3, low=1.2),
        attempt(1, 0, "tie", 1.0), attempt(1, 1, "incorrect"), attempt(1, 2, "passed", 1.1, low=1.05),
        attempt(2, 0, "no_code"),  # stopped after one turn: failed at every t
        attempt(3, 0, "passed", 2.0, low=1.9),  # done at once: counts at every t
    ]
    curve = turn_curve(records)
    assert [p.turns for p in curve] == [1, 2, 3]
    assert [p.correct for p in curve] == [0.5, 0.75, 0.75]
    assert [p.fast[1.0] for p in curve] == [0.25, 0.5, 0.75]
    assert curve[-1].correct == estimate(records, ks=(1,)).pass_at[1]

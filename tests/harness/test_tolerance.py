"""Gate 1's tolerance: the relative L2 bound, outputs near zero, exposing draws."""

import pytest
import torch

from conftest import FIXTURES
from kforge.errors import ProblemError
from kforge.harness.correctness import compare_leaf_values
from kforge.harness.evaluate import evaluate
from kforge.harness.isolation import evaluate_isolated
from kforge.harness.problem import expose, load_problem


@pytest.fixture
def judged(cpu, cpu_ceilings, fast_timing):
    def _run(problem: str, candidate: str, isolated: bool = False):
        problem_path = FIXTURES / "problems" / f"{problem}.py"
        candidate_path = FIXTURES / "candidates" / f"{candidate}.py"
        if isolated:
            return evaluate_isolated(problem_path, candidate_path, timing=fast_timing, ceilings=cpu_ceilings,
                                     size="full", device_name=cpu.name)
        return evaluate(problem_path, candidate_path, device=cpu, ceilings=cpu_ceilings, timing=fast_timing,
                        size="full")

    return _run


def test_zeros_for_a_softmax_of_wide_rows_fail_on_relative_error(judged):
    record = judged("softmax_wide", "softmax_of_zeros")
    assert record.status == "incorrect", record.reason
    assert record.gate1["test"] == "rel_l2_near_zero" and "only the relative error tells" in record.reason


def test_an_fp16_matmul_passes_the_elementwise_test_on_rand_inputs_and_fails_on_exposing_draws(judged):
    record = judged("matmul_rand", "matmul_fp16")
    assert record.status == "incorrect", record.reason
    assert "an exposing draw" in record.reason, record.reason
    assert record.gate1["trials_passed"] == 5  # the problem's own five draws did not catch it


@pytest.mark.slow  # the judge's workers
def test_the_judge_draws_the_exposing_inputs_too(judged):
    record = judged("matmul_rand", "matmul_fp16", isolated=True)
    assert record.status == "incorrect" and "an exposing draw" in record.reason, record.reason
    assert record.gate1["exposed_trials"] == 2


def test_3xtf32_is_exact_enough_for_fp32(judged):
    record = judged("matmul_rand", "matmul_3xtf32")
    assert record.gate1["passed"], record.reason
    assert record.gate1["rel_l2_err"] < 1e-6 and record.gate1["test"] == "rel_l2_exposed"
    assert record.gate1["trials"] == 7 and record.gate1["exposed_trials"] == 2


def test_an_exposing_draw_outside_the_references_domain_is_skipped(judged):
    record = judged("log_positive", "log_positive")
    assert record.gate1["passed"], record.reason
    assert record.gate1["exposed_skipped"] == 2


IDENTITY_PROBLEM = """
import torch
{contract}
class Model(torch.nn.Module):
    def forward(self, x):
        return x
def get_inputs():
    return [torch.rand(4)]
def get_init_inputs():
    return []
"""


def test_a_problem_can_keep_its_inputs_as_drawn(write):
    contract = 'precision = "as_drawn"\ntolerance = {"atol": 1e-3, "rtol": 1e-3, "rel_l2": 1e-4}'
    problem = load_problem(write("as_drawn.py", IDENTITY_PROBLEM.format(contract=contract)))
    assert problem.exposed_trials == 0 and problem.tolerance == (1e-3, 1e-3)
    assert problem.rel_l2_for(torch.float32) == 1e-4 and problem.rel_l2_for(torch.int64) is None
    # without rel_l2, a problem's own tolerance loosens the L2 bound to its larger term
    loose = write("loose.py", IDENTITY_PROBLEM.format(contract='tolerance = {"atol": 1e-2, "rtol": 1e-3}'))
    assert load_problem(loose).rel_l2_for(torch.float32) == 1e-2


@pytest.mark.parametrize("contract, message", [
    ('precision = "fp8"', "precision"),
    ('tolerance = {"rel_l2": -1}', "rel_l2"),
])
def test_bad_precision_contracts_are_refused(write, contract, message):
    with pytest.raises(ProblemError, match=message):
        load_problem(write("bad.py", IDENTITY_PROBLEM.format(contract=contract)))


def test_exposing_draws_flip_signs_and_spread_magnitudes_reproducibly():
    x = torch.rand(10_000) + 0.5
    a, b = expose([x.clone(), torch.arange(3), 2.0], seed=3), expose([x.clone(), torch.arange(3), 2.0], seed=3)
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], expose([x.clone()], seed=4)[0])
    strided = x.clone().view(100, 100).t()  # not contiguous: exposed in place all the same
    assert 0.45 < (expose([strided], seed=3)[0] < 0).float().mean() < 0.55 and not strided.is_contiguous()
    assert 0.45 < (a[0] < 0).float().mean() < 0.55  # random signs
    ratio = (a[0] / x).abs()
    assert ratio.min() >= 2 ** -4 * 0.99 and ratio.max() <= 2 ** 4 * 1.01 and ratio.max() > 8
    assert torch.equal(a[1], torch.arange(3)) and a[2] == 2.0  # integers and numbers untouched
    x16 = torch.rand(100, dtype=torch.bfloat16) + 0.5
    assert torch.equal(expose([x16.clone()], seed=3)[0].abs(), x16)  # 16-bit: signs only (a spread could overflow fp16)
    big = torch.rand(3 * (1 << 23)) + 0.5  # more than one chunk: every chunk is exposed
    exposed = expose([big.clone()], seed=5)[0]
    for chunk in exposed.split(1 << 23):
        assert 0.45 < (chunk < 0).float().mean() < 0.55


def test_the_comparison_names_the_test_that_decided(problem_path):
    problem = load_problem(problem_path("add"))
    ref = torch.rand(1000) + 1.0
    ok = compare_leaf_values(ref, ref.clone(), "output", problem)
    assert ok.ok and ok.test == "elementwise+rel_l2"
    off = ref.clone()
    off[0] += 1.0
    elementwise = compare_leaf_values(ref, off, "output", problem)
    assert not elementwise.ok and elementwise.test == "elementwise"
    drift = ref * (1 + 5e-5)  # every element within rtol=1e-4, but 5e-5 relative L2 > 3e-5
    l2 = compare_leaf_values(ref, drift, "output", problem)
    assert not l2.ok and l2.test == "rel_l2" and "lower precision" in l2.reason

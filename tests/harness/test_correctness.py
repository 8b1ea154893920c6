"""Gate 1: each way a candidate can be wrong is caught, for the right reason."""

import pytest
import torch

from kforge.harness.correctness import arguments_equal, compare_outputs
from kforge.harness.evaluate import evaluate
from kforge.harness.problem import load_problem


@pytest.fixture
def run(write, problem_path, cpu, cpu_ceilings, fast_timing):
    def _run(problem: str, candidate_source: str, **kwargs):
        candidate = write("candidate.py", candidate_source)
        return evaluate(problem_path(problem), candidate, device=cpu, ceilings=cpu_ceilings,
                        timing=fast_timing, **kwargs)

    return _run


CORRECT_ADD = """
    import torch
    class ModelNew(torch.nn.Module):
        def forward(self, a, b):
            return torch.add(a, b)
"""


def test_a_correct_candidate_passes_gate_1_on_five_fresh_trials(run):
    record = run("add", CORRECT_ADD)
    assert record.gate1["passed"]
    # five of the problem's own draws, then two exposing ones (random signs, spread magnitudes)
    assert record.gate1["trials"] == 7 and record.gate1["trials_passed"] == 7 and record.gate1["exposed_trials"] == 2
    assert len(set(record.gate1["seeds"])) == 7
    assert record.gate1["max_abs_err"] == 0.0 and record.gate1["mismatch_frac"] == 0.0


def test_every_trial_draws_fresh_random_inputs(run, tmp_path):
    log = tmp_path / "sums.txt"
    record = run("add", f"""
        import torch
        class ModelNew(torch.nn.Module):
            def forward(self, a, b):
                with open({str(log)!r}, "a") as f:
                    f.write(f"{{float(a.sum())}} {{int((a == 0).sum())}}\\n")
                return a + b
    """)
    assert record.gate1["passed"]
    lines = log.read_text().splitlines()[:7]  # gate 1's calls come first: 5 draws, 2 exposing ones
    assert len({line.split()[0] for line in lines}) == 7, "inputs must differ between trials"
    assert all(int(line.split()[1]) == 0 for line in lines), "inputs are random, never zeros"


def test_wrong_values_fail_with_the_error_figures(run):
    record = run("add", """
        import torch
        class ModelNew(torch.nn.Module):
            def forward(self, a, b):
                out = a + b
                out[7] += 0.5
                return out
    """)
    assert record.status == "incorrect" and record.exit_status == 1
    assert record.gate1["failure"] == "values"
    assert record.gate1["max_abs_err"] == pytest.approx(0.5, rel=1e-3)
    assert record.gate1["mismatch_frac"] == pytest.approx(1 / 4096)
    assert "at (7,)" in record.reason and "trial 1" in record.reason
    assert record.gate2 is None, "an incorrect candidate is not timed"


def test_wrong_shape_fails(run):
    record = run("add", """
        import torch
        class ModelNew(torch.nn.Module):
            def forward(self, a, b):
                return (a + b)[:-1]
    """)
    assert record.gate1["failure"] == "shape"
    assert "shape (4095,), expected (4096,)" in record.reason


def test_wrong_dtype_fails(run):
    record = run("add", """
        import torch
        class ModelNew(torch.nn.Module):
            def forward(self, a, b):
                return (a + b).double()
    """)
    assert record.gate1["failure"] == "dtype"


def test_nan_where_the_reference_is_finite_fails(run):
    record = run("add", """
        import torch
        class ModelNew(torch.nn.Module):
            def forward(self, a, b):
                out = a + b
                out[100] = float("nan")
                return out
    """)
    assert record.gate1["failure"] == "nonfinite"
    assert "1 NaN/Inf" in record.reason and "(100,)" in record.reason


def test_inf_where_the_reference_is_finite_fails(run):
    record = run("add", """
        import torch
        class ModelNew(torch.nn.Module):
            def forward(self, a, b):
                out = a + b
                out[0] = float("inf")
                return out
    """)
    assert record.gate1["failure"] == "nonfinite"


def test_mutating_the_inputs_fails_even_if_the_output_is_right(run):
    record = run("add", """
        import torch
        class ModelNew(torch.nn.Module):
            def forward(self, a, b):
                out = a + b
                b.zero_()  # e.g. to make a later reference call return something else
                return out
    """)
    assert record.gate1["failure"] == "mutated_inputs"
    assert "modified its inputs" in record.reason


def test_a_tensor_subclass_output_fails(run):
    record = run("add", """
        import torch
        class Lazy(torch.Tensor):
            pass
        class ModelNew(torch.nn.Module):
            def forward(self, a, b):
                return (a + b).as_subclass(Lazy)
    """)
    assert record.gate1["failure"] == "output_type"
    assert "Lazy" in record.reason and "not a plain torch.Tensor" in record.reason


def test_a_tuple_where_a_tensor_is_expected_fails(run):
    record = run("add", """
        import torch
        class ModelNew(torch.nn.Module):
            def forward(self, a, b):
                return (a + b,)
    """)
    assert record.gate1["failure"] == "structure"


def test_model_and_modelnew_are_built_under_the_same_seed(run):
    # nn.Linear draws random weights: only the same seed gives ModelNew the same ones.
    record = run("linear", """
        import torch
        class ModelNew(torch.nn.Module):
            def __init__(self, in_features, out_features):
                super().__init__()
                self.fc = torch.nn.Linear(in_features, out_features)
            def forward(self, x):
                return torch.addmm(self.fc.bias, x, self.fc.weight.t())
    """)
    assert record.gate1["passed"], record.reason


def test_a_problem_tolerance_overrides_the_dtype_default(write, cpu, cpu_ceilings, fast_timing):
    source = """
        import torch
        from torch import nn
        {tolerance}
        class Model(nn.Module):
            def forward(self, x):
                return x * 2
        def get_inputs():
            return [torch.rand(64) + 1]
        def get_init_inputs():
            return []
    """
    candidate = write("candidate.py", """
        import torch
        class ModelNew(torch.nn.Module):
            def forward(self, x):
                return x * 2 * (1 + 1e-3)  # 0.1% off: fails fp32's 1e-4, passes 1e-2
    """)
    strict = write("strict.py", source.format(tolerance=""))
    loose = write("loose.py", source.format(tolerance="tolerance = 1e-2"))
    for path, passes in ((strict, False), (loose, True)):
        record = evaluate(path, candidate, device=cpu, ceilings=cpu_ceilings, timing=fast_timing)
        assert record.gate1["passed"] is passes
        assert record.gate1["atol"] == (1e-2 if passes else 1e-4)


def test_a_reference_that_works_in_place_is_matched_not_flagged(write, cpu, cpu_ceilings, fast_timing):
    problem = write("inplace.py", """
        import torch
        from torch import nn
        class Model(nn.Module):
            def forward(self, x):
                x.mul_(2)
                return x.sum()
        def get_inputs():
            return [torch.randn(32)]
        def get_init_inputs():
            return []
    """)
    same = write("same.py", """
        import torch
        class ModelNew(torch.nn.Module):
            def forward(self, x):
                x.mul_(2)
                return x.sum()
    """)
    pure = write("pure.py", """
        import torch
        class ModelNew(torch.nn.Module):
            def forward(self, x):
                return (x * 2).sum()
    """)
    assert evaluate(problem, same, device=cpu, ceilings=cpu_ceilings, timing=fast_timing).gate1["passed"]
    record = evaluate(problem, pure, device=cpu, ceilings=cpu_ceilings, timing=fast_timing)
    assert record.gate1["failure"] == "mutated_inputs"
    assert "reference changes its inputs in place" in record.reason


def test_in_place_results_are_held_to_the_tolerance_and_other_inputs_to_their_bits(write, cpu, cpu_ceilings,
                                                                                   fast_timing):
    # RoPE's shape: the reference rotates x in place and only reads `scale`. A kernel whose
    # in-place result differs in the last bits (one rounding instead of two) is right; one
    # that also writes to an input the reference only reads is not.
    problem = write("inplace2.py", """
        import torch
        from torch import nn
        class Model(nn.Module):
            def forward(self, x, scale):
                x.mul_(scale)
                return x
        def get_inputs():
            return [torch.randn(64), torch.rand(64) + 0.5]
        def get_init_inputs():
            return []
    """)
    close = write("close.py", """
        import torch
        class ModelNew(torch.nn.Module):
            def forward(self, x, scale):
                x.copy_((x.double() * scale.double() * (1 + 1e-6)).float())
                return x
    """)
    far = write("far.py", """
        import torch
        class ModelNew(torch.nn.Module):
            def forward(self, x, scale):
                x.mul_(scale * 1.01)
                return x
    """)
    writes_scale = write("writes_scale.py", """
        import torch
        class ModelNew(torch.nn.Module):
            def forward(self, x, scale):
                x.mul_(scale)
                scale.add_(1e-7)
                return x
    """)
    assert evaluate(problem, close, device=cpu, ceilings=cpu_ceilings, timing=fast_timing).gate1["passed"]
    record = evaluate(problem, far, device=cpu, ceilings=cpu_ceilings, timing=fast_timing)
    assert record.gate1["failure"] == "mutated_inputs" and "leaves them differently" in record.reason
    record = evaluate(problem, writes_scale, device=cpu, ceilings=cpu_ceilings, timing=fast_timing)
    assert record.gate1["failure"] == "mutated_inputs" and "beyond those the reference changes" in record.reason


def test_compare_outputs_reports_errors_against_float64(problem_path):
    problem = load_problem(problem_path("add"))
    ref = torch.tensor([1.0, -2.0, 4.0, 0.0])
    out = torch.tensor([1.0, -2.0, 4.004, 1e-5])
    result = compare_outputs(ref, out, problem)
    assert not result.ok  # 4.004 is 1e-3 off at rtol 1e-4
    assert result.max_abs_err == pytest.approx(0.004, rel=1e-3)
    # relative to max(|ref|, atol): 1e-5 against a 0 reference counts as 1e-5 / 1e-4
    assert result.max_rel_err == pytest.approx(0.1, rel=1e-3)
    assert result.mismatch_frac == pytest.approx(0.25)
    assert result.rel_l2_err == pytest.approx(((0.004**2 + 1e-10) ** 0.5) / 21**0.5, rel=1e-3)


def test_compare_outputs_in_chunks_reports_what_one_pass_reports(problem_path, monkeypatch):
    """Outputs are compared COMPARE_CHUNK elements at a time (bounded float64 temporaries): every
    figure, the first bad element's index and the values quoted must not depend on the chunk."""
    from kforge.harness import correctness

    problem = load_problem(problem_path("add"))
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(5, 7, 3, generator=g)
    out = ref + 1e-6 * torch.randn(ref.shape, generator=g)
    out[3, 2, 1] += 0.5
    out[4, 6, 0] -= 0.25
    nonfinite = out.clone()
    nonfinite[2, 5, 2] = float("inf")
    whole = [compare_outputs(ref, x, problem) for x in (out, nonfinite)]
    monkeypatch.setattr(correctness, "COMPARE_CHUNK", 4)  # 105 elements: 27 chunks, the last short
    chunked = [compare_outputs(ref, x, problem) for x in (out, nonfinite)]
    for a, b in zip(whole, chunked):
        assert (a.ok, a.failure, a.reason, a.mismatch_frac) == (b.ok, b.failure, b.reason, b.mismatch_frac)
        assert (a.max_abs_err, a.max_rel_err) == (b.max_abs_err, b.max_rel_err)
        assert a.rel_l2_err == pytest.approx(b.rel_l2_err, rel=1e-12)
    assert "at (3, 2, 1)" in whole[0].reason and "2 / 105" not in whole[0].reason
    assert whole[0].mismatch_frac == pytest.approx(2 / 105) and "first at (2, 5, 2)" in whole[1].reason


def test_nan_in_both_outputs_is_agreement(problem_path):
    problem = load_problem(problem_path("add"))
    ref = torch.tensor([float("nan"), 1.0])
    assert compare_outputs(ref, ref.clone(), problem).ok
    assert not compare_outputs(ref, torch.tensor([0.0, 1.0]), problem).ok


def test_arguments_equal_is_exact_and_nan_aware():
    x = torch.tensor([1.0, float("nan")])
    assert arguments_equal([x, 3], [x.clone(), 3])
    assert not arguments_equal([x], [torch.tensor([1.0, 2.0])])
    assert not arguments_equal([x, 3], [x, 4])
    assert not arguments_equal([torch.tensor([1, 2])], [torch.tensor([1, 3])])

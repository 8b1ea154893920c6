"""Level 1 (single operators): every problem file loads with its kforge metadata, and every
(problem, solution) pair passes gate 1 at the tiny size on a CPU, kforge's Triton kernels
running under the interpreter. On a GPU: gate 1 at the full size for each pair."""

from pathlib import Path

import pytest

import kforge
from kforge.harness.evaluate import evaluate
from kforge.harness.problem import load_problem
from kforge.harness.timing import TimingConfig

PROBLEMS = Path(kforge.__file__).parent / "problems" / "level1"
SOLUTIONS = Path(kforge.__file__).parent / "solutions" / "level1"
NAMES = sorted(p.stem for p in PROBLEMS.glob("*.py") if not p.name.startswith("_"))
# Gate 1 is what these tests are about; on a CPU the timed rounds only show the pipeline runs.
QUICK = TimingConfig(warmup_s=0.0, min_warmup_calls=1, min_reps=1, min_time_s=0.0, budget_s=0.05)


def test_level_one_has_at_least_twenty_operators_besides_the_quantized_ones():
    plain = [name for name in NAMES if not any(q in name for q in ("w4a16", "nvfp4", "fp8"))]
    assert len(plain) >= 20, plain


@pytest.mark.parametrize("name", NAMES)
def test_problem_declares_its_cost_tolerance_tiny_size_and_level(name):
    problem = load_problem(PROBLEMS / f"{name}.py", size="tiny")
    module = problem.module
    assert hasattr(module, "flops") or hasattr(module, "bytes_moved"), "no FLOP or byte count"
    assert problem.tolerance is not None, "no tolerance"
    assert isinstance(module.tiny_sizes, dict) and module.tiny_sizes
    assert "level1" in problem.tags


# Gate 1 on fixed draws: a CI run must not fail by chance (over 200 random seeds the worst error of
# mlp_stack_bf16's solution reached 0.88 of its tolerance; the GPU tests draw afresh).
SEED = 20261130


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.slow
def test_solution_passes_gate_1_at_the_tiny_size_on_a_cpu(name, cpu, cpu_ceilings):
    solution = SOLUTIONS / f"{name}.py"
    if not solution.is_file():
        pytest.fail(f"no solution file {solution.relative_to(SOLUTIONS.parent.parent)} for problem {name}")
    record = evaluate(PROBLEMS / f"{name}.py", solution, device=cpu, ceilings=cpu_ceilings, timing=QUICK, seed=SEED)
    assert record.problem["size"] == "tiny"
    assert record.gate1 and record.gate1["passed"], record.reason
    assert not record.defences, record.defences


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_solution_passes_gate_1_at_the_full_size_on_the_gpu(name, gpu_ceilings):
    record = evaluate(PROBLEMS / f"{name}.py", SOLUTIONS / f"{name}.py", ceilings=gpu_ceilings, size="full",
                      timing=TimingConfig(budget_s=1.0))
    assert record.gate1 and record.gate1["passed"], record.reason
    assert record.status in ("passed", "tie", "slower"), (record.status, record.reason)

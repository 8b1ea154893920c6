"""Level 2 (fusions): every problem file loads with its kforge metadata and its full size fits in
20 GB (inputs and weights, counted on the meta device), and every (problem, solution) pair
passes gate 1 at the tiny size on a CPU, kforge's Triton kernels running under the
interpreter. On a GPU: gate 1 at the full size for each pair."""

import importlib.util
from pathlib import Path

import pytest
import torch

import kforge
from kforge.harness.evaluate import evaluate
from kforge.harness.problem import load_problem
from kforge.harness.timing import TimingConfig

PROBLEMS = Path(kforge.__file__).parent / "problems" / "level2"
SOLUTIONS = Path(kforge.__file__).parent / "solutions" / "level2"
NAMES = sorted(p.stem for p in PROBLEMS.glob("*.py") if not p.name.startswith("_"))
# Gate 1 is what these tests are about; on a CPU the timed rounds only show the pipeline runs.
QUICK = TimingConfig(warmup_s=0.0, min_warmup_calls=1, min_reps=1, min_time_s=0.0, budget_s=0.05)
# Solutions built on kernels another part of the project delivers: skipped until it is there.
NEEDS = {"w4a16_linear_bf16": "kforge.kernels.quant.w4a16"}


def _missing_kernel(name: str) -> str | None:
    module = NEEDS.get(name)
    return module if module and importlib.util.find_spec(module) is None else None


def test_level_two_has_at_least_fifteen_fusions_each_with_a_solution():
    assert len(NAMES) >= 15, NAMES
    assert sorted(p.stem for p in SOLUTIONS.glob("*.py") if not p.name.startswith("_")) == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_problem_declares_its_cost_tolerance_tiny_size_and_level(name):
    problem = load_problem(PROBLEMS / f"{name}.py", size="tiny")
    module = problem.module
    assert hasattr(module, "flops") or hasattr(module, "bytes_moved"), "no FLOP or byte count"
    assert problem.tolerance is not None, "no tolerance"
    assert isinstance(module.tiny_sizes, dict) and module.tiny_sizes
    assert "level2" in problem.tags


@pytest.mark.parametrize("name", NAMES)
def test_full_size_inputs_and_weights_fit_in_20_gb(name):
    problem = load_problem(PROBLEMS / f"{name}.py", size="full")
    meta = torch.device("meta")
    model = problem.build_reference(problem.init_inputs(0, meta), 0, meta)
    tensors = [*problem.make_inputs(0, meta), *model.parameters(), *model.buffers()]
    assert sum(t.numel() * t.element_size() for t in tensors) < 20e9


def test_w4a16_reference_dequantizes_as_the_int4_format_says():
    from kforge.kernels.quant.formats import dequantize_int4

    problem = load_problem(PROBLEMS / "w4a16_linear_bf16.py", size="tiny")
    model = problem.build_reference(problem.init_inputs(0, torch.device("cpu")), 0, torch.device("cpu"))
    (x,) = problem.make_inputs(1, torch.device("cpu"))
    weight = dequantize_int4(model.qweight, model.scales, model.group)
    assert torch.equal(model(x), torch.nn.functional.linear(x, weight))


# Gate 1 on fixed draws: a CI run must not fail by chance (over 200 random seeds the worst error of
# mlp_stack_bf16's solution reached 0.88 of its tolerance; the GPU tests draw afresh).
SEED = 20261130


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.slow
def test_solution_passes_gate_1_at_the_tiny_size_on_a_cpu(name, cpu, cpu_ceilings):
    if _missing_kernel(name):
        pytest.skip(f"{_missing_kernel(name)} is not in the tree yet")
    record = evaluate(PROBLEMS / f"{name}.py", SOLUTIONS / f"{name}.py", device=cpu, ceilings=cpu_ceilings,
                      timing=QUICK, seed=SEED)
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

"""Level 3 (blocks): every problem in problems/level3 has its solution in solutions/level3, both
pass gate 1 together at the tiny size on the CPU (the solutions' Triton kernels under the
interpreter), and each problem carries its metadata, with full-size figures in the issue's
range (reference >= ~100 us on an H100 by its FLOPs or bytes, under 20 GB). On a GPU: gate 1
at full size for every pair, with the peak memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kforge.problems.level3
import kforge.solutions.level3
from kforge.harness.evaluate import evaluate
from kforge.harness.problem import load_problem
from kforge.harness.timing import TimingConfig
from kforge.runtime.interpreter import interpreter_active

PROBLEMS = Path(kforge.problems.level3.__file__).parent
SOLUTIONS = Path(kforge.solutions.level3.__file__).parent
NAMES = sorted(p.stem for p in PROBLEMS.glob("[!_]*.py"))
H100_BF16_FLOPS, H100_BYTES_PER_S = 600e12, 3.0e12  # the planning rates: big GEMMs, a copy
# Gate 2 is moot on a CPU (the interpreter's speed): one warm-up and one timed round.
ONE_ROUND = TimingConfig(warmup_s=0.0, min_warmup_calls=1, min_reps=1, min_time_s=0.0, budget_s=0.01)


# DeepSeek-V3's 257 experts are 22.6 GB of bf16 weights, read once (bytes_moved) and held once
# by the reference and once by the solution: the blocks' 20 GB bound does not fit them.
MEMORY_LIMIT = {"moe_deepseek_v3_decode_bf16": 48e9, "moe_deepseek_v3_prefill_bf16": 48e9}


def test_the_eight_blocks_each_have_a_solution():
    assert NAMES == ["gpt_small_bf16", "llama_decoder_decode_bf16", "llama_decoder_prefill_bf16", "mlp_stack_bf16",
                     "moe_deepseek_v3_decode_bf16", "moe_deepseek_v3_prefill_bf16", "moe_ffn_bf16",
                     "vit_block_bf16"]
    assert all((SOLUTIONS / f"{name}.py").is_file() for name in NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_metadata_and_full_size_figures(name):
    problem = load_problem(PROBLEMS / f"{name}.py", "full")
    module = problem.module
    assert "level3" in problem.tags and "bf16" in problem.tags
    assert problem.tolerance is not None and problem.compute_dtype == "bf16"
    assert isinstance(module.tiny_sizes, dict) and module.tiny_sizes
    assert callable(module.flops) and callable(module.bytes_moved)
    with torch.device("meta"):  # full-size inputs as shapes only
        inputs = module.get_inputs()
    flops, moved = module.flops(inputs), module.bytes_moved(inputs)
    assert flops > 0 and moved > 0
    assert max(flops / H100_BF16_FLOPS, moved / H100_BYTES_PER_S) >= 100e-6, (flops, moved)
    input_bytes = sum(t.numel() * t.element_size() for t in inputs if isinstance(t, torch.Tensor))
    assert input_bytes + moved < MEMORY_LIMIT.get(name, 20e9)  # bytes_moved counts the weights once


def test_mlp_stack_figures_by_hand():
    """flops and bytes_moved of the MLP stack at a size small enough to count."""
    problem = load_problem(PROBLEMS / "mlp_stack_bf16.py", "tiny")
    x = torch.empty(13, 64, dtype=torch.bfloat16)
    weights = 64 * 128 + 128 * 128 + 128 * 128 + 128 * 64
    assert problem.module.flops([x]) == 2 * 13 * weights
    assert problem.module.bytes_moved([x]) == 2 * (weights + 3 * 128 + 64 + 13 * (64 + 64))


# Gate 1 on fixed draws: a CI run must not fail by chance (over 200 random seeds the worst error of
# mlp_stack_bf16's solution reached 0.88 of its tolerance; the GPU tests draw afresh).
SEED = 20261130


@pytest.mark.skipif(not interpreter_active(), reason="runs the Triton kernels under the interpreter")
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.slow
def test_solution_passes_gate_1_at_the_tiny_size(name, cpu, cpu_ceilings):
    record = evaluate(PROBLEMS / f"{name}.py", SOLUTIONS / f"{name}.py", device=cpu, ceilings=cpu_ceilings,
                      timing=ONE_ROUND, seed=SEED)
    assert record.gate1 and record.gate1["passed"], record.reason
    assert record.problem["size"] == "tiny" and record.gate1["trials_passed"] == 7
    assert record.status in ("passed", "tie", "slower"), record.reason  # no defence fired; speed on a CPU is moot


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_solution_passes_gate_1_at_full_size_on_the_gpu(name, gpu_ceilings):
    torch.cuda.reset_peak_memory_stats()
    record = evaluate(PROBLEMS / f"{name}.py", SOLUTIONS / f"{name}.py", ceilings=gpu_ceilings, size="full",
                      timing=TimingConfig(budget_s=3.0))
    assert record.problem["size"] == "full"
    assert record.gate1 and record.gate1["passed"], record.reason
    assert record.status in ("passed", "tie", "slower"), (record.status, record.reason, record.defences)
    assert torch.cuda.max_memory_allocated() < MEMORY_LIMIT.get(name, 20e9)
    print(f"{name}: {record.speedup:.3f}x eager, gate 1 max abs err {record.gate1['max_abs_err']:.3g}")

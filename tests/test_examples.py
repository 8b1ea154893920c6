"""The shipped examples: every candidate passes gate 1, on a GPU or under the interpreter."""

import pytest
import torch

from conftest import EXAMPLES
from kforge.harness.evaluate import evaluate
from kforge.runtime.interpreter import interpreter_active

NAMES = ["matmul_bf16", "softmax", "linear_bias_gelu"]


@pytest.mark.skipif(not interpreter_active(), reason="runs the Triton kernels under the interpreter")
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.slow
def test_each_example_runs_end_to_end_on_a_cpu(name, cpu, cpu_ceilings, fast_timing):
    record = evaluate(EXAMPLES / "problems" / f"{name}.py", EXAMPLES / "triton" / f"{name}.py",
                      device=cpu, ceilings=cpu_ceilings, timing=fast_timing)
    assert record.gate1 and record.gate1["passed"], record.reason
    assert record.problem["size"] == "tiny"
    assert record.gate2["clock"] == "host" and record.speedup > 0  # measured; its verdict on a CPU is moot
    assert record.roofline["candidate"]["pct_of_roof"] is not None


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_each_example_passes_gate_1_on_the_gpu(name, gpu_ceilings):
    record = evaluate(EXAMPLES / "problems" / f"{name}.py", EXAMPLES / "triton" / f"{name}.py",
                      ceilings=gpu_ceilings, size="tiny")
    assert record.gate1["passed"], record.reason
    assert record.gate2["clock"] == "cuda_events"
    assert torch.cuda.is_available()

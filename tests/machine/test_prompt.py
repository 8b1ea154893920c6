"""The first prompt (reference, backend, device, roofline floor, format) and the feedback text."""

from pathlib import Path

import pytest
from conftest import FIXTURES

from kforge.device import DeviceInfo
from kforge.errors import KforgeError, ProblemError
from kforge.harness.roofline import Ceilings
from kforge.machine.prompt import (FEEDBACK_CLOSING, FEEDBACK_PASSED, feedback_text, first_messages,
                                   problem_facts)

MATMUL = Path(__file__).parents[2] / "src" / "kforge" / "problems" / "level1" / "matmul_bf16.py"
H100 = DeviceInfo(kind="cuda", name="NVIDIA H100 80GB HBM3", index=0, capability="9.0", multiprocessors=132,
                  cache_bytes=50 << 20, memory_bytes=80 << 30)
H100_CEILINGS = Ceilings(device=H100.name, kind="cuda", copy_gbps=3000.0,
                         matmul_tflops={"fp32": 50.0, "bf16": 800.0}, measured_on="2026-11-21")


def user_text(facts, device, ceilings, backend="triton") -> str:
    system, user = first_messages(facts, device, ceilings, backend)
    assert system["role"] == "system" and user["role"] == "user"
    return user["content"]


def test_the_prompt_holds_the_reference_verbatim_the_task_and_the_reply_format(cpu, cpu_ceilings):
    path = FIXTURES / "problems" / "add.py"
    text = user_text(problem_facts(path, cpu), cpu, cpu_ceilings)
    assert path.read_text().rstrip("\n") in text
    assert "Write `ModelNew`" in text and "faster" in text and "correct" in text
    assert "exactly one fenced ```python block holding the whole file" in text
    assert "`forward` takes float32[4096], float32[4096] and returns float32[4096]" in text
    assert "atol 0.0001, rtol 0.0001" in text and "under 3e-05" in text
    assert "5 trials on fresh random inputs, then 2 on the same draws" in text


def test_the_cpu_is_named_as_such_and_the_floor_is_given_against_its_ceilings(cpu, cpu_ceilings):
    text = user_text(problem_facts(FIXTURES / "problems" / "add.py", cpu), cpu, cpu_ceilings)
    assert "This machine has no GPU" in text and "interpreter" in text
    assert "must move at least 49.2 kB" in text  # two inputs and the output of 4096 fp32 each
    assert "memory-bound, with a floor of 4.92 us" in text  # 49,152 B at 10 GB/s


def test_a_gpu_prompt_gives_the_device_its_ceilings_and_the_full_size_roofline():
    facts = problem_facts(MATMUL, H100)
    assert facts.size == "full" and facts.inputs == ["bfloat16[4096, 4096]", "bfloat16[4096, 4096]"]
    assert facts.flops == 2 * 4096**3 and facts.compute_dtype == "bf16"
    text = user_text(facts, H100, H100_CEILINGS)
    assert "NVIDIA H100 80GB HBM3, compute capability 9.0, 132 SMs, 50 MiB L2, 80 GiB memory" in text
    assert "copy 3,000 GB/s" in text and "bf16 800" in text and "Datasheet (H100 SXM, dense)" in text
    assert "137 GFLOP (bf16)" in text and "compute-bound, with a floor of 172 us" in text
    assert "The datasheet's floor is 139 us" in text
    assert "forbids calling aten::mm, aten::matmul" in text
    assert "atol 0.125, rtol 0.016" in text


def test_without_measured_ceilings_the_prompt_says_so():
    text = user_text(problem_facts(MATMUL, H100), H100, None)
    assert "not measured yet" in text and "Measured here" not in text


def test_the_backends_say_how_to_write_and_launch_a_kernel(cpu, cpu_ceilings):
    facts = problem_facts(FIXTURES / "problems" / "add.py", cpu)
    triton = user_text(facts, cpu, cpu_ceilings, "triton")
    cuda = user_text(facts, cpu, cpu_ceilings, "cuda")
    assert "@triton.jit" in triton and "CudaKernel" not in triton
    assert "CudaKernel(compile_cuda(path, cache=False)" in cuda and ".launch(grid=" in cuda
    assert 'extern "C" __global__' in cuda and "tempfile.mkdtemp()" in cuda
    with pytest.raises(KforgeError, match="unknown backend"):
        first_messages(facts, cpu, cpu_ceilings, "metal")


def test_a_problem_the_meta_device_cannot_run_is_sized_on_the_cpu_there_and_left_unsized_on_a_gpu(write, cpu):
    path = write("data_dependent.py", """
        import torch
        from torch import nn
        N = 64
        class Model(nn.Module):
            def forward(self, x):
                return x[: int(x.abs().argmax().item()) + 1].sum()
        def get_inputs():
            return [torch.randn(N)]
        def get_init_inputs():
            return []
        """)
    on_cpu = problem_facts(path, cpu)
    assert on_cpu.missing is None and on_cpu.inputs == ["float32[64]"] and on_cpu.bytes is not None
    on_gpu = problem_facts(path, H100)
    assert on_gpu.bytes is None and "meta" in on_gpu.missing
    text = user_text(on_gpu, H100, H100_CEILINGS)
    assert "could not be computed here" in text and "Not computed:" in text


def test_a_problem_that_does_not_load_is_one_clear_error(write, cpu):
    path = write("broken.py", "import torch\nclass Model(torch.nn.Module):\n    def forward(self, x)\n")
    with pytest.raises(ProblemError, match="problem failed to import: SyntaxError"):
        problem_facts(path, cpu)
    with pytest.raises(KforgeError, match="no problem file at"):
        problem_facts(path.with_name("missing.py"), cpu)


# --- feedback -------------------------------------------------------------------------

TRACEBACK = """Traceback (most recent call last):
  File "/opt/kforge/harness/candidate.py", line 54, in call
    out = model(*inputs)
  File "/tmp/kforge-results/machine-x/run/s0/t0/candidate.py", line 12, in forward
    y = helper(x)
  File "/tmp/kforge-results/machine-x/run/s0/t0/candidate.py", line 7, in helper
    return x.viewx(-1)
           ^^^^^^^
AttributeError: 'Tensor' object has no attribute 'viewx' (see /tmp/kforge-results/machine-x/run/s0/t0/candidate.py)
"""


def test_an_error_feedback_names_the_lines_in_the_candidates_file_and_the_error():
    record = {"status": "candidate_error", "details": TRACEBACK, "warnings": []}
    text = feedback_text("candidate_error", "ModelNew raised: AttributeError: ... (candidate.py:7)", record, [])
    assert text.startswith("Your previous reply: CANDIDATE_ERROR.")
    assert "line 12, in forward: y = helper(x)" in text and "line 7, in helper: return x.viewx(-1)" in text
    assert "harness/candidate.py" not in text, "kforge's own frames are not the model's to fix"
    assert "AttributeError: 'Tensor' object has no attribute 'viewx' (see candidate.py)" in text
    assert "^^^" not in text and text.endswith(FEEDBACK_CLOSING)


def test_feedback_without_a_record_gives_the_reason_and_flags_are_listed_as_deciding_nothing():
    flags = [{"code": "side_stream", "line": 9, "message": "torch.cuda.Stream: work on another CUDA stream"}]
    text = feedback_text("no_code", "the reply holds no fenced code block", None, flags)
    assert "No file was evaluated: the reply holds no fenced code block." in text
    assert "they decide nothing" in text and "- line 9 [side_stream]: torch.cuda.Stream" in text


def test_a_rejection_names_the_defence():
    record = {"status": "rejected", "defences": ["timing_claims"], "warnings": ["a warning"]}
    text = feedback_text("rejected", "the claimed times are shorter than the judge's", record, [])
    assert "A defence of the judge rejected it (timing_claims): the claimed times" in text
    assert "Warning: a warning" in text


def test_a_pass_asks_for_more_speed():
    gate1 = {"passed": True, "trials": 7, "trials_passed": 7, "max_abs_err": 0.0, "rel_l2_err": 0.0}
    gate2 = {"speedup": 1.8, "rounds": 40, "stats": {"reference": {"median_ms": 2.0}, "candidate": {"median_ms": 1.1}},
             "verdict": {"status": "passed", "low": 1.7, "high": 1.9, "bar": 1.02, "undecided": False}}
    roofline = {"bound": "memory", "floor_ms": 0.9, "candidate": {"pct_of_roof": 81.8, "gbps": 2500.0, "tflops": None},
                "reference": {"pct_of_roof": 45.0}}
    record = {"status": "passed", "gate1": gate1, "gate2": gate2, "roofline": roofline, "warnings": []}
    text = feedback_text("passed", None, record, [])
    assert "reference median 2 ms, yours 1.1 ms; speedup 1.8x, 95% interval 1.7-1.9x over 40 rounds" in text
    assert "Verdict: faster." in text and "yours at 81.8% of roof (the reference 45.0%), memory-bound" in text
    assert text.endswith(FEEDBACK_PASSED)

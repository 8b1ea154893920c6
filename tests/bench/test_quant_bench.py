"""`kforge bench quant`: each problem's baseline and our kernels on the same numbers (gate 1
under Triton's interpreter, tiny sizes, every FP8 baseline), the inputs exact in bf16, and
the rows built from records (TFLOP/s or GB/s of device time, % of the roof)."""

import pytest
import torch

from kforge.bench.quant import FP8_BASELINES, quant_groups, quant_jobs, quant_label, quant_rows, quant_shapes
from kforge.harness.evaluate import evaluate
from kforge.harness.problem import load_problem
from kforge.ladder import source_candidate
from kforge.runtime.interpreter import interpreter_active

SHAPES = quant_shapes()
KEPT_AT_TINY = ("BASELINE",)  # constants that change what is computed, not its size


def test_shapes_cover_the_issue():
    groups = quant_groups(SHAPES)
    assert set(groups) == {"fp8", "w4a16", "nvfp4-gemv", "nvfp4-gemm"}
    assert {s.sizes["BASELINE"] for s in groups["fp8"]} == set(FP8_BASELINES)
    assert {(s.sizes["M"], s.sizes["K"], s.sizes["L"]) for s in groups["nvfp4-gemv"]} == {
        (7168, 16384, 1), (4096, 7168, 8), (7168, 2048, 4)}
    assert any(s.sizes["B"] == 1 for s in groups["w4a16"]) and max(s.sizes["B"] for s in groups["w4a16"]) == 32
    assert len({s.label for s in SHAPES}) == len(SHAPES)
    jobs = list(quant_jobs(groups["fp8"][:1]))
    assert [j.candidate.name for j in jobs] == ["ours block", "ours block Triton", "ours row", "ours tensor"]


# At tiny size only the constants that change what is computed survive: one case per (problem, baseline).
TINY_CASES = list({(s.problem, s.sizes.get("BASELINE")): s for s in SHAPES}.values())


@pytest.mark.skipif(not interpreter_active(), reason="runs the Triton kernels under the interpreter")
@pytest.mark.parametrize("shape", TINY_CASES, ids=lambda s: s.label)
@pytest.mark.slow
def test_every_method_passes_gate_1_against_its_baseline(shape, cpu, cpu_ceilings, fast_timing):
    problem = load_problem(shape.problem, "tiny", {k: v for k, v in shape.sizes.items() if k in KEPT_AT_TINY})
    for method, make in shape.methods.items():
        record = evaluate(problem, source_candidate(method, make, [shape.problem]), device=cpu,
                          ceilings=cpu_ceilings, timing=fast_timing)
        assert record.gate1["passed"], (method, record.reason)


@pytest.mark.parametrize("name", ["fp8_gemm_e4m3", "w4a16_gemv", "nvfp4_gemm"])
def test_the_baselines_bf16_operands_are_exactly_the_quantized_values(name):
    from kforge.kernels.quant.formats import dequantize_int4, dequantize_nvfp4

    problem = load_problem(f"src/kforge/problems/quant/{name}.py", "tiny")
    inputs = problem.make_inputs(0, torch.device("cpu"))
    if name == "fp8_gemm_e4m3":
        a, b, a_scale, b_scale, a_bf16, b_bf16 = inputs
        assert torch.equal(a_bf16.float(), a.float() * a_scale) and torch.equal(b_bf16.float(), b.float() * b_scale.t())
    elif name == "w4a16_gemv":
        _, qweight, scales, w = inputs
        assert torch.equal(w, dequantize_int4(qweight, scales))
    else:
        a, a_s, a_gs, b, b_s, b_gs, a_bf16, b_bf16 = inputs
        assert torch.equal(a_bf16.float(), dequantize_nvfp4(a, a_s, a_gs))
        assert torch.equal(b_bf16.float(), dequantize_nvfp4(b, b_s, b_gs))
        assert (a_s.float() < 448).float().mean() > 0.99  # scales chosen so blocks do not saturate


def _record(label, method, ours_device_ms, ref_device_ms, flops, nbytes, bound, compute_tflops=None):
    shape = next(s for s in SHAPES if s.label == label)
    size = load_problem(shape.problem, "full", shape.sizes).size
    return {"problem": {"name": shape.problem.stem, "size": size}, "candidate": {"name": method}, "status": "passed",
            "gate2": {"speedup": ref_device_ms / ours_device_ms,
                      "profile": {"candidate": {"median_device_ms": ours_device_ms},
                                  "reference": {"median_device_ms": ref_device_ms}}},
            "roofline": {"flops": flops, "bytes": nbytes, "bound": bound, "compute_tflops": compute_tflops,
                         "ceilings": {"copy_gbps": 3000.0}}}


def test_rows_use_device_time_and_the_bounding_ceiling():
    fp8, w4 = SHAPES[0].label, next(s.label for s in SHAPES if s.group == "w4a16")
    records = [_record(fp8, "ours block", 1.0, 0.8, 1.2e12, 2.5e8, "compute", 1500.0),
               _record(w4, "ours", 0.01, 0.05, 1e8, 30_000_000, "memory"),
               _record(fp8, "ours block", 0.8, 0.8, 1.2e12, 2.5e8, "compute", 1500.0)]  # the latest wins
    rows = quant_rows(records)
    assert [(r.shape, r.method) for r in rows] == [(fp8, "ours block"), (w4, "ours")]
    assert rows[0].tflops == pytest.approx(1500.0) and rows[0].pct_of_roof == pytest.approx(100.0)
    assert rows[1].gbps == pytest.approx(3000.0) and rows[1].pct_of_roof == pytest.approx(100.0)
    assert quant_label(records[1]) == w4

"""`kforge bench moe` without a GPU: the shapes and groups issue 33 asks for, the jobs and the labels
a record gets back, the problems' FLOPs and bytes against hand counts, their references against
float64 at the tiny size (every layout and baseline), our kernels through gate 1 under the
interpreter, the rows and targets from fake records, the stage split composing to the whole layer,
and the command line's replot, JSON and one-line error. On a GPU: every problem and baseline at a
reduced size, the block-scaled _scaled_mm this torch takes included, and the stage split."""

import json
import os
import subprocess
import sys

import pytest
import torch

from kforge.bench.moe import (BASELINES, DEEPSEEK, GEMM_PROBLEMS, LAYER_BASELINE, LAYER_PROBLEM, STAGE_RECORD, STAGES,
                              MoeShape, composition_stages, layer_stage_split, moe_baseline, moe_groups, moe_jobs,
                              moe_label, moe_rows, moe_shapes, moe_stage_tables, ours_stages, shape_of)
from kforge.harness.problem import load_problem
from kforge.harness.record import sealed_line
from kforge.runtime.interpreter import interpreter_active, mend_interpreter

SHAPES = moe_shapes()
CPU = torch.device("cpu")


@pytest.fixture
def mended():
    if interpreter_active():
        mend_interpreter()  # bf16 dots and casts as the GPU does them


def _shape(label):
    return next(s for s in SHAPES if s.label == label)


def test_shapes_cover_the_issue():
    labels = [s.label for s in SHAPES]
    assert len(set(labels)) == len(labels) == 14
    groups = moe_groups(SHAPES)
    assert set(groups) == {"bf16", "fp8", "gemm", "layer", "deepgemm", "experts"}
    geometry = {(s.layout, s.groups, s.rows, s.n, s.k) for s in groups["bf16"]}
    assert geometry == {(s.layout, s.groups, s.rows, s.n, s.k) for s in groups["fp8"]}  # each in both dtypes
    assert ("contiguous", 4, 8192, 4096, 7168) in geometry  # DeepGEMM's contiguous shape, the FP8 target's
    assert {("masked", 1, 1024), ("masked", 4, 256)} <= {(s.layout, s.groups, s.rows) for s in groups["deepgemm"]}
    assert len(groups["deepgemm"]) == 6 and all((s.n, s.k) == DEEPSEEK for s in groups["deepgemm"])
    assert {(s.groups, s.rows) for s in groups["experts"]} == {(32, 32), (256, 4)}
    assert [s.label for s in groups["layer"]] == ["layer decode 64 tokens", "layer prefill 8192 tokens"]
    assert _shape("bf16 contiguous 4x8192 N=4096 K=7168").sizes == {"G": 4, "M": 8192, "N": 4096, "K": 7168,
                                                                    "MASKED": 0}
    assert all(s.rows % 128 == 0 for s in SHAPES if s.layout == "contiguous")  # runs start on a tile


def test_every_shape_runs_against_each_baseline_of_its_problem():
    shapes = [_shape("fp8 masked 4x256 N=7168 K=2048"), _shape("layer decode 64 tokens")]
    jobs = list(moe_jobs(shapes))
    assert [j.label for j in jobs] == ["fp8 masked 4x256 N=7168 K=2048 vs loop of _scaled_mm, block scales",
                                       "fp8 masked 4x256 N=7168 K=2048 vs loop of _scaled_mm, row-wise",
                                       f"layer decode 64 tokens vs {LAYER_BASELINE}"]
    assert [j.problem.size for j in jobs] == ["G=4,M=256,N=7168,K=2048,MASKED=1,BASELINE=0",
                                              "G=4,M=256,N=7168,K=2048,MASKED=1,BASELINE=1", "TOKENS=64"]
    assert {j.candidate.name for j in jobs} == {"ours"} and jobs[0].candidate.sha256 != jobs[2].candidate.sha256
    assert [j.problem.name for j in jobs] == ["grouped_gemm_fp8"] * 2 + ["moe_layer_bf16"]


def _record(shape, baseline, status="passed", ours_ms=1.0, ref_ms=1.2, flops=None, nbytes=1_000_000, bound="memory",
            floor_ms=0.5, speedup=None):
    sizes = dict(shape.sizes)
    if baseline is not None:
        sizes["BASELINE"] = baseline
    size = ",".join(f"{k}={v}" for k, v in sizes.items())
    return {"problem": {"name": shape.problem.stem, "size": size}, "candidate": {"name": "ours"}, "status": status,
            "baseline": "eager", "device": {"name": "NVIDIA H100 80GB HBM3"}, "created": "2026-11-29T00:00:00+00:00",
            "versions": {"torch": "2.11.0"}, "command": "kforge bench moe",
            "gate2": {"speedup": speedup or ref_ms / ours_ms,
                      "stats": {"candidate": {"median_ms": ours_ms}, "reference": {"median_ms": ref_ms}},
                      "profile": {"candidate": {"median_device_ms": ours_ms},
                                  "reference": {"median_device_ms": ref_ms}}},
            "roofline": {"flops": flops if flops is not None else shape.flops, "bytes": nbytes, "bound": bound,
                         "floor_ms": floor_ms}}


def test_a_record_gets_its_shape_and_baseline_back():
    for shape in SHAPES:
        for value, name in shape.baselines.items():
            record = _record(shape, value)
            assert shape_of(record) == shape and moe_label(record) == shape.label and moe_baseline(record) == name
    other = {"problem": {"name": "matmul_bf16", "size": "M=16"}, "baseline": "eager"}
    assert shape_of(other) is None and moe_label(other) == "matmul_bf16 M=16" and moe_baseline(other) == "eager"


def test_rows_rates_and_targets_from_records():
    fp8 = _shape("fp8 contiguous 4x8192 N=4096 K=7168")
    bf16 = _shape("bf16 masked 256x4 N=4096 K=7168")
    layer = _shape("layer decode 64 tokens")
    records = [
        _record(fp8, 0, ours_ms=2.0, ref_ms=1.5, bound="compute", floor_ms=1.3),  # replaced by the next
        _record(fp8, 0, ours_ms=1.6, ref_ms=1.5, bound="compute", floor_ms=1.3),
        _record(fp8, 1, status="problem_error"),
        _record(bf16, 0, ours_ms=5.5, ref_ms=6.6, nbytes=15_000_000_000, floor_ms=5.0),
        _record(bf16, 1, ours_ms=5.5, ref_ms=5.0, nbytes=15_000_000_000, floor_ms=5.0),
        _record(layer, None, ours_ms=7.0, ref_ms=7.0, nbytes=19_600_000_000, floor_ms=6.5, speedup=1.003),
        {"bench": STAGE_RECORD, "shape": layer.label, "status": "ok"},  # not a judge's record: no row
    ]
    rows = moe_rows(records)
    assert [(r.shape, r.baseline) for r in rows] == [
        (fp8.label, BASELINES["fp8"][0]), (fp8.label, BASELINES["fp8"][1]), (bf16.label, "torch._grouped_mm"),
        (bf16.label, "loop of torch.mm"), (layer.label, LAYER_BASELINE)]
    fp8_row, failed, grouped, loop, layer_row = rows
    # 2 * 4 * 8192 * 4096 * 7168 FLOPs in 1.6 ms: 1202.6 TFLOP/s, over the 1150 bar
    assert fp8_row.tflops == pytest.approx(2 * 4 * 8192 * 4096 * 7168 / 1.6e-3 / 1e12)
    assert fp8_row.speedup == pytest.approx(1.5 / 1.6) and fp8_row.pct_of_roof == pytest.approx(100 * 1.3 / 1.6)
    assert fp8_row.target == ">= 1,150 TFLOP/s" and fp8_row.met is True
    assert failed.target == ">= 1,150 TFLOP/s" and failed.met is None and not failed.ok and failed.tflops is not None
    assert fp8_row.reason is None
    # 15 GB in 5.5 ms: 2727 GB/s; 1.2x _grouped_mm clears 1.1x; no bar against the loop
    assert grouped.gbps == pytest.approx(15e9 / 5.5e-3 / 1e9) and grouped.met is True and grouped.target == ">= 1.1x"
    assert grouped.baseline_tflops == pytest.approx(2 * 256 * 4 * 4096 * 7168 / 6.6e-3 / 1e12)
    assert loop.target is None and loop.met is None
    assert layer_row.target == ">= 1.5x" and layer_row.met is False  # 1.003x


def _stage_record(shape, ours, theirs, status="ok"):
    def method(times, whole):
        return {"stages": {s: {"device_ms": t, "ms": t} for s, t in zip(STAGES, times)},
                "layer": {"device_ms": whole, "ms": whole}, "rows_used": 33_280}

    return {"bench": STAGE_RECORD, "shape": shape.label, "status": status, "reason": None if status == "ok" else "OOM",
            "device": {"name": "NVIDIA H100 80GB HBM3"}, "created": "2026-11-29T00:00:00+00:00",
            "versions": {"torch": "2.11.0"}, "command": "kforge bench moe", "assignments": 576,
            "methods": {"ours": method(ours, sum(ours) - 0.1), "composition": method(theirs, sum(theirs))},
            "timing": {"rounds": 40}}


def test_stage_tables_sum_the_stages_and_keep_the_whole_layer():
    decode, prefill = _shape("layer decode 64 tokens"), _shape("layer prefill 8192 tokens")
    records = [_stage_record(decode, [0.1, 0.2, 4.0, 2.0, 0.1], [0.2, 0.3, 4.1, 2.1, 0.3]),
               _stage_record(prefill, [], [], status="error")]
    decode_table, failed = moe_stage_tables(records)
    assert [line.stage for line in decode_table.lines] == [*STAGES, "sum of stages", "whole layer"]
    total, whole = decode_table.lines[-2:]
    assert total.ours_ms == pytest.approx(6.4) and total.composition_ms == pytest.approx(7.0)
    assert whole.ours_ms == pytest.approx(6.3) and whole.ratio == pytest.approx(7.0 / 6.3)
    gate_up = decode_table.lines[2]
    assert decode_table.share(gate_up, "ours") == pytest.approx(100 * 4.0 / 6.4)
    assert decode_table.share(gate_up, "composition") == pytest.approx(100 * 4.1 / 7.0)
    assert (decode_table.rows_used, decode_table.assignments, decode_table.rounds) == (33_280, 576, 40)
    assert (failed.status, failed.reason, failed.lines) == ("error", "OOM", [])


def test_full_size_flops_and_bytes_by_hand():
    meta = torch.device("meta")
    bf16 = load_problem(GEMM_PROBLEMS["bf16"], "full", _shape("bf16 contiguous 4x8192 N=4096 K=7168").sizes)
    inputs = bf16.make_inputs(0, meta)
    assert bf16.count_flops(inputs) == 2 * 4 * 8192 * 4096 * 7168 == 1_924_145_348_608
    # bf16 weights 4 x 4096 x 7168, x 32768 x 7168 and out 32768 x 4096, 2 bytes each; m_indices 32768 int32
    assert bf16.module.bytes_moved(inputs) == 2 * (117_440_512 + 234_881_024 + 134_217_728) + 131_072 == 973_209_600
    fp8 = load_problem(GEMM_PROBLEMS["fp8"], "full", _shape("fp8 masked 256x4 N=4096 K=7168").sizes)
    inputs = fp8.make_inputs(0, meta)
    assert fp8.count_flops(inputs) == 2 * 256 * 4 * 4096 * 7168
    # e4m3 weights 256 x 4096 x 7168 and x 1024 x 7168, bf16 out 1024 x 4096, fp32 scales 1024 x 56 and
    # 256 x 32 x 56, masked_m 256 int32: the weights are 99.8% of it
    assert fp8.module.bytes_moved(inputs) == 7_516_192_768 + 7_340_032 + 8_388_608 + 2_064_384 + 1_024
    layer = load_problem(LAYER_PROBLEM, "full", {"TOKENS": 64})
    assert layer.count_flops(layer.make_inputs(0, meta)) == 2 * 64 * 7168 * 256 + 6 * 64 * 9 * 7168 * 2048
    assert _shape("layer decode 64 tokens").flops == 2 * 64 * 7168 * 256 + 6 * 64 * 9 * 7168 * 2048


def test_layer_bytes_count_the_experts_these_tokens_reach():
    from kforge.kernels.moe.gating import Gating, gating_reference

    problem = load_problem(LAYER_PROBLEM, "tiny")
    m = problem.module
    x, gate_weight, bias = problem.make_inputs(3, CPU)
    ids, _ = gating_reference(torch.nn.functional.linear(x.float(), gate_weight.float()),
                              Gating("sigmoid", m.TOP_K, m.N_GROUP, m.TOPK_GROUP, True, m.SCALING), bias)
    reached = len(set(ids.flatten().tolist())) + 1  # and the shared expert
    assert 1 < reached <= m.EXPERTS + 1
    weights = 2 * reached * 3 * 64 * 32  # gate, up and down of each, bf16
    assert m.bytes_moved([x, gate_weight, bias]) == weights + 2 * 16 * 64 + 4 * 16 + 2 * 2 * 37 * 64


def _relative(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("baseline", [0, 1])
@pytest.mark.parametrize("masked", [0, 1])
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_each_baseline_matches_float64_at_the_tiny_size(dtype, masked, baseline):
    from kforge.kernels.moe.grouped_gemm import grouped_gemm_layout_reference

    problem = load_problem(GEMM_PROBLEMS[dtype], "tiny")
    problem.module.MASKED, problem.module.BASELINE = masked, baseline
    init = problem.init_inputs(1, CPU)
    inputs = problem.make_inputs(2, CPU)
    out = problem.build_reference(init, 1, CPU)(*inputs)
    layout = "masked" if masked else "contiguous"
    if dtype == "bf16":
        want = grouped_gemm_layout_reference(inputs[0], init[0], inputs[1], layout)
    else:
        want = grouped_gemm_layout_reference(inputs[0], init[0], inputs[-1], layout, x_scale=inputs[1],
                                             w_scale=init[1])
        # the three scale layouts hold the same numbers
        assert torch.equal(inputs[2].transpose(1, 2).reshape(inputs[1].shape), inputs[1])
        assert torch.equal(inputs[3].expand(*inputs[3].shape[:2], inputs[1].shape[-1]).reshape(inputs[1].shape),
                           inputs[1])
        assert torch.equal(init[2][:, 0, ::128], init[1][:, :, 0])
    assert out.shape == want.shape and out.dtype == torch.bfloat16
    assert _relative(out, want) < 4e-3  # one bf16 rounding


def test_the_layer_composition_matches_float64_at_the_tiny_size():
    from kforge.kernels.moe.deepseek import MoEConfig, moe_layer_reference

    problem = load_problem(LAYER_PROBLEM, "tiny")
    m = problem.module
    init = problem.init_inputs(1, CPU)
    x, gate_weight, bias = problem.make_inputs(2, CPU)
    out = problem.build_reference(init, 1, CPU)(x, gate_weight, bias)
    config = MoEConfig(m.HIDDEN, m.INTER, m.EXPERTS, m.TOP_K, m.N_GROUP, m.TOPK_GROUP, m.SHARED, m.SCALING)
    want = moe_layer_reference(x, gate_weight, bias, init[0], init[1], config)
    assert _relative(out, want) < 1e-2  # bf16 projections, as the Level 3 problem's eager loop
    with pytest.raises(ValueError, match="router's constants"):
        m.Model(init[0], init[1], m.TOP_K + 1, m.N_GROUP, m.TOPK_GROUP, m.SHARED, m.SCALING)


@pytest.mark.slow
@pytest.mark.skipif(not interpreter_active(), reason="runs the Triton kernels under the interpreter")
def test_the_stages_compose_to_the_whole_layer(mended):
    from kforge.kernels.moe.deepseek import MoEConfig, moe_layer

    problem = load_problem(LAYER_PROBLEM, "tiny")
    m = problem.module
    init = problem.init_inputs(1, CPU)
    x, gate_weight, bias = problem.make_inputs(2, CPU)
    config = MoEConfig(m.HIDDEN, m.INTER, m.EXPERTS, m.TOP_K, m.N_GROUP, m.TOPK_GROUP, m.SHARED, m.SCALING)
    ours = ours_stages(x, gate_weight, bias, init[0], init[1], config)
    theirs = composition_stages(m, x, gate_weight, bias, init[0], init[1])
    assert [name for name, _ in ours.stages] == [name for name, _ in theirs.stages] == list(STAGES)
    assert torch.equal(ours.output, moe_layer(x, gate_weight, bias, init[0], init[1], config))
    assert torch.equal(theirs.output, problem.build_reference(init, 1, CPU)(x, gate_weight, bias))
    # 37 tokens x 5 assignments over 17 experts, each run padded to 16 rows
    assert ours.rows_used % 16 == 0 and 37 * 5 <= ours.rows_used <= 37 * 5 + 17 * 15
    assert torch.equal(ours.stages[-1][1](), ours.output)  # a stage called again gives the same


@pytest.mark.slow
@pytest.mark.skipif(not interpreter_active(), reason="runs the Triton kernels under the interpreter")
def test_the_stage_split_times_every_stage_on_the_cpu(cpu, mended):
    from kforge.harness.timing import TimingConfig

    timing = TimingConfig(warmup_s=0.0, min_warmup_calls=1, min_reps=2, min_time_s=0.0, budget_s=0.1)
    figures = layer_stage_split(load_problem(LAYER_PROBLEM, "tiny"), cpu, timing)
    assert set(figures["methods"]) == {"ours", "composition"} and figures["assignments"] == 37 * 5
    for method in figures["methods"].values():
        assert list(method["stages"]) == list(STAGES)
        assert all(t["device_ms"] > 0 for t in [*method["stages"].values(), method["layer"]])
    assert figures["timing"]["clock"] == "host" and figures["timing"]["rounds"] >= 1
    record = {"bench": STAGE_RECORD, "shape": "layer tiny", "status": "ok", **figures}
    (table,) = moe_stage_tables([record])
    assert table.lines[-1].ours_ms == figures["methods"]["ours"]["layer"]["device_ms"]


# At tiny size only the constants that change what is computed survive: one case per (problem, layout, baseline).
TINY_CASES = [(dtype, masked, baseline) for dtype in ("bf16", "fp8") for masked in (0, 1) for baseline in (0, 1)]


@pytest.mark.slow
@pytest.mark.skipif(not interpreter_active(), reason="runs the Triton kernels under the interpreter")
@pytest.mark.parametrize("case", TINY_CASES + [("layer", None, None)], ids=str)
def test_ours_passes_gate_1_against_every_baseline(case, cpu, cpu_ceilings, fast_timing):
    from kforge.harness.evaluate import evaluate

    dtype, masked, baseline = case
    if dtype == "layer":
        shape = _shape("layer decode 64 tokens")
        problem = load_problem(LAYER_PROBLEM, "tiny")
    else:
        shape = next(s for s in SHAPES if s.dtype == dtype and s.layout == ("masked" if masked else "contiguous"))
        problem = load_problem(shape.problem, "tiny", {"MASKED": masked, "BASELINE": baseline})
    job = next(moe_jobs([shape]))  # its candidate
    record = evaluate(problem, job.candidate, device=cpu, ceilings=cpu_ceilings, timing=fast_timing)
    assert record.gate1["passed"], record.reason


def _write(path, records):
    path.write_text("".join(sealed_line(r) + "\n" for r in records))


def _fake_run():
    fp8 = _shape("fp8 contiguous 4x8192 N=4096 K=7168")
    layer = _shape("layer decode 64 tokens")
    refused = {**_record(fp8, 1, status="problem_error"), "gate2": None, "roofline": None,
               "reason": "the reference Model raised: RuntimeError: Invalid scaling configuration"}
    return [_record(fp8, 0, ours_ms=3.30, ref_ms=1.65, bound="compute", floor_ms=1.3), refused,
            _record(layer, None, ours_ms=6.98, ref_ms=6.98, nbytes=19_643_800_000, floor_ms=6.5, speedup=1.0),
            _stage_record(layer, [0.067, 0.224, 3.833, 1.883, 0.007], [0.2, 0.3, 3.9, 1.9, 0.4])]


def test_results_markdown_renders_a_bench_moe_file(tmp_path):
    from kforge.views import results_markdown

    (tmp_path / "some-gpu").mkdir()
    _write(tmp_path / "some-gpu" / "bench-moe.jsonl", _fake_run())
    text = results_markdown(tmp_path)
    assert "### bench-moe" in text
    assert "| fp8 contiguous 4x8192 N=4096 K=7168 | loop of _scaled_mm, block scales |" in text
    assert ">= 1,150 TFLOP/s: missed" in text and "problem_error" in text and "0.50x" in text
    assert "layer decode 64 tokens by stage" in text and "| gate-up GEMM | 3.83 ms | 3.9 ms | 1.02x |" in text


@pytest.mark.slow
def test_replot_draws_the_tables_and_json_without_a_gpu(tmp_path):
    results = tmp_path / "moe.jsonl"
    _write(results, _fake_run())
    args = [sys.executable, "-m", "kforge", "bench", "moe", "--replot", "--results", str(results),
            "--chart", str(tmp_path / "moe.png")]
    done = subprocess.run(args, capture_output=True, text=True, env={**os.environ, "COLUMNS": "250"})
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "MoE grouped GEMMs" in out and "fp8 contiguous 4x8192 N=4096 K=7168" in out
    assert "583" in out  # 1.924 PFLOP in 3.3 ms: 583 TFLOP/s
    assert "0.50x" in out and "missed" in out and "problem_error" in out and "Invalid scaling configuration" in out
    assert "layer decode 64 tokens by stage" in out and "sum of stages" in out and "whole layer" in out
    assert "63.7%" in out  # the gate-up GEMM: 3.833 of the 6.014 ms our stages sum to
    shown = json.loads(subprocess.run([*args, "--json"], capture_output=True, text=True).stdout)
    assert [r["baseline"] for r in shown["rows"]] == [BASELINES["fp8"][0], BASELINES["fp8"][1], LAYER_BASELINE]
    assert [line["stage"] for line in shown["stages"][0]["lines"]] == [*STAGES, "sum of stages", "whole layer"]


@pytest.mark.slow
def test_an_unknown_moe_shape_is_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "kforge", "bench", "moe", "--shapes", "bf16 masked 9x9",
                           "--results", str(tmp_path / "x.jsonl")], capture_output=True, text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "unknown shape in 'bf16 masked 9x9'" in done.stderr and "fp8 masked 256x4 N=4096 K=7168" in done.stderr


# --- on a GPU ------------------------------------------------------------------------------------

def _judge_on_the_gpu(jobs, ceilings):
    from kforge.device import current_device
    from kforge.harness.evaluate import evaluate
    from kforge.harness.timing import TimingConfig

    device = current_device("cuda")
    return [evaluate(job.problem, job.candidate, device=device, ceilings=ceilings, timing=TimingConfig(budget_s=0.2))
            for job in jobs]


@pytest.mark.gpu
@pytest.mark.parametrize("masked", [0, 1])
def test_every_gemm_baseline_and_ours_pass_on_the_gpu(masked, gpu_ceilings):
    """Each problem and baseline at a reduced size, through the judge as the bench runs them: the
    block-scaled _scaled_mm this torch takes (or the reason it refuses) shows here first."""
    shapes = [MoeShape("gemm", dtype, "masked" if masked else "contiguous", 4, 256, 512, 1024)
              for dtype in ("bf16", "fp8")]
    records = _judge_on_the_gpu(list(moe_jobs(shapes)), gpu_ceilings)
    assert len(records) == 4
    for record in records:
        assert record.status in ("passed", "slower", "tie"), (record.problem["size"], record.reason)


@pytest.mark.gpu
def test_the_layer_and_its_stage_split_on_the_gpu(gpu_ceilings):
    from kforge.bench import BenchJob
    from kforge.device import current_device
    from kforge.harness.timing import TimingConfig

    sizes = {"TOKENS": 64, "HIDDEN": 1024, "INTER": 256, "EXPERTS": 64}  # DeepSeek-V3's router, smaller experts
    problem = load_problem(LAYER_PROBLEM, "full", sizes)
    job = next(moe_jobs([_shape("layer decode 64 tokens")]))
    (record,) = _judge_on_the_gpu([BenchJob(job.label, problem, job.candidate)], gpu_ceilings)
    assert record.status in ("passed", "slower", "tie"), record.reason
    figures = layer_stage_split(problem, current_device("cuda"), TimingConfig(budget_s=0.2))
    assert all(t["device_ms"] > 0 for m in figures["methods"].values() for t in m["stages"].values())

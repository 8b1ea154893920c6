"""`kforge bench model` on a CPU: the whole run on the tiny preset (every part, the baselines
uncompiled), the records' fields, the floor's byte count against a hand count, the Poisson
trace, the rows, table and chart, and one line with exit 2 for a bad option. No test
compares one real timing with another: a shared CPU's timings decide nothing."""

import json
import os
import subprocess
import sys
from itertools import pairwise

import pytest
import torch
from rich.console import Console

from kforge.bench import model as bench
from kforge.device import current_device
from kforge.errors import KforgeError
from kforge.harness.record import read_records
from kforge.harness.roofline import Ceilings, save_ceilings
from kforge.models.llama import random_model
from kforge.models.llama.baseline import StaticCacheLlama
from kforge.models.llama.checkpoint import _random_on_device
from kforge.models.llama.config import LlamaConfig
from kforge.models.llama.quantize import weight_bytes

TINY_SIZES = ("prompt=12,steps=4,warmup=1,batch=3,context=48,batch_steps=2,prefill_batch=2,prefill_len=16,"
              "prefill_reps=2,requests=5,rate=200,trace_prompt=3:9,trace_output=2:5,slots=3,step_tokens=32")
# every K a multiple of 128, so that W4A16 and FP8 take it: 2 layers, GQA, an untied head
QUANTIZABLE = LlamaConfig(vocab_size=512, dim=128, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=256,
                          max_position=256)


@pytest.fixture(autouse=True)
def copy_ceiling():
    """A cached copy ceiling, so that no test spends seconds measuring the CPU's."""
    cpu = current_device("cpu")
    save_ceilings(cpu, Ceilings(device=cpu.name, kind="cpu", copy_gbps=10.0, matmul_tflops={}, measured_on="test"))


def kforge(*args):
    return subprocess.run([sys.executable, "-m", "kforge", *map(str, args)], capture_output=True, text=True,
                          check=False, timeout=300, env={**os.environ, "COLUMNS": "250"})


@pytest.mark.slow
def test_the_whole_bench_runs_on_the_tiny_preset(tmp_path):
    results = tmp_path / "bench-model.jsonl"
    done = kforge("bench", "model", "--model", "tiny", "--sizes", TINY_SIZES, "--results", results)
    assert done.returncode == 0, done.stderr
    records = read_records(results)
    methods = [(r["part"], r["method"], r["status"]) for r in records]
    assert methods == [("decode", "ours bf16", "ok"), ("decode", "transformers", "ok"), ("decode", "compiled", "ok"),
                       ("decode", "ours w4a16", "error"), ("decode", "ours w4a16, head w4a16", "error"),
                       ("decode", "ours fp8", "error"), ("decode", "ours fp8, head fp8", "error"),
                       ("batch", "ours bf16", "ok"), ("batch", "compiled", "ok"),
                       ("prefill", "ours bf16", "ok"), ("prefill", "transformers", "ok"),
                       ("prefill", "compiled", "ok"), ("trace", "ours bf16", "ok")]
    for r in records:
        for key in ("device", "versions", "created", "command", "model", "part", "method", "figures", "sizes"):
            assert r[key] is not None, key
        assert r["model"] == "tiny" and r["command"].startswith("kforge bench model")
        assert r["copy"] == {"gbps": 10.0, "source": "kforge roofline's cache, measured test"}
    # the tiny shape's K of 64 is refused by the quantized formats: recorded, and the run went on
    assert "multiple of 128" in records[3]["reason"]
    decode = records[0]["figures"]
    assert decode["timing"]["n"] == 4 and decode["timing"]["clock"] == "host" and decode["dtype"] == "float32"
    assert decode["pct_of_floor"] == pytest.approx(100 * decode["floor_ms"] / decode["ms"])
    assert records[2]["figures"]["compiled"] is False and "CUDA only" in records[2]["figures"]["note"]
    trace = records[-1]["figures"]
    assert trace["requests"] == 5 and trace["ttft_p50_ms"] > 0 and trace["tok_s"] > 0
    assert "decode" in done.stdout and "vs compiled" in done.stdout and f"appended to {results}" in done.stdout
    assert "[" in done.stdout.splitlines()[0] and "s]" in done.stdout.splitlines()[0]  # progress, with seconds
    assert results.with_suffix(".png").stat().st_size > 10_000

    replot = kforge("bench", "model", "--replot", "--results", results, "--json")
    assert replot.returncode == 0, replot.stderr
    rows = json.loads(replot.stdout)["rows"]
    assert [(r["part"], r["method"]) for r in rows] == [m[:2] for m in methods]
    assert rows[0]["vs"]["compiled"] == pytest.approx(rows[0]["tok_s"] / rows[2]["tok_s"])


@pytest.mark.slow
def test_quantized_formats_run_every_part_and_a_failing_method_is_recorded(monkeypatch):
    def broken(model):
        raise RuntimeError("no transformers today\nsecond line")

    monkeypatch.setattr(bench, "_transformers_model", broken)
    options = bench.ModelBenchOptions.parse(model="tiny", weights="w4a16,fp8,bf16", sizes=TINY_SIZES)
    lines = []
    records = bench.ModelBench(options, results=None, config=QUANTIZABLE, log=lines.append).run()
    status = {(r["part"], r["method"]): r["status"] for r in records}
    assert status == {("decode", "ours w4a16"): "ok", ("decode", "ours w4a16, head w4a16"): "ok",
                      ("decode", "ours fp8"): "ok", ("decode", "ours fp8, head fp8"): "ok",
                      ("decode", "ours bf16"): "ok",
                      ("decode", "transformers"): "error", ("decode", "compiled"): "ok",
                      ("batch", "ours w4a16"): "ok", ("batch", "compiled"): "ok",
                      ("prefill", "ours w4a16"): "ok", ("prefill", "transformers"): "error",
                      ("prefill", "compiled"): "ok", ("trace", "ours w4a16"): "ok"}
    failed = next(r for r in records if r["status"] == "error")
    assert failed["reason"] == "RuntimeError: no transformers today second line" and "Traceback" in failed["details"]
    rows = {(r.part, r.method): r for r in bench.model_rows(records)}
    w4 = rows[("decode", "ours w4a16")]
    assert set(w4.vs) == {"compiled", "transformers", "ours bf16"} and w4.vs["transformers"] is None
    assert w4.vs["ours bf16"] == pytest.approx(w4.tok_s / rows[("decode", "ours bf16")].tok_s)
    assert rows[("batch", "ours w4a16")].vs["compiled"] is not None
    for fmt in ("w4a16", "fp8"):  # the head's bytes in the format: the same blocks, a smaller floor
        blocks, head = rows[("decode", f"ours {fmt}")].figures, rows[("decode", f"ours {fmt}, head {fmt}")].figures
        assert 0 < head["weight_bytes"] < blocks["weight_bytes"]
        assert rows[("decode", f"ours {fmt}, head {fmt}")].vs["ours bf16"] is not None
    assert any("decode ours fp8: start" in line for line in lines)


def test_nothing_starts_past_max_seconds():
    options = bench.ModelBenchOptions.parse(model="tiny", parts="decode,trace", sizes=TINY_SIZES, max_seconds=1e-9)
    records = bench.ModelBench(options, results=None).run()
    assert [(r["part"], r["method"], r["status"]) for r in records] == [("decode", "all", "skipped"),
                                                                        ("trace", "all", "skipped")]
    assert "--max-seconds" in records[0]["reason"]


def test_weight_bytes_and_the_floor_against_a_hand_count():
    c = QUANTIZABLE  # q_dim 128, kv_dim 64: wqkv 256 x 128, wo 128 x 128, w_gate_up 512 x 128, w_down 128 x 256
    linear = [(256, 128), (128, 128), (512, 128), (128, 256)]  # (N, K) per layer
    unquantized = 2 * (c.n_layers * 2 * 128 + 128 + 512 * 128)  # the norms, the final norm, the head: bf16
    hand = {
        "bf16": 2 * c.n_layers * sum(n * k for n, k in linear) + unquantized,
        # INT4: half a byte a weight, one bf16 scale per 128 of a row
        "w4a16": c.n_layers * sum(n * k // 2 + n * (k // 128) * 2 for n, k in linear) + unquantized,
        # FP8: a byte a weight, one fp32 scale per 128 x 128 block
        "fp8": c.n_layers * sum(n * k + -(-n // 128) * (k // 128) * 4 for n, k in linear) + unquantized,
    }
    assert hand == {"bf16": 722_176, "w4a16": 284_416, "fp8": 427_336}
    for fmt, want in hand.items():
        assert weight_bytes(random_model(c, weights=fmt)) == want, fmt
    # K and V of 2 layers x 64 values in bf16: 512 bytes a token; 3 sequences of 10 tokens
    assert c.kv_bytes_per_token(torch.bfloat16) == 512
    assert bench.decode_bytes(hand["bf16"], c, batch=3, context=10) == 722_176 + 3 * 10 * 512
    assert bench.floor_ms(3e9, 3000.0) == pytest.approx(1.0)  # 3 GB at 3,000 GB/s: a millisecond


def test_prefill_flops_count_every_matmul_once():
    c = QUANTIZABLE
    per_token = c.n_layers * 2 * (128 * 256 + 128 * 128 + 3 * 128 * 256)
    attention = c.n_layers * 2 * 2 * 64 * 16 * 16  # 2 heads x d 64, QK^T and PV over half of 16 x 16, 2 flops
    assert bench.prefill_flops(c, 3, 16) == 3 * (16 * per_token + attention + 2 * 512 * 128)


def test_the_poisson_trace_is_seeded_with_the_rate_asked():
    trace = bench.poisson_trace(20_000, 5.0, (1, 4), (2, 3), vocab=50, seed=7)
    assert trace == bench.poisson_trace(20_000, 5.0, (1, 4), (2, 3), vocab=50, seed=7)
    assert trace != bench.poisson_trace(20_000, 5.0, (1, 4), (2, 3), vocab=50, seed=8)
    gaps = [b.arrival - a.arrival for a, b in pairwise(trace)]
    assert all(g >= 0 for g in gaps)
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 5.0, rel=0.03)  # the mean gap: 1 / rate (sd of it 0.7%)
    assert {len(r.prompt) for r in trace} == {1, 2, 3, 4} and {r.max_tokens for r in trace} == {2, 3}
    assert all(0 <= t < 50 for r in trace for t in r.prompt)


def test_time_steps_times_every_step_after_the_warmup():
    calls = []
    timing = bench.time_steps(lambda: calls.append(1), steps=5, warmup=2, cuda=False)
    assert len(calls) == 7 and timing.n == 5 and timing.clock == "host"
    assert 0 <= timing.p10_ms <= timing.median_ms <= timing.p90_ms and timing.wall_s >= 0


def test_rows_table_and_chart_from_records(tmp_path):
    def record(part, method, tok_s, status="ok", **figures):
        return {"bench": "model", "run": "r1", "part": part, "method": method, "weights": "bf16", "status": status,
                "reason": None if status == "ok" else "OutOfMemoryError: CUDA out of memory",
                "figures": {"tok_s": tok_s, "ms": 1e3 / tok_s if tok_s else None, **figures} if status == "ok" else {}}

    old = {**record("decode", "ours bf16", 1.0), "run": "r0"}  # an earlier run: left out
    records = [old, record("decode", "ours bf16", 150.0, pct_of_floor=90.0), record("decode", "compiled", 120.0),
               record("decode", "transformers", 30.0), record("decode", "ours w4a16", 300.0),
               record("batch", "ours bf16", None, status="error"), record("batch", "compiled", 2000.0),
               record("trace", "ours bf16", 900.0, ttft_p50_ms=40.0, ttft_p99_ms=90.0, tpot_p50_ms=11.0,
                      tpot_p99_ms=30.0, requests=64, offered_rate=4.0)]
    rows = bench.model_rows(records)
    assert [(r.part, r.method) for r in rows] == [("decode", "ours bf16"), ("decode", "compiled"),
                                                  ("decode", "transformers"), ("decode", "ours w4a16"),
                                                  ("batch", "ours bf16"), ("batch", "compiled"), ("trace", "ours bf16")]
    assert rows[0].vs == {"compiled": pytest.approx(1.25), "transformers": pytest.approx(5.0)}
    assert rows[3].vs["ours bf16"] == pytest.approx(2.0) and rows[1].vs == {}
    assert rows[4].vs == {"compiled": None} and "out of memory" in rows[4].note
    assert "TTFT p50/p99 40.0/90.0 ms" in rows[6].note
    console = Console(width=250, record=True)
    console.print(bench.model_view(rows, title="llama3-8b on H100", copy={"gbps": 3000.0, "source": "cached"},
                             results_path="bench-model.jsonl"))
    text = console.export_text()
    assert "1.25x" in text and "5.00x" in text and "90.0%" in text and "3,000 GB/s" in text
    assert bench.save_model_chart(rows, tmp_path / "chart.png", title="t").stat().st_size > 10_000


@pytest.mark.parametrize("options, message", [
    ({"model": "llama9"}, "no preset 'llama9'"),
    ({"parts": "decode,serve"}, "--parts: serve is not one of decode, batch, prefill, trace"),
    ({"weights": "int3"}, "--weights: int3"),
    ({"baselines": "vllm"}, "--baselines: vllm"),
    ({"sizes": "prompt=x"}, "prompt='x' is not a valid number"),
    ({"sizes": "promt=4"}, "unknown key 'promt'"),
    ({"sizes": "trace_prompt=9:3"}, "low end above its high end"),
    ({"sizes": "steps=0"}, "steps must be positive"),
    ({"model": "tiny"}, "decode needs prompt + warmup + steps + 1 = 777 positions; the model has 512"),
    ({"model": "tiny", "parts": "batch", "sizes": "context=40"}, "leaves no prompt"),
    ({"compile_mode": "fast"}, "--compile-mode: 'fast'"),
    ({"max_seconds": 0}, "--max-seconds must be positive"),
])
def test_bad_options_are_one_line(options, message):
    with pytest.raises(KforgeError) as caught:
        bench.ModelBenchOptions.parse(**options)
    assert message in caught.value.reason and "\n" not in caught.value.reason


@pytest.mark.parametrize("args, message", [
    (["model", "--model", "tiny", "--parts", "nope"], "--parts: nope is not one of"),
    (["model", "--model", "llama3-8b", "--parts", "trace"], "on a CPU only a small model runs"),
    (["gemm", "--parts", "decode"], "--parts: for kforge bench model only"),
])
def test_the_command_line_refuses_bad_options_with_exit_2(args, message):
    done = kforge("bench", *args)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_sizes_parse_ranges_and_numbers():
    sizes = bench.Sizes.parse("rate=2.5, trace_prompt=8:16,trace_output=4,prompt=7")
    assert (sizes.rate, sizes.trace_prompt, sizes.trace_output, sizes.prompt) == (2.5, (8, 16), (4, 4), 7)
    assert bench.Sizes.parse(None) == bench.Sizes() == bench.Sizes.parse("")


def test_the_baselines_last_position_alone_equals_the_full_forwards():
    model = random_model("tiny", dtype=torch.float32)
    tokens, positions = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0)), torch.arange(9)
    full = StaticCacheLlama(model, max_batch=2, max_context=16)(tokens, positions)
    last = StaticCacheLlama(model, max_batch=2, max_context=16)(tokens, positions, last_only=True)
    assert last.shape == (2, 1, 256) and torch.allclose(last, full[:, -1:], atol=1e-5)


def test_device_drawn_weights_are_seeded_and_shaped_like_the_cpus():
    cpu = torch.device("cpu")  # the device path, on the one device a CPU machine has
    a = _random_on_device(QUANTIZABLE, 3, torch.bfloat16, cpu)
    b = _random_on_device(QUANTIZABLE, 3, torch.bfloat16, cpu)
    reference = random_model(QUANTIZABLE, seed=3)
    for (name, p), q, r in zip(a.named_parameters(), b.parameters(), reference.parameters()):
        assert p.dtype == torch.bfloat16 and p.shape == r.shape and torch.equal(p, q), name
        if "norm" in name:
            assert torch.equal(p, torch.ones_like(p)), name
    assert a.layers[0].w_gate_up.float().std().item() == pytest.approx(0.02, rel=0.05)


def test_the_three_decoders_generate_the_same_greedy_tokens():
    """The methods timed do the same work: in fp32 on the tiny model, transformers' static-cache
    loop and the baseline's loop give the engine's greedy tokens."""
    from kforge.models.engine import Engine
    from kforge.models.sampling import SamplingParams

    pytest.importorskip("transformers")
    options = bench.ModelBenchOptions.parse(model="tiny", parts="decode", sizes=TINY_SIZES)
    run = bench.ModelBench(options, results=None)
    model = random_model(run.config, dtype=torch.float32)
    prompt = list(range(3, 15))
    want = Engine(model, max_slots=1, max_context=64).generate([prompt], SamplingParams(max_tokens=6))[0]
    tokens, positions = torch.tensor([prompt]), torch.arange(64)
    step, _ = bench._transformers_decoder(model, tokens, positions, 64)
    assert [int(step()) for _ in range(5)] == want[1:]  # the prefill gave the first
    base = StaticCacheLlama(model, max_batch=1, max_context=64)
    first = base(tokens, positions[:12])[:, -1].argmax(-1, keepdim=True)
    step, extra = run._compiled_loop(base, first, positions, 12)  # runs its first step
    assert int(first) == want[0] and [int(step()) for _ in range(4)] == want[2:] and extra["compiled"] is False


def test_a_lost_device_context_skips_the_rest_and_the_run_still_ends(monkeypatch):
    options = bench.ModelBenchOptions.parse(model="tiny", parts="decode,trace", weights="bf16", baselines="compiled",
                                      sizes=TINY_SIZES)
    run = bench.ModelBench(options, results=None)

    def lose_the_context(model, prompt):
        run.lost = "AcceleratorError: CUDA error: an illegal memory access was encountered"  # as free() would see it
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(run, "_decode_ours", lose_the_context)
    records = run.run()
    assert [(r["part"], r["method"], r["status"]) for r in records] == [
        ("decode", "ours bf16", "error"), ("decode", "compiled", "skipped"), ("trace", "all", "skipped")]
    assert "the CUDA context was lost" in records[1]["reason"] and "illegal memory access" in records[2]["reason"]

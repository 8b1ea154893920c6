"""Attention: the online-softmax tracer (the worked example by hand), naive attention against
SDPA's math in float64, the Triton FlashAttention forward under the interpreter (fp16,
fp32) on odd shapes, causal or not, with grouped-query heads; kforge.ops.flash_attention
as a custom op with autograd; the benchmark's shapes, bytes and views. On a GPU: bf16 and
fp16, head dims 64/128/256, against a float64 reference."""

import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kforge.bench import bench_rows
from kforge.bench.attention import (BASELINE, attention_label, attention_methods, attention_shapes, hbm_bytes,
                                    save_attention_chart)
from kforge.cli import parse_trace_args
from kforge.errors import KforgeError
from kforge.kernels.attention.flash_forward import check_attention_inputs, flash_attention_forward
from kforge.kernels.attention.naive import naive_attention
from kforge.kernels.attention.online_softmax import trace_online_softmax
from kforge.ops import flash_attention

# (batch, heads, kv_heads, seq_q, seq_k, head_dim): tails in both lengths, Nq < Nk, Nq > Nk, GQA 2 and 4
ODD = [(1, 2, 2, 37, 37, 16), (2, 4, 2, 45, 70, 32), (1, 4, 1, 70, 29, 64), (1, 2, 1, 1, 33, 32)]


def _inputs(shape, dtype, device="cpu", seed=0):
    b, h, hk, nq, nk, d = shape
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, n_h, n, d, generator=g) for n_h, n in ((h, nq), (hk, nk), (hk, nk)))
    return [t.to(dtype=dtype, device=device) for t in (q, k, v)]


# --- the online softmax, by hand -------------------------------------------------------------

def test_trace_reproduces_the_worked_example_of_tiles_1_3_and_2_5():
    trace = trace_online_softmax([[1, 3], [2, 5]])
    first, second = trace.steps
    assert (first.tile_max, first.m_new, first.rescale) == (3, 3, 0.0)
    assert first.l_new == pytest.approx(math.exp(-2) + 1) and round(first.l_new, 2) == 1.14  # "≈ 1.14" on the board
    assert (second.m_old, second.m_new) == (3, 5)
    assert second.rescale == pytest.approx(math.exp(3 - 5))  # the old sum is rescaled by e^(3-5)
    assert second.l_new == pytest.approx(first.l_new * math.exp(-2) + math.exp(-3) + 1)
    whole = sum(math.exp(s - 5) for s in (1, 3, 2, 5))
    assert second.l_new == pytest.approx(whole, rel=1e-15)  # the same answer as all four at once
    assert trace.online == pytest.approx([math.exp(s - 5) / whole for s in (1, 3, 2, 5)], rel=1e-14)
    assert trace.agrees() and trace.max_error < 1e-15


def test_trace_running_output_is_the_softmax_weighted_average_of_the_values():
    trace = trace_online_softmax([[0.5], [-1, 4, 2], [3]], values=[10, 20, 30, 40, 50])
    p = torch.softmax(torch.tensor([0.5, -1, 4, 2, 3], dtype=torch.float64), 0)
    assert trace.output == pytest.approx(float(p @ torch.tensor([10.0, 20, 30, 40, 50], dtype=torch.float64)))
    assert trace.steps[0].output == 10  # one score: all the weight on its value
    assert trace.steps[2].rescale == 1.0  # tile 3 (max 3) does not raise the max of 4


def test_trace_rejects_empty_tiles_and_miscounted_values():
    with pytest.raises(ValueError, match="no empty tile"):
        trace_online_softmax([[1], []])
    with pytest.raises(ValueError, match="one value per score"):
        trace_online_softmax([[1, 3], [2, 5]], values=[1, 2, 3])


def test_trace_arguments_take_tiles_after_one_flag_and_an_optional_value_list():
    assert parse_trace_args(["--tiles", "1,3", "2,5"]) == ([[1, 3], [2, 5]], None)
    assert parse_trace_args(["--tiles", "1,3", "--tiles", "2,5", "--values"]) == ([[1, 3], [2, 5]], [1, 2, 3, 4])
    assert parse_trace_args(["--values", "7,8", "--tiles", "-1,3"]) == ([[-1, 3]], [7, 8])
    for bad in (["--tiles"], ["--tiles", "1,x"], ["2,5"], ["--tiles", "1", "--bogus"]):
        with pytest.raises(KforgeError):
            parse_trace_args(bad)


@pytest.mark.slow
def test_trace_command_prints_each_step_and_fails_cleanly_on_bad_input():
    run = [sys.executable, "-m", "kforge", "trace", "online-softmax"]
    done = subprocess.run([*run, "--tiles", "1,3", "2,5", "--values"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "exp(3 - 5) = 0.135335" in done.stdout and "= 1.20344" in done.stdout and "agree" in done.stdout
    bad = subprocess.run([*run, "--tiles", "1,3", "--values", "1,2,3"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines() == ["error: 3 values for 2 scores: give one value per score"]


# --- naive attention, the reference ----------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", ODD, ids=str)
def test_naive_attention_matches_sdpa_math_in_float64(shape, causal):
    q, k, v = _inputs(shape, torch.float64)
    out, lse = naive_attention(q, k, v, causal=causal, scale=0.3, return_lse=True)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    group = shape[1] // shape[2]
    scores = q @ k.repeat_interleave(group, 1).transpose(-2, -1) * 0.3
    if causal:
        scores = scores.masked_fill(~torch.ones(scores.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), rtol=1e-10, atol=1e-10)


# --- the Triton kernel under the interpreter -------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", ODD, ids=str)
@pytest.mark.slow
def test_flash_forward_matches_float64_naive_under_the_interpreter(shape, causal, dtype):
    q, k, v = _inputs(shape, dtype)
    out, lse = flash_attention_forward(q, k, v, causal=causal, config={"BLOCK_M": 16, "BLOCK_N": 16})
    ref, ref_lse = naive_attention(q.double(), k.double(), v.double(), causal=causal, return_lse=True)
    # fp16: P is rounded to fp16 before P V (2^-11 relative); fp32 runs the products exactly
    tol = 2e-3 if dtype == torch.float16 else 2e-6
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == q.shape[:3]


def test_flash_forward_tiles_larger_than_the_sequence_and_many_key_blocks_agree():
    q, k, v = _inputs((1, 2, 2, 100, 200, 32), torch.float32, seed=3)
    ref = naive_attention(q.double(), k.double(), v.double(), causal=True)
    for blocks in ({"BLOCK_M": 16, "BLOCK_N": 16}, {"BLOCK_M": 64, "BLOCK_N": 32}, {"BLOCK_M": 128, "BLOCK_N": 64}):
        out, _ = flash_attention_forward(q, k, v, causal=True, config=blocks)
        torch.testing.assert_close(out.double(), ref, rtol=2e-6, atol=2e-6, msg=lambda m: f"{blocks}: {m}")


def test_flash_forward_reads_strided_views_and_honours_the_scale():
    # (batch, seq, heads, dim) viewed as (batch, heads, seq, dim): what a model hands over
    raw = torch.randn(3, 2, 41, 4, 32)
    q, k, v = (raw[i].transpose(1, 2) for i in range(3))
    assert not q.is_contiguous()
    out, _ = flash_attention_forward(q, k, v, scale=0.05, config={"BLOCK_M": 16, "BLOCK_N": 16})
    ref = naive_attention(q.double(), k.double(), v.double(), scale=0.05)
    torch.testing.assert_close(out.double(), ref, rtol=2e-6, atol=2e-6)
    assert out.stride() == q.stride()  # the output keeps the caller's layout


def test_flash_forward_refuses_what_it_cannot_take():
    q, k, v = _inputs((1, 4, 2, 8, 8, 32), torch.float32)
    cases = [
        ((q[0], k, v, None), "4-D"),
        ((q, k.half(), v, None), "share one dtype"),
        ((q, k[:, :1].expand(1, 3, 8, 32), v[:, :1].expand(1, 3, 8, 32), None), "multiple of key/value heads"),
        ((q[..., :24], k[..., :24], v[..., :24], None), "head_dim 24"),
        ((q, k[:, :, :0], v[:, :, :0], None), "no keys"),
        ((q, k, v, -1.0), "positive finite"),
        ((q.transpose(2, 3), k, v, None), "must be"),
    ]
    for (a, b, c, scale), message in cases:
        with pytest.raises(ValueError, match=message):
            check_attention_inputs(a, b, c, scale)


# --- the custom op ---------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
def test_op_passes_opcheck_and_its_gradients_match_naive_autograd(causal):
    q, k, v = (t.requires_grad_() for t in _inputs((2, 4, 2, 9, 11, 16), torch.float64))
    torch.library.opcheck(torch.ops.kforge.flash_attention.default, (q.detach(), k.detach(), v.detach(), causal, 0.3))
    out, lse = flash_attention(q, k, v, causal=causal, scale=0.3, return_lse=True)
    ref, ref_lse = naive_attention(q, k, v, causal=causal, scale=0.3, return_lse=True)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    g_out, g_lse = torch.randn_like(out), torch.randn_like(lse)
    mine = torch.autograd.grad((out * g_out).sum() + (lse * g_lse).sum(), (q, k, v))
    theirs = torch.autograd.grad((ref * g_out).sum() + (ref_lse * g_lse).sum(), (q, k, v))
    for a, b in zip(mine, theirs):  # the saved log-sum-exp is fp32: agreement to ~1e-6
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_op_compiles_into_one_graph_with_the_sdpa_layout():
    q, k, v = _inputs((1, 4, 2, 16, 16, 32), torch.float32)
    compiled = torch.compile(lambda a, b, c: flash_attention(a, b, c, causal=True) * 2, backend="aot_eager",
                             fullgraph=True)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True) * 2
    torch.testing.assert_close(compiled(q, k, v), expected, rtol=1e-5, atol=1e-5)


# --- the benchmark ---------------------------------------------------------------------------

def test_bench_shapes_fill_the_gpu_and_hold_the_target_shape(monkeypatch):
    from kforge.bench import attention as bench

    monkeypatch.setattr(bench, "hopper_gpu", lambda: False)  # "ours-cuda" joins on Hopper: test_flash_hopper.py
    shapes = attention_shapes()
    assert len(shapes) == 6 * 2 * 2
    assert all(s.batch * s.seq == 32768 and s.heads * s.head_dim == 2048 for s in shapes)
    target = [s for s in shapes if (s.seq, s.head_dim) == (4096, 128)]
    assert {s.causal for s in target} == {False, True} and all(s.batch * s.heads == 128 for s in target)
    big = next(s for s in shapes if s.seq == 16384)
    assert "naive" not in attention_methods(big) and "naive" in attention_methods(target[0])
    assert set(attention_methods(target[0])) == {"ours", "naive", "sdpa-cudnn", "sdpa-efficient"}


def test_bench_bytes_charge_naive_for_its_scores_only():
    sizes = {"B": 8, "H": 16, "KV_HEADS": 16, "N": 4096, "D": 128}
    qkvo = 4 * 8 * 16 * 4096 * 128 * 2
    assert hbm_bytes("ours", sizes) == hbm_bytes("sdpa-cudnn", sizes) == qkvo
    assert hbm_bytes("naive", sizes) == qkvo + 4 * 2 * 8 * 16 * 4096**2  # 17 GB against 0.5 GB
    assert hbm_bytes("ours", {**sizes, "KV_HEADS": 4}) == qkvo // 2 + qkvo // 8


def _record(method, ms, ref_ms, causal=0, status="slower", n=4096):
    return {"candidate": {"name": method}, "status": status,
            "problem": {"name": "attention_bf16", "size": f"B=8,H=16,KV_HEADS=16,N={n},D=128,CAUSAL={causal}"},
            "roofline": {"flops": 1e12, "ceilings": {"matmul_tflops": {"bf16": 780.0}}},
            "gate2": {"stats": {"candidate": {"median_ms": ms}, "reference": {"median_ms": ref_ms}}}}


def test_bench_rows_and_views_report_against_sdpa_flash(tmp_path):
    from rich.console import Console

    from kforge.views import attention_bench_view

    records = [_record("ours", 2.0, 3.0), _record("naive", 30.0, 3.0, status="slower"),
               _record("ours", 2.5, 2.5, causal=1, status="incorrect"), _record("ours", 1.0, 1.5, n=2048)]
    rows = bench_rows(records, BASELINE, attention_label)
    assert [r.shape for r in rows] == ["full N=4096 D=128", "causal N=4096 D=128", "full N=2048 D=128"]
    assert rows[0].vs_baseline == {"ours": 1.5, "naive": 0.1} and rows[0].tflops[BASELINE] == pytest.approx(1000 / 3)
    console = Console(record=True, width=200)
    console.print(attention_bench_view(rows, title="t", records=records, results_path=None))
    text = console.export_text()
    assert "1.500x" in text and "500" in text and "incorrect" in text and "17.72 GB" in text
    assert "FlashAttention-3 paper" in text and "ours at N=4096: 78% of it non-causal" in text
    assert save_attention_chart(rows, tmp_path / "a.png", title="t", records=records).stat().st_size > 10_000


# --- on the GPU ------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_forward_on_the_gpu_matches_float64(head_dim, causal, dtype):
    for shape in [(2, 8, 2, 1000, 1000, head_dim), (1, 4, 4, 77, 300, head_dim), (1, 4, 1, 513, 129, head_dim)]:
        q, k, v = _inputs(shape, dtype, "cuda")
        out, lse = flash_attention_forward(q, k, v, causal=causal)
        ref, ref_lse = naive_attention(q.double(), k.double(), v.double(), causal=causal, return_lse=True)
        torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=1e-2 if dtype == torch.bfloat16 else 2e-3)
        torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_op_on_the_gpu_runs_our_kernel_and_compiles_with_inductor():
    q, k, v = _inputs((2, 8, 2, 300, 300, 128), torch.bfloat16, "cuda")
    compiled = torch.compile(lambda a, b, c: flash_attention(a, b, c, causal=True), fullgraph=True)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(compiled(q, k, v), expected, rtol=2e-2, atol=1e-2)


def test_the_cuda_forward_is_chosen_for_head_dim_128_in_16_bits_on_sm90_only():
    from kforge.ops.attention import cuda_forward_chosen

    assert cuda_forward_chosen(torch.bfloat16, 128, (9, 0)) and cuda_forward_chosen(torch.float16, 128, (9, 0))
    assert not cuda_forward_chosen(torch.bfloat16, 64, (9, 0))  # Triton level or ahead there
    assert not cuda_forward_chosen(torch.float32, 128, (9, 0))
    assert not cuda_forward_chosen(torch.bfloat16, 128, (10, 0))  # sm_90a code: Hopper only
    assert not cuda_forward_chosen(torch.bfloat16, 128, (8, 0))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_op_on_the_gpu_takes_the_cuda_forward_at_head_dim_128_and_its_backward_agrees(dtype, monkeypatch):
    from kforge.kernels.attention import flash_hopper

    calls = []
    real = flash_hopper.flash_attention_hopper
    monkeypatch.setattr(flash_hopper, "flash_attention_hopper", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v = (t.requires_grad_() for t in _inputs((2, 8, 2, 300, 300, 128), dtype, "cuda"))
    out = flash_attention(q, k, v, causal=True)
    assert calls == [1] if torch.cuda.get_device_capability() == (9, 0) else calls == []
    expected = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=1e-2)
    g = torch.randn_like(out)
    mine = torch.autograd.grad((out * g).sum(), (q, k, v))
    theirs = torch.autograd.grad((expected * g.double()).sum(), (q, k, v))
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a.double(), b.double(), rtol=5e-2, atol=5e-2)

"""FlashAttention backward: the Triton kernels under the interpreter against float64 autograd of
plain attention (dQ, dK, dV by relative error; fp32, fp16, bf16; head dims 16..256; causal or not;
GQA 1, 2, 4; lengths off the tiles, Nq != Nk; the log-sum-exp's own gradient), the deterministic
mode bit for bit, NaN-poisoned outputs fully written, scores far below zero, strided layouts, bad
input refused; `kforge.ops.flash_attention`'s autograd on the kernels and on its fallback, and
under torch.compile; the sm_90 builds compiled offline (no spills, wgmma). On a GPU: the target
shape (B 4, H 16, N 4096, hd 128) and odd shapes against float64 and SDPA's flash backward."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import kforge.ops.attention as attention_op
from kforge.kernels.attention import flash_backward
from kforge.kernels.attention.flash_backward import (DKDV_ATOMIC_DQ_CONFIGS, DKDV_CONFIGS, DQ_CONFIGS, atomic_dq_fits,
                                                     backward_flops, delta_rows, flash_attention_backward)
from kforge.kernels.attention.flash_forward import check_attention_inputs, flash_attention_forward
from kforge.kernels.attention.naive import naive_attention
from kforge.ops import flash_attention
from kforge.runtime.interpreter import mend_bf16_casts, mend_bf16_dot

SMALL = {"BLOCK_M": 16, "BLOCK_N": 32}
# (batch, heads, kv_heads, seq_q, seq_k, head_dim): tails of both tiles, Nq < Nk, Nq > Nk, one
# query, GQA 1, 2 and 4
SHAPES = [(1, 2, 2, 37, 37, 16), (2, 4, 2, 45, 70, 32), (1, 4, 1, 70, 29, 64), (1, 2, 1, 1, 33, 32),
          (1, 8, 2, 50, 50, 16)]
# Relative error (Frobenius norm) against float64: fp32 runs its products exactly; fp16 and bf16
# round P, dS and the results to 11 and 8 bits (measured 3e-4 and 2.7e-3 at hd 64 and 128).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _inputs(shape, dtype, device="cpu", seed=0):
    """q, k, v, an upstream gradient of the output and one of the log-sum-exp."""
    b, h, hk, nq, nk, d = shape
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, n_h, n, d, generator=g) for n_h, n in ((h, nq), (hk, nk), (hk, nk)))
    d_out, d_lse = torch.randn(b, h, nq, d, generator=g), torch.randn(b, h, nq, generator=g)
    return [t.to(dtype=dtype, device=device) for t in (q, k, v, d_out)] + [d_lse.to(device)]


def _float64_gradients(q, k, v, d_out, d_lse, causal, scale=None):
    """dQ, dK, dV of sum(out * d_out) + sum(lse * d_lse) by autograd through naive attention in float64."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out, lse = naive_attention(*leaves, causal=causal, scale=scale, return_lse=True)
    loss = (out * d_out.double()).sum() + (0 if d_lse is None else (lse * d_lse.double()).sum())
    return torch.autograd.grad(loss, leaves)


def _ours(q, k, v, d_out, d_lse, causal, scale=None, config=SMALL, deterministic=False):
    """Our forward, then our backward, on one config (None: the autotuners, on a GPU); dQ by its
    own kernel (`deterministic`) or by atomics."""
    out, lse = flash_attention_forward(q, k, v, causal=causal, scale=scale, config=config)
    return flash_attention_backward(d_out, q, k, v, out, lse, causal=causal, scale=scale, grad_lse=d_lse,
                                    atomic_dq=not deterministic, config=config)


def _relative_errors(mine, truth):  # (an all-zero truth, e.g. dV with dO = 0, wants exact zeros)
    return [float((a.double() - b).norm() / b.norm().clamp_min(1e-300)) for a, b in zip(mine, truth)]


def _assert_close(mine, truth, tol, what=""):
    errors = _relative_errors(mine, truth)
    assert all(e < tol for e in errors), f"{what} relative errors dQ, dK, dV: {errors} (tolerance {tol})"
    assert all(torch.isfinite(t).all() for t in mine)


@pytest.fixture
def bf16_interpreter():
    """The interpreter's bf16 dot and casts mended (kforge.runtime.interpreter), as evaluate() does."""
    mend_bf16_dot()
    mend_bf16_casts()


# --- the kernels under the interpreter --------------------------------------------------------

@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic dQ", "dQ kernel"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.slow
def test_gradients_match_float64_autograd(shape, causal, deterministic):
    q, k, v, d_out, d_lse = _inputs(shape, torch.float32)
    mine = _ours(q, k, v, d_out, d_lse, causal, deterministic=deterministic)
    _assert_close(mine, _float64_gradients(q, k, v, d_out, d_lse, causal), TOLERANCE[torch.float32])
    assert [t.dtype for t in mine] == [torch.float32] * 3 and [t.shape for t in mine] == [q.shape, k.shape, v.shape]


def test_gqa_causal_with_tails_matches_float64_in_both_modes():
    q, k, v, d_out, d_lse = _inputs((1, 4, 1, 45, 70, 32), torch.float32, seed=1)
    truth = _float64_gradients(q, k, v, d_out, d_lse, True)
    for deterministic in (False, True):
        _assert_close(_ours(q, k, v, d_out, d_lse, True, deterministic=deterministic), truth, 1e-5, deterministic)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.slow
def test_half_precision_gradients_match_float64(dtype, head_dim, causal, bf16_interpreter):
    q, k, v, d_out, d_lse = _inputs((1, 4, 2, 45, 70, head_dim), dtype, seed=2)
    for deterministic in (False, True):
        mine = _ours(q, k, v, d_out, d_lse, causal, deterministic=deterministic)
        _assert_close(mine, _float64_gradients(q, k, v, d_out, d_lse, causal), TOLERANCE[dtype], deterministic)
        assert [t.dtype for t in mine] == [dtype] * 3


def test_bf16_gradients_match_float64(bf16_interpreter):
    q, k, v, d_out, d_lse = _inputs((1, 2, 1, 40, 40, 64), torch.bfloat16, seed=3)
    _assert_close(_ours(q, k, v, d_out, d_lse, True), _float64_gradients(q, k, v, d_out, d_lse, True),
                  TOLERANCE[torch.bfloat16])


def test_head_dim_256_takes_the_dq_kernel_and_matches_float64(monkeypatch):
    assert not atomic_dq_fits(256) and atomic_dq_fits(16) and atomic_dq_fits(128)
    launched = []
    real = flash_backward.flash_backward_dq_kernel
    monkeypatch.setattr(flash_backward, "flash_backward_dq_kernel", _Spy(real, launched))
    q, k, v, d_out, d_lse = _inputs((1, 2, 1, 20, 33, 256), torch.float32, seed=4)
    mine = _ours(q, k, v, d_out, d_lse, True)  # atomic dQ asked for: still the dQ kernel at hd 256
    _assert_close(mine, _float64_gradients(q, k, v, d_out, d_lse, True), TOLERANCE[torch.float32])
    assert launched == [True]


class _Spy:
    """Stands in for a kernel: records each launch, then launches the real one."""

    def __init__(self, kernel, launched):
        self.kernel, self.launched = kernel, launched

    def __getitem__(self, grid):
        self.launched.append(True)
        return self.kernel[grid]


@pytest.mark.slow
def test_tiles_of_other_shapes_agree():
    q, k, v, d_out, d_lse = _inputs((1, 4, 2, 50, 61, 32), torch.float32, seed=5)
    truth = _float64_gradients(q, k, v, d_out, d_lse, True)
    for config in ({"BLOCK_M": 32, "BLOCK_N": 16}, {"BLOCK_M": 64, "BLOCK_N": 64}):
        for deterministic in (False, True):
            mine = _ours(q, k, v, d_out, d_lse, True, deterministic=deterministic, config=config)
            _assert_close(mine, truth, 1e-5, f"{config} deterministic={deterministic}")


def test_deterministic_mode_repeats_bit_for_bit_and_agrees_with_atomic_dq():
    q, k, v, d_out, d_lse = _inputs((1, 2, 1, 40, 50, 16), torch.float32, seed=6)
    first, second = (_ours(q, k, v, d_out, d_lse, False, deterministic=True) for _ in range(2))
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    atomic = _ours(q, k, v, d_out, d_lse, False)
    assert torch.equal(atomic[1], first[1]) and torch.equal(atomic[2], first[2])  # dK, dV: one code path
    torch.testing.assert_close(atomic[0], first[0], rtol=1e-5, atol=1e-6)  # dQ: same sums, another order


def test_the_log_sum_exp_gradient_is_honoured():
    """dS = P o (dP - (rowsum(dO o O) - dL)): with dO = 0 only dL drives the gradients; with dL = 0
    (or none given) only dO does."""
    q, k, v, d_out, d_lse = _inputs((1, 4, 2, 30, 41, 16), torch.float32, seed=7)
    zeros = torch.zeros_like(d_out)
    lse_only = _ours(q, k, v, zeros, d_lse, True)
    _assert_close(lse_only, _float64_gradients(q, k, v, zeros, d_lse, True), 1e-5, "dL alone")
    assert lse_only[2].abs().max() == 0  # dV = P^T dO does not see dL
    without = _ours(q, k, v, d_out, None, True)
    _assert_close(without, _float64_gradients(q, k, v, d_out, None, True), 1e-5, "dO alone")
    assert all(torch.equal(a, b) for a, b in zip(without, _ours(q, k, v, d_out, torch.zeros_like(d_lse), True)))


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic dQ", "dQ kernel"])
def test_poisoned_outputs_are_all_written(deterministic, nan_outputs):
    # causal with Nq < Nk: the last key blocks see no query, and their dK, dV must still be written (zeros)
    q, k, v, d_out, d_lse = _inputs((1, 4, 2, 21, 70, 16), torch.float32, seed=8)
    out, lse = flash_attention_forward(q, k, v, causal=True, config=SMALL)
    mine = flash_attention_backward(d_out, q, k, v, out, lse, causal=True, grad_lse=d_lse,
                                    atomic_dq=not deterministic, config=SMALL)
    assert torch.isnan(torch.empty(3)).all()  # the fixture is on
    _assert_close(mine, _float64_gradients(q, k, v, d_out, d_lse, True), 1e-5)
    assert mine[1][:, :, 21:].abs().max() == 0 and mine[2][:, :, 21:].abs().max() == 0


@pytest.mark.filterwarnings("ignore:overflow encountered in exp2:RuntimeWarning")  # masked out after exp2
def test_scores_far_below_zero_keep_the_key_tail_finite():
    """Every score of a row near -200: P = exp(S - L) is fine, but the key tail's zero-filled rows
    have S = 0 and exp(0 - L) = inf in fp32. Masking them keeps inf * 0 out of dQ."""
    q, k, v, d_out, d_lse = _inputs((1, 2, 2, 20, 37, 16), torch.float32, seed=9)
    q = q.abs() + 2.0
    k = -(k.abs() + 10.0)  # scores q.k / 4 below -80 (keys 0..36: a tail in 32-key blocks)
    assert (q @ k.transpose(-2, -1) / 4).max() < -80
    truth = _float64_gradients(q, k, v, d_out, d_lse, False)
    for deterministic in (False, True):
        _assert_close(_ours(q, k, v, d_out, d_lse, False, deterministic=deterministic), truth, 1e-5, deterministic)


def test_strided_views_keep_their_layout_and_the_scale_is_honoured():
    raw = torch.randn(4, 2, 41, 4, 32)  # (batch, seq, heads, dim) as a model holds q, k, v, dO
    q, k, v, d_out = (raw[i].transpose(1, 2) for i in range(4))
    d_lse = torch.randn(2, 4, 41)
    mine = _ours(q, k, v, d_out, d_lse, True, scale=0.05)
    _assert_close(mine, _float64_gradients(q, k, v, d_out, d_lse, True, scale=0.05), 1e-5)
    assert all(t.stride() == q.stride() for t in mine)


def test_no_query_leaves_the_key_gradients_zero():
    q, k, v, d_out, d_lse = _inputs((1, 2, 1, 0, 9, 16), torch.float32)
    out, lse = torch.empty_like(q), torch.empty(1, 2, 0)
    d_q, d_k, d_v = flash_attention_backward(d_out, q, k, v, out, lse, grad_lse=d_lse)
    assert d_q.shape == q.shape and d_k.abs().max() == 0 and d_v.abs().max() == 0


def test_refuses_what_it_cannot_take():
    q, k, v, d_out, d_lse = _inputs((1, 4, 2, 8, 8, 32), torch.float32)
    out, lse = torch.zeros_like(q), torch.zeros(1, 4, 8)
    cases = [
        (dict(q=q[..., :24], k=k[..., :24], v=v[..., :24], out=out[..., :24], grad_out=d_out[..., :24]),
         "head_dim 24"),
        (dict(grad_out=d_out[:, :2]), "grad_out must match q"),
        (dict(out=out.half()), "out must match q"),
        (dict(grad_out=d_out[..., :1].expand(d_out.shape)), "grad_out needs a contiguous last dimension"),
        (dict(lse=lse.double()), "lse must be a contiguous float32"),
        (dict(lse=lse[:, :, :4]), r"lse must be a contiguous float32 \(1, 4, 8\)"),
        (dict(grad_lse=torch.zeros(1, 4, 8, 2)[..., 0]), "grad_lse must be a contiguous float32"),
        (dict(k=k[:, :1].expand(1, 3, 8, 32), v=v[:, :1].expand(1, 3, 8, 32)), "multiple of key/value heads"),
        (dict(scale=0.0), "positive finite"),
    ]
    for change, message in cases:
        args = {"grad_out": d_out, "q": q, "k": k, "v": v, "out": out, "lse": lse, "grad_lse": d_lse, **change}
        with pytest.raises(ValueError, match=message):
            flash_attention_backward(**args)


def test_flop_count_is_two_and_a_half_forwards_and_tables_cover_every_head_dim():
    assert backward_flops(2, 3, 100, 70, 64, False) == 2.5 * 4 * 2 * 3 * 100 * 70 * 64
    assert backward_flops(2, 3, 100, 100, 64, True) == backward_flops(2, 3, 100, 100, 64, False) // 2
    assert set(DKDV_CONFIGS) == set(DQ_CONFIGS) == {64, 128, 256} and set(DKDV_ATOMIC_DQ_CONFIGS) == {64, 128}
    assert [delta_rows(d) for d in (16, 64, 128, 256)] == [128, 128, 64, 32]


# --- kforge.ops.flash_attention ----------------------------------------------------------------

@pytest.fixture
def backward_calls(monkeypatch):
    """The `atomic_dq` value of each call the op makes to our backward kernels."""
    calls = []
    real = flash_backward.flash_attention_backward

    def backward(*args, **kwargs):
        calls.append(kwargs["atomic_dq"])
        return real(*args, **kwargs)

    monkeypatch.setattr(flash_backward, "flash_attention_backward", backward)
    return calls


@pytest.fixture
def kernels_on_cpu(monkeypatch, backward_calls):
    """The op runs our kernels (under the interpreter) wherever they take the inputs, not only on
    Hopper GPUs; returns `backward_calls`."""
    def takes(q, k, v, scale):
        try:
            check_attention_inputs(q, k, v, scale)
        except ValueError:
            return False
        return True

    monkeypatch.setattr(attention_op, "ours_can_run", takes)
    return backward_calls


@pytest.mark.parametrize("causal", [pytest.param(False, marks=pytest.mark.slow), True], ids=["full", "causal"])
def test_op_gradients_on_the_kernels_match_float64(causal, kernels_on_cpu):
    q, k, v, d_out, d_lse = _inputs((1, 4, 2, 33, 40, 16), torch.float32, seed=10)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = flash_attention(*leaves, causal=causal, scale=0.3, return_lse=True)
    mine = torch.autograd.grad((out * d_out).sum() + (lse * d_lse).sum(), leaves)
    _assert_close(mine, _float64_gradients(q, k, v, d_out, d_lse, causal, scale=0.3), 1e-5)
    # out.sum(): autograd hands over an expanded (stride 0) dO and a zero dL
    out = flash_attention(*leaves, causal=causal)
    mine = torch.autograd.grad(out.sum(), leaves)
    _assert_close(mine, _float64_gradients(q, k, v, torch.ones_like(d_out), None, causal), 1e-5)
    assert kernels_on_cpu == [False, False]


def test_op_atomic_dq_flag_reaches_the_kernels_unless_torch_asks_for_determinism(kernels_on_cpu):
    q, k, v, _, _ = _inputs((1, 2, 1, 20, 20, 16), torch.float32, seed=11)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    torch.autograd.grad(flash_attention(*leaves, atomic_dq=True).sum(), leaves)
    torch.use_deterministic_algorithms(True)
    try:
        torch.autograd.grad(flash_attention(*leaves, atomic_dq=True).sum(), leaves)
    finally:
        torch.use_deterministic_algorithms(False)
    torch.autograd.grad(flash_attention(*leaves).sum(), leaves)
    assert kernels_on_cpu == [True, False, False]


def test_op_fallback_passes_gradcheck_and_the_backward_op_passes_opcheck():
    q, k, v, d_out, d_lse = _inputs((1, 4, 2, 5, 7, 16), torch.float64, seed=12)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    assert not attention_op.ours_can_run(q, k, v, None)  # CPU: naive attention and the PyTorch recompute
    for causal in (False, True):  # (the fp32 log-sum-exp output is too coarse for finite differences)
        assert torch.autograd.gradcheck(lambda a, b, c: flash_attention(a, b, c, causal=causal), leaves,
                                        fast_mode=True)
    out, lse = flash_attention(q.detach(), k.detach(), v.detach(), causal=True, return_lse=True)
    torch.library.opcheck(torch.ops.kforge.flash_attention_backward.default,
                          (d_out, d_lse, q.detach(), k.detach(), v.detach(), out, lse, True, None, False))


@pytest.mark.slow
def test_op_training_step_compiles_into_one_graph(kernels_on_cpu):
    q, k, v, d_out, _ = _inputs((1, 4, 2, 24, 24, 16), torch.float32, seed=13)

    def step(a, b, c):
        return torch.autograd.grad((flash_attention(a, b, c, causal=True) * d_out).sum(), (a, b, c))

    leaves = [t.requires_grad_() for t in (q, k, v)]
    compiled = torch.compile(lambda a, b, c: (flash_attention(a, b, c, causal=True) * d_out).sum(),
                             backend="aot_eager", fullgraph=True)
    mine = torch.autograd.grad(compiled(*leaves), leaves)
    for a, b in zip(mine, step(*leaves)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert kernels_on_cpu == [False, False]  # the compiled graph's backward node ran our kernels too


# --- the benchmark: kforge bench attention --backward ---------------------------------------------

def _backward_record(shape="full N=4096 D=128", causal=0, ms=None, status="ok"):
    ms = ms or {"sdpa-flash": (4.0, 5.6), "ours": (2.5, 3.5), "ours-atomic-dq": (3.0, 4.0)}
    methods = {m: {"status": "ok", "differs_from_flash": None if m == "sdpa-flash" else 4e-3,
                   "backward": {"device_ms": b, "ms": b}, "train": {"device_ms": t, "ms": t}}
               for m, (b, t) in ms.items()}
    methods["sdpa-cudnn"] = {"status": "error", "reason": "RuntimeError: no cuDNN"}
    return {"bench": "attention-backward", "shape": shape, "status": status, "reason": None,
            "device": {"name": "NVIDIA H100 80GB HBM3"},
            "sizes": {"B": 8, "H": 16, "KV_HEADS": 16, "N": 4096, "D": 128, "CAUSAL": causal},
            "flops": {"backward": 2.5e12, "train": 3.5e12}, "methods": methods}


def test_backward_lines_rates_and_ratios_against_sdpa_flash(tmp_path):
    from rich.console import Console

    from kforge.bench.attention import (AttentionShape, backward_bench_rows, backward_lines, pass_flops,
                                        save_attention_chart)
    from kforge.views import attention_backward_view

    shape = AttentionShape(8, 16, 4096, 128, False)
    assert pass_flops(shape, "backward") == 10 * 8 * 16 * 4096**2 * 128 and pass_flops(shape, "train") == \
        14 * 8 * 16 * 4096**2 * 128
    assert pass_flops(AttentionShape(8, 16, 4096, 128, True), "backward") == pass_flops(shape, "backward") // 2
    records = [_backward_record(ms={"sdpa-flash": (9.0, 9.0)}), _backward_record(),
               {"candidate": {"name": "ours"}}, _backward_record("causal N=4096 D=128", 1, status="error")]
    records[-1]["reason"] = "RuntimeError: out of memory"
    lines = backward_lines(records)
    assert [(line.shape, line.method) for line in lines] == [
        ("full N=4096 D=128", "sdpa-flash"), ("full N=4096 D=128", "ours"), ("full N=4096 D=128", "ours-atomic-dq"),
        ("full N=4096 D=128", "sdpa-cudnn"), ("causal N=4096 D=128", "-")]  # the latest record of each shape
    ours = lines[1]
    assert ours.tflops == pytest.approx({"backward": 1000, "train": 1000})
    assert ours.vs_flash == pytest.approx({"backward": 1.6, "train": 1.6})
    assert lines[3].status == "error" and lines[3].ms == {"backward": None, "train": None}
    console = Console(record=True, width=220)
    console.print(attention_backward_view(lines, title="t", results_path=None))
    text = console.export_text()
    assert "1.600x" in text and "1,000" in text and "no cuDNN" in text and "out of memory" in text
    rows = backward_bench_rows(records, "backward")
    assert len(rows) == 1 and rows[0].tflops["sdpa-flash"] == 625 and rows[0].vs_baseline["ours"] == pytest.approx(1.6)
    assert save_attention_chart(rows, tmp_path / "b.png", title="t", records=records).stat().st_size > 10_000


def test_backward_replot_prints_the_table_and_refuses_other_families(tmp_path, monkeypatch, capsys):
    from kforge import cli
    from kforge.harness.record import append_record

    results = tmp_path / "bench-attention-backward.jsonl"
    append_record(results, _backward_record())
    for args, code, shown in [(["attention", "--backward", "--replot", "--json"], 0, '"method": "ours"'),
                              (["gemm", "--backward", "--replot"], 2, "--backward is for kforge bench attention"),
                              (["attention", "--backward", "--sweep"], 2, "without --sweep")]:
        monkeypatch.setattr(sys, "argv", ["kforge", "bench", *args, "--results", str(results),
                                          "--chart", str(tmp_path / "b.png")])
        with pytest.raises(SystemExit) as exited:
            cli.main()
        captured = capsys.readouterr()
        assert exited.value.code == code and shown in captured.out + captured.err, captured


def test_backward_records_have_their_section_in_kforge_report(tmp_path):
    from kforge.harness.record import append_record
    from kforge.views import results_markdown

    append_record(tmp_path / "some-gpu" / "bench-attention-backward.jsonl", _backward_record())
    text = results_markdown(tmp_path)
    assert "### bench-attention-backward" in text
    assert "| full N=4096 D=128 | ours | 2.5 ms | 1,000 | 1.600x | 3.5 ms | 1,000 | 1.600x | 4.0e-03 | ok |" in text
    assert "| sdpa-cudnn | - |" in text and "error: RuntimeError: no cuDNN" in text


@pytest.mark.slow
def test_backward_bench_times_each_method_on_a_cpu(cpu, fast_timing, kernels_on_cpu, bf16_interpreter):
    """The in-process timing end to end on a tiny shape: ours (under the interpreter), both modes,
    against SDPA flash's CPU kernel; the record's figures and agreement."""
    from kforge.bench.attention import AttentionShape, time_backward

    figures = time_backward(AttentionShape(1, 2, 40, 16, True), cpu, fast_timing,
                            methods=("ours", "ours-atomic-dq", "sdpa-flash"))
    methods = figures["methods"]
    assert {m: methods[m]["status"] for m in methods} == dict.fromkeys(methods, "ok")
    assert all(methods[m]["differs_from_flash"] < 2e-2 for m in ("ours", "ours-atomic-dq"))
    assert all(methods[m][p]["ms"] > 0 for m in methods for p in ("backward", "train"))
    assert figures["flops"] == {"backward": 10 * 2 * 40 * 40 * 16 // 2, "train": 14 * 2 * 40 * 40 * 16 // 2}
    assert set(kernels_on_cpu) == {False, True}


# --- the sm_90 builds, compiled offline ---------------------------------------------------------

@pytest.mark.slow
def test_kernels_compile_for_the_h100_without_spills():
    """The first config of each list, bf16: registers, no spills, wgmma (HGMMA), TMA loads."""
    sys.path.insert(0, str(Path(__file__).parent))
    from triton_sm90 import compile_sm90, spec

    module = "kforge.kernels.attention.flash_backward"
    scalars = {"n_q": "i32", "n_k": "i32", "heads": "i32", "kv_group": "i32", "scale": "fp32"}

    def box(rows, dim):
        return f"tensordesc<bf16[1,1,{rows},{dim}]>"

    specs = []
    for dim in (64, 128, 256):
        for causal in (False, True):
            tag = f"hd {dim} {'causal' if causal else 'full'}"
            lists = [("dK dV", DKDV_CONFIGS[dim][0], False)]
            if atomic_dq_fits(dim):
                lists.append(("dK dV + atomic dQ", DKDV_ATOMIC_DQ_CONFIGS[dim][0], True))
            for name, config, atomic in lists:
                bm, bn = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
                types = {"q_desc": box(bm, dim), "do_desc": box(bm, dim), "dq_ptr": "*fp32", "lse_ptr": "*fp32",
                         "delta_ptr": "*fp32", **{n: box(bn, dim) for n in ("k_desc", "v_desc", "dk_desc", "dv_desc")},
                         **scalars}
                specs.append(spec(f"{name} {tag}", module, "flash_backward_dkdv_kernel", types,
                                  dict(HEAD_DIM=dim, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, ATOMIC_DQ=atomic,
                                       DOT_PRECISION="tf32"),
                                  aligned=("dq_ptr", "lse_ptr", "delta_ptr"), num_warps=config.num_warps,
                                  num_stages=config.num_stages))
            config = DQ_CONFIGS[dim][0]
            bm, bn = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
            types = {**{n: box(bm, dim) for n in ("q_desc", "do_desc", "dq_desc")}, "k_desc": box(bn, dim),
                     "v_desc": box(bn, dim), "lse_ptr": "*fp32", "delta_ptr": "*fp32", **scalars}
            specs.append(spec(f"dQ {tag}", module, "flash_backward_dq_kernel", types,
                              dict(HEAD_DIM=dim, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, DOT_PRECISION="tf32"),
                              aligned=("lse_ptr", "delta_ptr"), num_warps=config.num_warps,
                              num_stages=config.num_stages))
        rows = delta_rows(dim)
        specs.append(spec(f"D hd {dim}", module, "flash_backward_delta_kernel",
                          {"o_desc": box(rows, dim), "do_desc": box(rows, dim), "grad_lse_ptr": "*fp32",
                           "delta_ptr": "*fp32", "n_q": "i32", "heads": "i32"},
                          dict(HEAD_DIM=dim, BLOCK_M=rows, HAS_GRAD_LSE=True), aligned=("grad_lse_ptr", "delta_ptr"),
                          num_warps=4, num_stages=1))
    found = compile_sm90(specs)
    for label, used in found.items():
        assert used["spills"] == 0 and used["local"] == 0, (label, used)
        assert used["shared"] <= 227 * 1024, (label, used)
        assert used["tma"] > 0, (label, used)
        if not label.startswith("D "):
            assert used["hgmma"] > 0, (label, used)  # the products run on wgmma


# --- on the GPU ---------------------------------------------------------------------------------

def _float64_gradients_by_batch(q, k, v, d_out, causal):
    """_float64_gradients one batch element at a time (the N x N float64 matrices of a whole batch
    at N = 4096 would take ~40 GB)."""
    parts = [_float64_gradients(q[b:b + 1], k[b:b + 1], v[b:b + 1], d_out[b:b + 1], None, causal)
             for b in range(q.shape[0])]
    return [torch.cat(p) for p in zip(*parts)]


def _sdpa_flash_gradients(q, k, v, d_out, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])
    return torch.autograd.grad(out, leaves, d_out)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gpu_target_shape_matches_float64_like_sdpa_flash(causal, nan_outputs):
    q, k, v, d_out, _ = _inputs((4, 16, 16, 4096, 4096, 128), torch.bfloat16, "cuda")
    truth = _float64_gradients_by_batch(q, k, v, d_out, causal)
    theirs = max(_relative_errors(_sdpa_flash_gradients(q, k, v, d_out, causal), truth))
    out, lse = flash_attention_forward(q, k, v, causal=causal)
    for deterministic in (False, True):
        mine = flash_attention_backward(d_out, q, k, v, out, lse, causal=causal, atomic_dq=not deterministic)
        errors = _relative_errors(mine, truth)
        assert max(errors) < max(2 * theirs, 1e-2), (deterministic, errors, theirs)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gpu_odd_shapes_match_float64(head_dim, causal, dtype, nan_outputs):
    for shape in [(2, 8, 2, 1000, 1000, head_dim), (1, 4, 4, 77, 300, head_dim), (1, 4, 1, 513, 129, head_dim)]:
        q, k, v, d_out, d_lse = _inputs(shape, dtype, "cuda")
        truth = _float64_gradients(q, k, v, d_out, d_lse, causal)
        for deterministic in (False, True):
            mine = _ours(q, k, v, d_out, d_lse, causal, deterministic=deterministic, config=None)
            _assert_close(mine, truth, 2 * TOLERANCE[dtype], (shape, deterministic))


@pytest.mark.gpu
def test_gpu_default_dq_kernel_repeats_bit_for_bit():
    q, k, v, d_out, _ = _inputs((4, 16, 4, 4096, 4096, 128), torch.bfloat16, "cuda", seed=1)
    out, lse = flash_attention_forward(q, k, v, causal=True)
    runs = [flash_attention_backward(d_out, q, k, v, out, lse, causal=True) for _ in range(3)]
    assert all(torch.equal(a, b) for run in runs[1:] for a, b in zip(runs[0], run))


@pytest.mark.gpu
def test_gpu_op_training_step_runs_our_backward_under_inductor(backward_calls):
    q, k, v, d_out, _ = _inputs((2, 8, 2, 1000, 1000, 128), torch.bfloat16, "cuda", seed=2)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    compiled = torch.compile(lambda a, b, c: (flash_attention(a, b, c, causal=True).float() * d_out).sum(),
                             fullgraph=True)
    mine = torch.autograd.grad(compiled(*leaves), leaves)
    truth = _float64_gradients(q, k, v, d_out, None, True)
    theirs = max(_relative_errors(_sdpa_flash_gradients(q, k, v, d_out, True), truth))
    assert max(_relative_errors(mine, truth)) < max(2 * theirs, 1e-2)
    assert backward_calls == [False]

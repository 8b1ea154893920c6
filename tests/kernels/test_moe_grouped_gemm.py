"""Grouped GEMMs in DeepGEMM's two layouts and the DeepSeek-V3-shaped layer on them.

Under the Triton interpreter, against float64 by error relative to the output's RMS: the
contiguous layout (ragged runs, an empty group, a one-row group, trailing all-padding tiles,
N and K tails) and the masked one (counts of 0, 1, the whole block, past the block), plain and
with SwiGLU fused, in fp32, fp16, bf16 and block-scaled FP8 (the up half starting inside a
128-row scale block, DeepGEMM's M-major activation scales); outputs NaN-poisoned, so padding
rows and rows past a count must stay unwritten and every real row must be; a run misaligned
against the tile leaves its stray rows unwritten rather than wrong; one-line refusals; the ops'
CPU path, opcheck and fake shapes; every autotuner config compiled for sm_90 (slow); the layer (router, shared expert, dispatch, both grouped
GEMMs, combine) against a float64 loop over experts, with experts left empty and one expert
taking every token. On a GPU: the autotuned kernels and every config at DeepGEMM's shapes, and
the layer at DeepSeek-V3's widths for prefill and decode token counts."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from kforge.kernels.moe.deepseek import DEEPSEEK_V3, SMALL, MoEConfig, moe_layer, moe_layer_reference
from kforge.kernels.moe.dispatch import dispatch
from kforge.kernels.moe.grouped_gemm import (LAYOUT_CONFIGS, contiguous_m_indices, grouped_gemm_contiguous,
                                             grouped_gemm_layout_reference, grouped_gemm_masked,
                                             quantize_grouped_activations, quantize_grouped_weight)
from kforge.ops.moe import grouped_gemm_contiguous as op_contiguous
from kforge.ops.moe import grouped_gemm_masked as op_masked
from kforge.runtime.interpreter import interpreter_active, mend_interpreter

# One rounding of the output after fp32 sums (fp16 2^-11, bf16 2^-8 relative; the interpreter's
# bf16 casts mended to round to nearest), relative to the output's RMS; fp32: sums of ~50
# products in another order. FP8: the operands are the dequantized values in both, so only the
# bf16 output rounding and the promotion's fp32 sums differ.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float8_e4m3fn: 1.6e-2}
TILES = {"BM": 16, "BN": 32, "BK": 32, "GROUP_M": 2}
FP8_TILES = dict(TILES, BK=128)


@pytest.fixture(autouse=True)
def mended():
    if interpreter_active():
        mend_interpreter()  # bf16 dots and casts as the GPU does them


def _assert_close(got, want, dtype):
    tol = TOLERANCE[dtype]
    scale = want.pow(2).mean().sqrt().item()
    assert scale > 0
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * scale)


def _m_indices(sizes, align, tail_tiles=1):
    """Runs of `sizes` rows per group, each padded to `align` (-1), then `tail_tiles` x align rows
    of -1 (a buffer sized past the last group)."""
    rows = []
    for e, size in enumerate(sizes):
        rows += [e] * size + [-1] * (-size % align)
    return torch.tensor(rows + [-1] * (tail_tiles * align), dtype=torch.int32)


def _operands(shape_x, experts, n_rows, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape_x, k, generator=g)
    w = torch.randn(experts, n_rows, k, generator=g) / k**0.5
    if dtype == torch.float8_e4m3fn:
        (xq, xs), (wq, ws) = quantize_grouped_activations(x), quantize_grouped_weight(w)
        return xq, wq, dict(x_scale=xs, w_scale=ws)
    return x.to(dtype), w.to(dtype), {}


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn]


# --- contiguous ----------------------------------------------------------------------------------

@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_contiguous_matches_float64_and_leaves_padding_rows_alone(dtype, gated, nan_outputs):
    # groups of 21, 0 (no run), 1 and 40 rows at align 16; N = 40 leaves a tail on 32-wide tiles,
    # K = 48 one on 32-deep steps (fp8: K = 256, two scale blocks; N = 100, so the up rows
    # 100..199 start inside the gate rows' first 128-row scale block and end in the second)
    fp8 = dtype == torch.float8_e4m3fn
    mi = _m_indices([21, 0, 1, 40], 16)
    n, k = (100, 256) if fp8 else (40, 48)
    x, w, scales = _operands((len(mi),), 4, 2 * n if gated else n, k, dtype)
    out = grouped_gemm_contiguous(x, w, mi, gated=gated, align=16, config=FP8_TILES if fp8 else TILES, **scales)
    assert out.shape == (len(mi), n) and out.dtype == (torch.bfloat16 if fp8 else dtype)
    want = grouped_gemm_layout_reference(x, w, mi, "contiguous", gated=gated, **scales)
    real = mi >= 0
    _assert_close(out[real], want[real], dtype)
    assert torch.isnan(out[~real]).all()


def test_contiguous_fp8_takes_m_major_activation_scales():
    mi = _m_indices([5, 30], 16)
    x, w, scales = _operands((len(mi),), 2, 64, 256, torch.float8_e4m3fn, seed=4)
    m_major = scales["x_scale"].T.contiguous().T  # DeepGEMM's [K/128, M] storage, read through strides
    out = grouped_gemm_contiguous(x, w, mi, align=16, config=FP8_TILES, x_scale=m_major, w_scale=scales["w_scale"])
    want = grouped_gemm_layout_reference(x, w, mi, "contiguous", **scales)
    _assert_close(out[mi >= 0], want[mi >= 0], torch.float8_e4m3fn)


def test_every_weight_scale_block_counts():
    # doubling one (expert, 128-row, 128-K) scale block changes exactly that expert's columns
    mi = _m_indices([16, 16], 16, tail_tiles=0)
    x, w, scales = _operands((32,), 2, 160, 256, torch.float8_e4m3fn, seed=5)
    base = grouped_gemm_contiguous(x, w, mi, align=16, config=FP8_TILES, **scales).float()
    w_scale = scales["w_scale"].clone()
    w_scale[1, 1, 0] *= 2  # expert 1, weight rows 128..159, K 0..127
    bumped = grouped_gemm_contiguous(x, w, mi, align=16, config=FP8_TILES, x_scale=scales["x_scale"],
                                     w_scale=w_scale).float()
    changed = bumped != base  # (a change below a bf16 step of an output can round away)
    assert changed[16:, 128:].float().mean() > 0.9 and not changed[:16].any() and not changed[16:, :128].any()
    want = grouped_gemm_layout_reference(x, w, mi, "contiguous", x_scale=scales["x_scale"], w_scale=w_scale)
    _assert_close(bumped, want, torch.float8_e4m3fn)


def test_a_misaligned_run_leaves_its_stray_rows_unwritten(nan_outputs):
    # group 1 starts at row 20, inside group 0's second 16-row tile (rows 16..31): that tile is
    # group 0's and skips rows 20..31; group 1's own tile, rows 32..47, writes 32..43
    mi = torch.tensor([0] * 20 + [1] * 24 + [-1] * 4, dtype=torch.int32)
    x, w, _ = _operands((48,), 2, 32, 32, torch.float32)
    out = grouped_gemm_contiguous(x, w, mi, align=16, config=TILES)
    want = grouped_gemm_layout_reference(x, w, mi, "contiguous")
    _assert_close(out[:20], want[:20], torch.float32)
    assert torch.isnan(out[20:32]).all() and torch.isnan(out[44:]).all()
    _assert_close(out[32:44], want[32:44], torch.float32)


def test_m_indices_of_a_dispatch_layout():
    ids = torch.tensor([[0, 2], [2, 3], [0, 2], [3, 0]], dtype=torch.int32)
    layout = dispatch(ids, torch.ones(4, 2), 5, 4)
    mi = contiguous_m_indices(layout)
    assert mi.dtype == torch.int32 and mi.shape == (layout.rows,)
    # expert 0: assignments 0, 4, 7; expert 2: 1, 2, 5; expert 3: 3, 6; expert 1 and 4: none
    assert mi.tolist()[:12] == [0, 0, 0, -1, 2, 2, 2, -1, 3, 3, -1, -1] and (mi[12:] == -1).all()


# --- masked --------------------------------------------------------------------------------------

@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_masked_matches_float64_and_leaves_rows_past_the_count_alone(dtype, gated, nan_outputs):
    # five experts, blocks of 36 rows: counts 0, 1, 36 (the whole block), 17, 50 (past the block:
    # the block's 36); three tiles of 16 rows the last ragged
    fp8 = dtype == torch.float8_e4m3fn
    masked_m = torch.tensor([0, 1, 36, 17, 50], dtype=torch.int32)
    n, k = (100, 256) if fp8 else (40, 48)
    x, w, scales = _operands((5, 36), 5, 2 * n if gated else n, k, dtype, seed=2)
    out = grouped_gemm_masked(x, w, masked_m, gated=gated, config=FP8_TILES if fp8 else TILES, **scales)
    assert out.shape == (5, 36, n)
    want = grouped_gemm_layout_reference(x, w, masked_m, "masked", gated=gated, **scales)
    valid = torch.arange(36)[None, :] < masked_m.clamp(max=36)[:, None]
    _assert_close(out[valid], want[valid], dtype)
    assert torch.isnan(out[~valid]).all()


def test_masked_with_no_rows_anywhere_writes_nothing(nan_outputs):
    x, w, _ = _operands((3, 8), 3, 32, 32, torch.float32)
    out = grouped_gemm_masked(x, w, torch.zeros(3, dtype=torch.int32), config=TILES)
    assert torch.isnan(out).all()


# --- refusals and the ops ------------------------------------------------------------------------

def test_refusals_are_one_line_value_errors():
    mi = _m_indices([3], 16)
    x, w, _ = _operands((16 + 16,), 2, 32, 32, torch.float32)
    xq, wq, scales = _operands((32,), 2, 32, 128, torch.float8_e4m3fn)
    cases = [
        (lambda: grouped_gemm_contiguous(x[:, :16], w, mi), "K must match"),
        (lambda: grouped_gemm_contiguous(x, w[:, :31], mi, gated=True), "gate rows then up rows"),
        (lambda: grouped_gemm_contiguous(x, w, mi[:-1]), "m_indices must be int32"),
        (lambda: grouped_gemm_contiguous(x, w, mi.long()), "m_indices must be int32"),
        (lambda: grouped_gemm_contiguous(x, w.half(), mi), "share one dtype"),
        (lambda: grouped_gemm_contiguous(x, w, mi, x_scale=torch.ones(32, 1)), "scales go with"),
        (lambda: grouped_gemm_contiguous(x, w, mi, align=16, config=dict(TILES, BM=32)), "must divide align"),
        (lambda: grouped_gemm_masked(x.view(2, 16, 32), w, torch.ones(3, dtype=torch.int32)), "masked_m must be"),
        (lambda: grouped_gemm_masked(x.view(4, 8, 32), w, torch.ones(4, dtype=torch.int32)), "expert blocks"),
        (lambda: grouped_gemm_masked(x, w, torch.ones(2, dtype=torch.int32)), "must be \\[E, max_m, K\\]"),
        (lambda: grouped_gemm_contiguous(xq, wq, mi), "with x_scale and w_scale"),
        (lambda: grouped_gemm_contiguous(xq, wq, mi, x_scale=scales["x_scale"][:, :0],
                                         w_scale=scales["w_scale"]), "x_scale must be float32"),
        (lambda: grouped_gemm_contiguous(xq, wq, mi, config=dict(FP8_TILES, BK=64), **scales), "BK = 128"),
        (lambda: grouped_gemm_contiguous(xq[:, :64].contiguous(), wq[..., :64].contiguous(), mi,
                                         x_scale=torch.ones(32, 0), w_scale=torch.ones(2, 1, 0)), "multiple of 128"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message) as info:
            call()
        assert "\n" not in str(info.value)


def test_ops_run_the_reference_on_cpu_with_zeros_where_the_kernel_writes_nothing():
    mi = _m_indices([5, 0, 9], 16)
    x, w, _ = _operands((len(mi),), 3, 64, 32, torch.float32)
    out = op_contiguous(x, w, mi, gated=True, align=16)
    want = grouped_gemm_layout_reference(x, w, mi, "contiguous", gated=True, fill=0.0)
    assert out.shape == (len(mi), 32) and (out[mi < 0] == 0).all()
    _assert_close(out, want, torch.float32)
    xq, wq, scales = _operands((3, 8), 3, 64, 128, torch.float8_e4m3fn)
    masked_m = torch.tensor([8, 0, 3], dtype=torch.int32)
    out = op_masked(xq, wq, masked_m, **scales)
    assert out.dtype == torch.bfloat16 and out.shape == (3, 8, 64) and (out[1] == 0).all()
    _assert_close(out[0], grouped_gemm_layout_reference(xq, wq, masked_m, "masked", **scales)[0],
                  torch.float8_e4m3fn)


def test_op_passes_opcheck_and_fakes_its_shapes():
    mi = _m_indices([5, 9], 16)
    x, w, _ = _operands((len(mi),), 2, 64, 32, torch.float32)
    torch.library.opcheck(torch.ops.kforge.grouped_gemm.default, (x, w, mi, None, None, "contiguous", True, 16))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        xq = mode.from_tensor(torch.zeros(2, 8, 128).to(torch.float8_e4m3fn))
        wq = mode.from_tensor(torch.zeros(2, 96, 128).to(torch.float8_e4m3fn))
        out = torch.ops.kforge.grouped_gemm(xq, wq, mode.from_tensor(torch.ones(2, dtype=torch.int32)),
                                            mode.from_tensor(torch.ones(2, 8, 1)),
                                            mode.from_tensor(torch.ones(2, 1, 1)), "masked", True, 1)
        assert out.shape == (2, 8, 48) and out.dtype == torch.bfloat16


# --- the layer -----------------------------------------------------------------------------------

def _layer(config: MoEConfig, tokens: int, dtype, *, bias_on=None, device="cpu", seed=0):
    # drawn in `dtype` and scaled in place: DeepSeek-V3's 22.6 GB of bf16 weights never exist in fp32
    g = torch.Generator(device=device).manual_seed(seed)
    c = config

    def draw(*shape, std=1.0):
        return torch.randn(*shape, generator=g, device=device, dtype=dtype).mul_(std)

    x, gate = draw(tokens, c.hidden), draw(c.experts, c.hidden, std=c.hidden**-0.5)
    bias = torch.randn(c.experts, generator=g, device=device) * 0.05
    for e, b in (bias_on or {}).items():
        bias[e] = b
    w13 = draw(c.experts + c.shared, 2 * c.inter, c.hidden, std=c.hidden**-0.5)
    w2 = draw(c.experts + c.shared, c.hidden, c.inter, std=c.inter**-0.5)
    return x, gate, bias, w13, w2


@pytest.mark.parametrize("tokens", [1, 23])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_layer_matches_a_float64_loop_over_experts(dtype, tokens, nan_outputs):
    operands = _layer(SMALL, tokens, dtype)
    y = moe_layer(*operands, SMALL)
    assert y.shape == (tokens, SMALL.hidden) and y.dtype == dtype
    want = moe_layer_reference(*operands, SMALL)
    if dtype == torch.float32:
        _assert_close(y, want, torch.float32)
    else:  # h is rounded to bf16 between the two GEMMs and the output once more: twice one GEMM's bound
        _assert_close_bf16_twice(y, want)


def _assert_close_bf16_twice(got, want):
    scale = want.pow(2).mean().sqrt().item()
    torch.testing.assert_close(got.double(), want, rtol=3.2e-2, atol=3.2e-2 * scale)


def test_layer_with_empty_experts_and_one_expert_taking_every_token(nan_outputs):
    # a bias of +10 puts expert 5 first for every token; -10 on experts 8..15 empties them (the
    # group limit then keeps groups 0 and 1 for everyone)
    bias_on = {5: 10.0, **{e: -10.0 for e in range(8, 16)}}
    operands = _layer(SMALL, 19, torch.float32, bias_on=bias_on, seed=3)
    y = moe_layer(*operands, SMALL)
    _assert_close(y, moe_layer_reference(*operands, SMALL), torch.float32)


def test_layer_refuses_mismatched_weights():
    x, gate, bias, w13, w2 = _layer(SMALL, 3, torch.float32)
    with pytest.raises(ValueError, match="w13 must be"):
        moe_layer(x, gate, bias, w13[:-1], w2, SMALL)
    with pytest.raises(ValueError, match="x must be"):
        moe_layer(x[:, :-1], gate, bias, w13, w2, SMALL)
    assert moe_layer(x[:0], gate, bias, w13, w2, SMALL).shape == (0, SMALL.hidden)


# --- on the GPU ----------------------------------------------------------------------------------

def _gpu_operands(shape_x, experts, n_rows, k, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(*shape_x, k, generator=g, device="cuda")
    w = torch.randn(experts, n_rows, k, generator=g, device="cuda") / k**0.5
    if dtype == torch.float8_e4m3fn:
        (xq, xs), (wq, ws) = quantize_grouped_activations(x), quantize_grouped_weight(w)
        return xq, wq, dict(x_scale=xs, w_scale=ws)
    return x.to(dtype), w.to(dtype), {}


@pytest.mark.gpu
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_contiguous_on_the_gpu_every_config(dtype, gated, nan_outputs):
    # ragged groups at align 128 (an empty one, a one-row one), N = 2000 (a tail on every BN)
    # and K = 7168, DeepSeek-V3's hidden
    mi = _m_indices([1000, 0, 1, 2049, 300], 128).cuda()
    n, k = 2000, 7168
    x, w, scales = _gpu_operands((len(mi),), 5, 2 * n if gated else n, k, dtype)
    want = grouped_gemm_layout_reference(x, w, mi, "contiguous", gated=gated, **scales)
    real = mi >= 0
    out = grouped_gemm_contiguous(x, w, mi, gated=gated, **scales)  # autotuned
    _assert_close(out[real], want[real], dtype)
    assert torch.isnan(out[~real]).all()
    for c in LAYOUT_CONFIGS[(gated, dtype == torch.float8_e4m3fn)]:
        out = grouped_gemm_contiguous(x, w, mi, gated=gated, **scales,
                                      config=dict(c.kwargs, num_stages=c.num_stages, num_warps=c.num_warps))
        _assert_close(out[real], want[real], dtype)
        assert torch.isnan(out[~real]).all(), c


@pytest.mark.gpu
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_masked_on_the_gpu_every_config(dtype, gated, nan_outputs):
    # decode: 8 experts of 256-row blocks, counts 0 to 256 and one past the block
    masked_m = torch.tensor([0, 1, 7, 64, 129, 256, 300, 33], dtype=torch.int32, device="cuda")
    n, k = 2048, 7168
    x, w, scales = _gpu_operands((8, 256), 8, 2 * n if gated else n, k, dtype, seed=1)
    want = grouped_gemm_layout_reference(x, w, masked_m, "masked", gated=gated, **scales)
    valid = torch.arange(256, device="cuda")[None, :] < masked_m.clamp(max=256)[:, None]
    out = grouped_gemm_masked(x, w, masked_m, gated=gated, **scales)
    _assert_close(out[valid], want[valid], dtype)
    assert torch.isnan(out[~valid]).all()
    for c in LAYOUT_CONFIGS[(gated, dtype == torch.float8_e4m3fn)]:
        out = grouped_gemm_masked(x, w, masked_m, gated=gated, **scales,
                                  config=dict(c.kwargs, num_stages=c.num_stages, num_warps=c.num_warps))
        _assert_close(out[valid], want[valid], dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("block_n", [128, 256])
@pytest.mark.parametrize("n, k", [(2000, 7168), (136, 1152), (4096, 256)], ids=str)
def test_the_cuda_fp8_contiguous_kernel_matches_the_reference_and_skips_padding(n, k, block_n, nan_outputs):
    """quant/fp8_block_gemm.cu built GROUPED: ragged runs at align 128 (an empty expert, a one-row
    run, a run of 2049: a last tile mostly padding), N tails on both tiles, row-major and M-major
    activation scales; rows of -1 stay NaN."""
    from kforge.kernels.quant.fp8_block_gemm import fp8_grouped_gemm_contiguous

    mi = _m_indices([1000, 0, 1, 2049, 300], 128).cuda()
    x, w, scales = _gpu_operands((len(mi),), 5, n, k, torch.float8_e4m3fn, seed=2)
    want = grouped_gemm_layout_reference(x, w, mi, "contiguous", **scales)
    real = mi >= 0
    for x_scale in (scales["x_scale"], scales["x_scale"].t().contiguous().t()):
        out = fp8_grouped_gemm_contiguous(x, w, mi, x_scale, scales["w_scale"], block_n=block_n)
        _assert_close(out[real], want[real], torch.float8_e4m3fn)
        assert torch.isnan(out[~real]).all()


@pytest.mark.gpu
def test_fp8_contiguous_calls_take_the_cuda_kernel_unless_switched_off(monkeypatch, nan_outputs):
    from kforge.kernels.moe import grouped_gemm as module
    from kforge.kernels.quant.fp8_block_gemm import fp8_grouped_gemm_contiguous

    mi = _m_indices([700, 129], 128).cuda()
    x, w, scales = _gpu_operands((len(mi),), 2, 512, 1024, torch.float8_e4m3fn, seed=3)
    real = mi >= 0
    cuda = fp8_grouped_gemm_contiguous(x, w, mi, scales["x_scale"], scales["w_scale"])
    assert torch.equal(grouped_gemm_contiguous(x, w, mi, **scales)[real], cuda[real])
    assert torch.equal(op_contiguous(x, w, mi, **scales)[real], cuda[real])
    monkeypatch.setattr(module, "CUDA_FP8_CONTIGUOUS", False)
    triton_out = grouped_gemm_contiguous(x, w, mi, **scales)
    _assert_close(triton_out[real], grouped_gemm_layout_reference(x, w, mi, "contiguous", **scales)[real],
                  torch.float8_e4m3fn)


def test_the_cuda_fp8_contiguous_kernel_is_only_asked_for_what_it_takes():
    from kforge.kernels.moe.grouped_gemm import cuda_fp8_contiguous_fits

    x = torch.zeros(256, 128).to(torch.float8_e4m3fn)
    w = torch.zeros(2, 64, 128).to(torch.float8_e4m3fn)
    assert not cuda_fp8_contiguous_fits(x, w, "contiguous", False, 128), "a CPU tensor"


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [64, 2048], ids=["decode", "prefill"])
def test_layer_at_deepseek_v3_widths_on_the_gpu(tokens):
    operands = _layer(DEEPSEEK_V3, tokens, torch.bfloat16, device="cuda")
    y = moe_layer(*operands, DEEPSEEK_V3)
    _assert_close_bf16_twice(y, moe_layer_reference(*operands, DEEPSEEK_V3))


# --- the machine code ----------------------------------------------------------------------------

_COMPILE_SM90 = textwrap.dedent(r"""
    import json, os, re, sys
    os.environ["TRITON_INTERPRET"] = "0"  # compile for sm_90 on a machine with no GPU
    from pathlib import Path
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from kforge.kernels.moe import grouped_gemm as gg
    from kforge.runtime.cuda import Cubin, sass

    fn, found = gg.grouped_layout_kernel, []
    masked = sys.argv[1] == "masked"
    for (gated, fp8), configs in gg.LAYOUT_CONFIGS.items():
        operand = "*fp8e4nv" if fp8 else "*bf16"
        types = {"x_ptr": operand, "w_ptr": operand, "out_ptr": "*bf16", "groups_ptr": "*i32",
                 "x_scale_ptr": "*fp32", "w_scale_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32", "E": "i32",
                 "stride_xse": "i32", "stride_xsm": "i32", "stride_xsk": "i32", "M_BUCKET": "i32"}
        aligned = [fn.arg_names.index(n) for n in ("x_ptr", "w_ptr", "out_ptr", "M", "N", "K")]
        for c in configs:
            constants = dict(c.kwargs, NUM_PROGRAMS=132, E_BLOCK=256, ALIGN=1 if masked else 128, MASKED=masked,
                             GATED=gated, FP8=fp8, DOT_PRECISION="tf32")
            source = ASTSource(fn=fn, signature={n: types.get(n, "constexpr") for n in fn.arg_names},
                               constexprs=constants, attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
            kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                    options={"num_warps": c.num_warps, "num_stages": c.num_stages})
            code = sass(Cubin(Path(fn.__name__), "sm_90", (), "", kernel.asm["cubin"], ""))
            found.append(dict(gated=gated, fp8=fp8, config=str(c), shared=kernel.metadata.shared,
                              spills=len(re.findall(r"\b(STL|LDL)\b", code)),
                              wgmma=len(re.findall(r"\b[HQ]GMMA\b", code)), tma=len(re.findall(r"\bUTMALDG\b", code))))
    print(json.dumps(found))
""")


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_every_config_compiles_for_sm90_to_tma_and_wgmma_without_spills(layout):
    # A config over the 227 KB would be skipped by the autotuner without a word; a spill in the
    # mainloop (the promotion's registers) would cost every K step.
    done = subprocess.run([sys.executable, "-c", _COMPILE_SM90, layout], capture_output=True, text=True, timeout=1200,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(found) == sum(len(configs) for configs in LAYOUT_CONFIGS.values())
    for kernel in found:
        assert 0 < kernel["shared"] <= 227 * 1024, kernel
        assert kernel["spills"] == 0 and kernel["wgmma"] > 0 and kernel["tma"] > 0, kernel

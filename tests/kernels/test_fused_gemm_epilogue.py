"""The GEMM with a fused epilogue (`kernels/fused/gemm_epilogue.py`): under the interpreter, fp16
(and bf16, with the interpreter's bf16 dot mended) against float64 for every activation and
every mode (plain, bias, residual, bias + residual, gated) on M, N and K tails; several
tiles per program and the flattened loop; a 3-D x; every output written (poisoned outputs);
the tiles each mode may use; bad inputs refused. On a GPU: every config the autotuner may
pick in each mode, and the autotuned path at the level-2 problems' shapes."""

from __future__ import annotations

import pytest
import torch

from kforge.kernels.fused.gemm_epilogue import (ACTIVATIONS, CONFIGS, SHARED_LIMIT, configs_for, gemm_epilogue,
                                                gemm_epilogue_min_bytes, gemm_epilogue_reference, shared_bytes)
from kforge.runtime.interpreter import mend_bf16_dot

MODES = ["plain", "bias", "residual", "bias+residual", "gated"]
# fp16 products are exact in fp32, sums of K <= 520 of them ~1e-6; the output is rounded once
# (2^-11 relative) after an epilogue of a few fp32 ulps; bf16 rounds at 2^-8 (the interpreter
# truncates: a whole step)
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
SMALL = {"BM": 32, "BN": 32, "BK": 32, "GROUP_M": 2, "FLATTEN": False}


def _operands(m, n, k, mode, dtype, device="cpu", seed=0, leading=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*(leading or (m,)), k, generator=g)
    w = torch.randn(n, k, generator=g) / k**0.5
    kwargs = {}
    if "bias" in mode:
        kwargs["bias"] = torch.randn(n, generator=g)
    if "residual" in mode:
        kwargs["residual"] = torch.randn(*x.shape[:-1], n, generator=g)
    if mode == "gated":
        kwargs["up_weight"] = torch.randn(n, k, generator=g) / k**0.5
    cast = {name: t.to(dtype=dtype, device=device) for name, t in kwargs.items()}
    return x.to(dtype=dtype, device=device), w.to(dtype=dtype, device=device), cast


def _check(got, x, w, kwargs, activation, dtype):
    want = gemm_epilogue_reference(x, w, activation=activation, **kwargs)
    assert got.shape == want.shape and got.dtype == x.dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_every_activation_and_mode_matches_float64_on_tails(activation, mode, nan_outputs):
    # 37 = 32 + 5 rows, N = 40 = 32 + 8, K = 72 = 2 * 32 + 8: a tail in every dimension
    x, w, kwargs = _operands(37, 40, 72, mode, torch.float16)
    got = gemm_epilogue(x, w, activation=activation, **kwargs, config=SMALL)
    _check(got, x, w, kwargs, activation, torch.float16)


@pytest.mark.parametrize("mode", ["bias", "gated", "bias+residual"])
def test_bf16_with_the_interpreters_dot_mended(mode, nan_outputs):
    mend_bf16_dot()
    x, w, kwargs = _operands(37, 40, 72, mode, torch.bfloat16, seed=1)
    got = gemm_epilogue(x, w, activation="silu" if mode == "gated" else "gelu", **kwargs)  # the default CPU tile
    _check(got, x, w, kwargs, "silu" if mode == "gated" else "gelu", torch.bfloat16)


@pytest.mark.parametrize("flatten", [False, True])
def test_many_tiles_per_program_in_grouped_order(flatten, nan_outputs):
    # 70 x 96 in 16 x 16 tiles: 5 x 6 = 30 tiles over 4 programs, groups of 4 tile rows with a
    # short last group
    x, w, kwargs = _operands(70, 96, 40, "bias+residual", torch.float16, seed=2)
    config = {"BM": 16, "BN": 16, "BK": 16, "GROUP_M": 4, "FLATTEN": flatten}
    _check(gemm_epilogue(x, w, activation="gelu_tanh", **kwargs, config=config), x, w, kwargs, "gelu_tanh",
           torch.float16)


def test_leading_dimensions_flatten_to_rows_and_come_back(nan_outputs):
    x, w, kwargs = _operands(0, 24, 16, "residual", torch.float16, seed=3, leading=(3, 7))
    got = gemm_epilogue(x, w, activation="silu", **kwargs)
    assert got.shape == (3, 7, 24)
    _check(got, x, w, kwargs, "silu", torch.float16)


def test_activations_are_the_formulas_of_torch():
    # one row of K = 8 with x = e_0 and W column 0 = v: the output is act(v) itself
    v = torch.tensor([-6.0, -2.5, -0.75, 0.0, 0.5, 1.25, 3.0, 9.0])
    x = torch.zeros(1, 8)
    x[0, 0] = 1.0
    w = torch.zeros(8, 8)
    w[:, 0] = v
    expected = {"none": v, "gelu": torch.nn.functional.gelu(v),
                "gelu_tanh": torch.nn.functional.gelu(v, approximate="tanh"), "silu": torch.nn.functional.silu(v)}
    for activation in ACTIVATIONS:
        got = gemm_epilogue(x.half(), w.half(), activation=activation)[0].float()
        torch.testing.assert_close(got, expected[activation].half().float(), rtol=1e-3, atol=1e-3)


def test_gated_output_is_the_activated_gate_times_up():
    x = torch.ones(2, 8)
    gate, up = torch.zeros(8, 8), torch.zeros(8, 8)
    gate[:, 0], up[:, 0] = torch.linspace(-3, 3, 8), torch.linspace(1, 2, 8)  # x @ W^T = column 0
    got = gemm_epilogue(x.half(), gate.half(), activation="silu", up_weight=up.half()).float()
    want = torch.nn.functional.silu(torch.linspace(-3, 3, 8)) * torch.linspace(1, 2, 8)
    torch.testing.assert_close(got, want.expand(2, 8), rtol=2e-3, atol=2e-3)


def test_each_mode_keeps_the_tiles_that_fit_its_shared_memory():
    plain, residual, gated = (configs_for(CONFIGS, g, r) for g, r in ((False, False), (False, True), (True, False)))
    assert plain == CONFIGS
    assert all(c.kwargs["BN"] < 256 for c in residual + gated) and len(residual) >= 4 and len(gated) >= 4
    for configs, flags in ((plain, (False, False)), (residual, (False, True)), (gated, (True, False))):
        assert all(shared_bytes(c, gated=flags[0], residual=flags[1]) <= SHARED_LIMIT for c in configs)
    erf = configs_for(CONFIGS, False, False, "gelu")
    assert len(erf) == len(CONFIGS) - 1 and all(c.kwargs["BN"] < 256 or not c.kwargs["FLATTEN"] for c in erf)
    # 128 x 256 x 64, 3 stages: 3 x (128 + 256) x 64 x 2 bytes of ring + the 64 KB C tile
    assert shared_bytes(CONFIGS[0], gated=False, residual=False) == 3 * 384 * 128 + 65536


def test_min_bytes_count_x_the_weights_bias_residual_and_y_once():
    assert gemm_epilogue_min_bytes(16384, 8192, 2048, bias=True) == (16384 * 2048 + 8192 * 2048 + 8192
                                                                     + 16384 * 8192) * 2
    assert gemm_epilogue_min_bytes(8, 16, 32, gated=True, residual=True) == (8 * 32 + 2 * 16 * 32 + 8 * 16 + 8 * 16) * 2


def _bad_cases():
    x, w, _ = _operands(4, 16, 16, "plain", torch.float16)
    return [
        (dict(x=x, weight=w, activation="relu"), "activation must be one of"),
        (dict(x=x[:, :8], weight=w), "K must match"),
        (dict(x=x.float(), weight=w.float()), "float16, bfloat16"),
        (dict(x=x, weight=w.bfloat16()), "share one dtype"),
        (dict(x=x, weight=w, up_weight=w[:8]), "up_weight must be"),
        (dict(x=x, weight=w, up_weight=w, bias=w[0]), "gated GEMM takes no bias"),
        (dict(x=x, weight=w, bias=w[:2]), "bias must be"),
        (dict(x=x, weight=w, residual=torch.zeros(4, 8, dtype=torch.float16)), "residual must be"),
        (dict(x=torch.zeros(4, 12, dtype=torch.float16), weight=torch.zeros(16, 12, dtype=torch.float16)),
         "multiples of 8"),
        (dict(x=torch.zeros(4, 32, dtype=torch.float16)[:, ::2], weight=w), "contiguous"),
        (dict(x=x, weight=torch.zeros(16, 32, dtype=torch.float16)[:, 1:17]), "contiguous and 16-byte aligned"),
        (dict(x=x, weight=w[:0]), "N, K be > 0"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_cases())))
def test_bad_inputs_are_refused_with_a_clear_error(case):
    kwargs, message = _bad_cases()[case]
    x, w = kwargs.pop("x"), kwargs.pop("weight")
    with pytest.raises(ValueError, match=message):
        gemm_epilogue(x, w, **kwargs)


# --- on the GPU ------------------------------------------------------------------------------

GPU_MODES = [("bias", "gelu_tanh"), ("bias", "gelu"), ("residual", "none"), ("bias+residual", "none"),
             ("gated", "silu"), ("gated", "gelu_tanh")]


@pytest.mark.gpu
@pytest.mark.parametrize("mode, activation", GPU_MODES)
def test_every_config_each_mode_may_use_is_correct_on_the_gpu(mode, activation):
    x, w, kwargs = _operands(300, 264, 520, mode, torch.bfloat16, "cuda", seed=4)  # tails in M, N and K
    for config in configs_for(CONFIGS, mode == "gated", "residual" in mode, activation):
        tiles = dict(config.kwargs, num_stages=config.num_stages, num_warps=config.num_warps)
        _check(gemm_epilogue(x, w, activation=activation, **kwargs, config=tiles), x, w, kwargs, activation,
               torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k, mode, activation", [
    (16384, 8192, 2048, "bias", "gelu_tanh"),  # problems/level2/linear_bias_gelu_tanh_bf16.py
    (8192, 8192, 2048, "gated", "silu"),  # gate_up_swiglu_bf16.py
    (8192, 9216, 2304, "gated", "gelu_tanh"),  # gate_up_geglu_bf16.py
    (50432, 1024, 1024, "bias+residual", "none"),  # linear_bias_residual_bf16.py
    (8192, 4096, 4096, "residual", "none"),  # attention_out_proj_bf16.py
])
def test_autotuned_path_at_the_level2_shapes_on_the_gpu(m, n, k, mode, activation):
    x, w, kwargs = _operands(m, n, k, mode, torch.bfloat16, "cuda", seed=5)
    got = gemm_epilogue(x, w, activation=activation, **kwargs)
    want = gemm_epilogue_reference(x, w, activation=activation, **kwargs)
    # bf16 output: one rounding (2^-9 relative) after fp32 sums of K products
    torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-2)
    assert torch.equal(gemm_epilogue(x, w, activation=activation, **kwargs), got)  # the cached pick: same result


@pytest.mark.gpu
def test_fp16_on_the_gpu():
    x, w, kwargs = _operands(1000, 520, 1032, "bias+residual", torch.float16, "cuda", seed=6)
    _check(gemm_epilogue(x, w, activation="gelu", **kwargs), x, w, kwargs, "gelu", torch.float16)

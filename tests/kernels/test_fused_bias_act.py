"""Bias add and activation (`kernels/fused/bias_act.py`): under the interpreter, fp16 and fp32
against float64 for every activation, rows packed several to a program and wide rows in
column blocks with tails, strided rows; every output written (poisoned outputs); bad inputs
refused. On a GPU: bf16 at the level-2 problem's size."""

from __future__ import annotations

import pytest
import torch

from kforge.kernels.fused.bias_act import bias_act, bias_act_min_bytes, bias_act_reference, bias_act_tile
from kforge.kernels.fused.gemm_epilogue import ACTIVATIONS

TOLERANCE = {torch.float16: dict(rtol=2e-3, atol=1e-4), torch.float32: dict(rtol=1e-5, atol=1e-6),
             torch.bfloat16: dict(rtol=8e-3, atol=1e-3)}


def _operands(shape, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x, b = 3 * torch.randn(shape, generator=g), torch.randn(shape[-1], generator=g)
    return x.to(dtype=dtype, device=device), b.to(dtype=dtype, device=device)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # exp(-2u) = inf: v / inf = -0
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", [(7, 3, 100), (3, 4100)], ids=str)
def test_matches_float64(shape, activation, dtype, nan_outputs):
    # 100 pads to 128: 16 rows a program, 21 rows in 2 programs; 4100: three column blocks, the last of 4
    x, b = _operands(shape, dtype)
    y = bias_act(x, b, activation)
    assert y.shape == x.shape and y.dtype == dtype
    torch.testing.assert_close(y.double(), bias_act_reference(x, b, activation), **TOLERANCE[dtype])


def test_strided_rows_and_an_fp32_bias_under_fp16(nan_outputs):
    x, b = _operands((5, 300), torch.float16, seed=1)
    view, bias = x[:, 10:210], b[:200].float()
    torch.testing.assert_close(bias_act(view, bias).double(), bias_act_reference(view, bias),
                               **TOLERANCE[torch.float16])


def test_tiles_and_min_bytes():
    assert bias_act_tile(16384) == (1, 2048) and bias_act_tile(100) == (16, 128)
    assert bias_act_min_bytes(16384, 16384) == (2 * 16384 * 16384 + 16384) * 2


@pytest.mark.parametrize("bad, message", [
    (lambda x, b: bias_act(x, b, "relu"), "activation must be"),
    (lambda x, b: bias_act(x, b[:3]), "bias \\(N,\\)"),
    (lambda x, b: bias_act(x.double(), b), "float16, bfloat16 or float32"),
    (lambda x, b: bias_act(x, b.int()), "float16, bfloat16 or float32"),
])
def test_bad_inputs_are_refused_with_a_clear_error(bad, message):
    with pytest.raises(ValueError, match=message):
        bad(*_operands((4, 8), torch.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_level2_size_on_the_gpu(activation):
    x, b = _operands((4096, 16384), torch.bfloat16, "cuda", seed=2)
    torch.testing.assert_close(bias_act(x, b, activation).double(), bias_act_reference(x, b, activation),
                               **TOLERANCE[torch.bfloat16])

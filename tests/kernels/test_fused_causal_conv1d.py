"""Depthwise causal conv1d with bias and activation (`kernels/fused/causal_conv1d.py`): under the
interpreter, fp16 and fp32 against float64 with and without bias and silu, 1 to 7 taps,
channel and length tails, several length blocks, a channel-sliced view, the causal zero
padding by hand; every output written (poisoned outputs); bad inputs refused. On a GPU:
bf16 at Mamba-2.8B's width and across lengths."""

from __future__ import annotations

import pytest
import torch

from kforge.kernels.fused.causal_conv1d import (causal_conv1d, causal_conv1d_min_bytes, causal_conv1d_reference,
                                                conv_tile)

# W fp32 FMAs then one rounding (2^-11 relative in fp16); silu's exp a few fp32 ulps
TOLERANCE = {torch.float16: dict(rtol=2e-3, atol=1e-4), torch.float32: dict(rtol=1e-5, atol=1e-6),
             torch.bfloat16: dict(rtol=8e-3, atol=1e-3)}


def _operands(batch, channels, length, taps, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, channels, length, generator=g)
    w = torch.randn(channels, 1, taps, generator=g) / taps**0.5
    b = torch.randn(channels, generator=g)
    return [t.to(dtype=dtype, device=device) for t in (x, w, b)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("activation", ["silu", "none"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_matches_float64(with_bias, activation, dtype, nan_outputs):
    # 37 positions pad to 64: 32 channels a program, 6 of them real
    x, w, b = _operands(2, 6, 37, 4, dtype)
    y = causal_conv1d(x, w, b if with_bias else None, activation=activation)
    assert y.shape == x.shape and y.dtype == dtype
    want = causal_conv1d_reference(x, w, b if with_bias else None, activation=activation)
    torch.testing.assert_close(y.double(), want, **TOLERANCE[dtype])


@pytest.mark.parametrize("taps", [1, 2, 7])
def test_any_number_of_taps_and_a_two_dimensional_weight(taps, nan_outputs):
    x, w, b = _operands(1, 5, 23, taps, torch.float32, seed=1)
    want = causal_conv1d_reference(x, w, b)
    torch.testing.assert_close(causal_conv1d(x, w[:, 0], b).double(), want, **TOLERANCE[torch.float32])


def test_several_length_blocks_and_a_channel_slice(nan_outputs):
    assert conv_tile(1500) == (2, 1024)  # two length blocks, the second 476 long
    x, w, b = _operands(2, 7, 1500, 4, torch.float16, seed=2)
    view = x[:, 2:5]  # channel stride 1500, batch stride 7 * 1500
    got = causal_conv1d(view, w[2:5], b[2:5])
    torch.testing.assert_close(got.double(), causal_conv1d_reference(view, w[2:5], b[2:5]), **TOLERANCE[torch.float16])


def test_each_output_sees_only_itself_and_the_past():
    x = torch.zeros(1, 1, 8)
    x[0, 0, 3] = 1.0  # an impulse at position 3
    w = torch.tensor([[1.0, 2.0, 3.0, 4.0]])  # tap j multiplies x[l - 3 + j]
    y = causal_conv1d(x, w, None, activation="none")
    assert torch.equal(y[0, 0], torch.tensor([0.0, 0.0, 0.0, 4.0, 3.0, 2.0, 1.0, 0.0]))


def test_min_bytes_read_x_and_write_y():
    assert causal_conv1d_min_bytes(8, 5120, 4096, 4) == 2 * 8 * 5120 * 4096 * 2 + 5120 * 5 * 2


@pytest.mark.parametrize("bad, message", [
    (lambda x, w, b: causal_conv1d(x, w, b, activation="gelu"), "activation must be"),
    (lambda x, w, b: causal_conv1d(x[0], w, b), "\\(batch, channels, length\\)"),
    (lambda x, w, b: causal_conv1d(x, w[:2], b), "weight must be"),
    (lambda x, w, b: causal_conv1d(x, torch.randn(3, 1, 17), b), "weight must be"),
    (lambda x, w, b: causal_conv1d(x, w, b[:2]), "bias must be"),
    (lambda x, w, b: causal_conv1d(x.double(), w, b), "float16, bfloat16 or float32"),
    (lambda x, w, b: causal_conv1d(x.transpose(1, 2).contiguous().transpose(1, 2), w, b), "contiguous rows"),
])
def test_bad_inputs_are_refused_with_a_clear_error(bad, message):
    x, w, b = _operands(2, 3, 10, 4, torch.float32)
    with pytest.raises(ValueError, match=message):
        bad(x, w, b)


@pytest.mark.gpu
@pytest.mark.parametrize("length", [4096, 1000, 7])
def test_mamba_width_on_the_gpu(length):
    x, w, b = _operands(2, 5120, length, 4, torch.bfloat16, "cuda", seed=3)
    torch.testing.assert_close(causal_conv1d(x, w, b).double(), causal_conv1d_reference(x, w, b),
                               **TOLERANCE[torch.bfloat16])

"""The two fused FP8 quantizers, add + RMSNorm + rowwise e4m3 (`kernels/fused/add_rms_norm_fp8.py`)
and SwiGLU + (1, 128)-group e4m3 (`kernels/fused/swiglu_fp8.py`): under the interpreter, bit
for bit against the eager chain quantized by `quant.formats` (the kernels' roundings go
through exact integer helpers there); all-zero rows and groups get scale 1; rows packed
with a tail and wide rows in column blocks; strided inputs; every output written
(poisoned outputs); bad inputs refused. On a GPU: the level-2 sizes, bit for bit but for
the rare element whose last bits of rsqrt or exp move a bf16 rounding."""

from __future__ import annotations

import pytest
import torch

from kforge.kernels.fused.add_rms_norm_fp8 import (add_rms_norm_fp8, add_rms_norm_fp8_min_bytes,
                                                   add_rms_norm_fp8_reference)
from kforge.kernels.fused.swiglu_fp8 import (GROUP, swiglu_fp8, swiglu_fp8_min_bytes, swiglu_fp8_reference,
                                             swiglu_fp8_tile)


def _bf16(shape, seed, scale=1.0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(shape, generator=g)).to(dtype=torch.bfloat16, device=device)


def _assert_same_fp8(got, want, max_moved=0.0):
    """Equal codes, or (max_moved > 0) at most that share of elements one e4m3 step apart."""
    assert got.dtype == want.dtype == torch.float8_e4m3fn and got.shape == want.shape
    moved = got.view(torch.uint8) != want.view(torch.uint8)
    assert moved.double().mean() <= max_moved, f"{int(moved.sum())} codes differ"
    if moved.any():
        step = (got.view(torch.uint8).int() - want.view(torch.uint8).int()).abs()
        assert step[moved].max() <= 1


# --- add + RMSNorm + rowwise e4m3 ---------------------------------------------------------------

@pytest.mark.parametrize("shape", [(5, 1000), (2, 3, 4099), (9, 96)], ids=str)
def test_add_rms_norm_fp8_is_the_eager_chain_bit_for_bit(shape, nan_outputs):
    # 1000: 2 rows a program, the last short; 4099: one row of 8192 lanes; 96: 16 rows a program
    x, residual = _bf16(shape, 0), _bf16(shape, 1)
    weight = (0.5 + torch.rand(shape[-1], generator=torch.Generator().manual_seed(2))).to(torch.bfloat16)
    q, scale, h = add_rms_norm_fp8(x, residual, weight, 1e-6)
    want_q, want_scale, want_h = add_rms_norm_fp8_reference(x, residual, weight, 1e-6)
    assert scale.shape == (*shape[:-1], 1) and scale.dtype == torch.float32
    assert torch.equal(h, want_h) and torch.equal(scale, want_scale)
    _assert_same_fp8(q, want_q)


def test_add_rms_norm_fp8_zero_row_gets_scale_one_and_strided_rows_are_read(nan_outputs):
    x, residual = _bf16((4, 300), 3)[:, :256], _bf16((4, 256), 4)
    x[1], residual[1] = 0, 0  # h = 0: amax 0
    weight = torch.ones(256, dtype=torch.bfloat16)
    q, scale, h = add_rms_norm_fp8(x, residual, weight)
    want_q, want_scale, want_h = add_rms_norm_fp8_reference(x, residual, weight)
    assert scale[1, 0] == 1.0 and torch.equal(scale, want_scale) and torch.equal(h, want_h)
    _assert_same_fp8(q, want_q)


@pytest.mark.parametrize("bad, message", [
    (lambda x, r, w: add_rms_norm_fp8(x, r[:2], w), "share one shape"),
    (lambda x, r, w: add_rms_norm_fp8(x.half(), r.half(), w), "bfloat16"),
    (lambda x, r, w: add_rms_norm_fp8(x, r, w[:3]), "weight must be"),
    (lambda x, r, w: add_rms_norm_fp8(x, r, w, -1.0), "eps must be"),
    (lambda x, r, w: add_rms_norm_fp8(_bf16((1, 16385), 0), _bf16((1, 16385), 1), _bf16((16385,), 2)), "at most"),
])
def test_add_rms_norm_fp8_refuses_bad_inputs(bad, message):
    with pytest.raises(ValueError, match=message):
        bad(_bf16((4, 8), 0), _bf16((4, 8), 1), _bf16((8,), 2))


# --- SwiGLU + (1, 128)-group e4m3 ---------------------------------------------------------------

@pytest.mark.parametrize("shape", [(9, 2 * 384), (2, 3, 2 * 2176)], ids=str)
def test_swiglu_fp8_is_the_eager_chain_bit_for_bit(shape, nan_outputs):
    # 384: 4 rows a program of 512 lanes, the last group of each row padding; 2176: two
    # column blocks of 2048, the second with one real group
    x = _bf16(shape, 5, scale=3.0)
    q, scales = swiglu_fp8(x)
    want_q, want_scales = swiglu_fp8_reference(x)
    assert q.shape == (*shape[:-1], shape[-1] // 2) and scales.shape == (*shape[:-1], shape[-1] // 2 // GROUP)
    assert torch.equal(scales, want_scales)
    _assert_same_fp8(q, want_q)


def test_swiglu_fp8_zero_group_gets_scale_one_and_values_below_e4m3s_normals_round(nan_outputs):
    x = _bf16((3, 2 * 256), 6, scale=2.0)
    x[0, :128] = 0  # gate 0: the row's first group is all zeros
    x[1, 5], x[1, 256 + 5] = 2.0, 2e5  # one large product: the rest of its group lands among e4m3's subnormals
    q, scales = swiglu_fp8(x)
    want_q, want_scales = swiglu_fp8_reference(x)
    assert scales[0, 0] == 1.0 and torch.equal(scales, want_scales)
    subnormal = (q[1, :128].float().abs() < 2**-6) & (q[1, :128].float() != 0)
    assert subnormal.sum() > 30
    _assert_same_fp8(q, want_q)


def test_tiles_and_min_bytes():
    assert swiglu_fp8_tile(14336) == (1, 2048) and swiglu_fp8_tile(384) == (4, 512)
    assert swiglu_fp8_min_bytes(8192, 14336) == 8192 * 14336 * 5 + 8192 * 112 * 4
    assert add_rms_norm_fp8_min_bytes(16384, 8192) == 16384 * 8192 * 7 + 16384 * 4 + 8192 * 2


@pytest.mark.parametrize("bad, message", [
    (lambda: swiglu_fp8(_bf16((4, 200), 0)), "multiple of 128"),
    (lambda: swiglu_fp8(_bf16((4, 256), 0).half()), "bfloat16"),
])
def test_swiglu_fp8_refuses_bad_inputs(bad, message):
    with pytest.raises(ValueError, match=message):
        bad()


# --- on the GPU ------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_add_rms_norm_fp8_at_the_level2_size_on_the_gpu():
    x, residual = _bf16((16384, 8192), 7, device="cuda"), _bf16((16384, 8192), 8, device="cuda")
    weight = (0.5 + torch.rand(8192, device="cuda")).to(torch.bfloat16)
    q, scale, h = add_rms_norm_fp8(x, residual, weight)
    want_q, want_scale, want_h = add_rms_norm_fp8_reference(x, residual, weight)
    assert torch.equal(h, want_h)
    torch.testing.assert_close(scale, want_scale, rtol=8e-3, atol=0)  # a row's amax may move one bf16 step
    _assert_same_fp8(q, want_q, max_moved=1e-3)


@pytest.mark.gpu
def test_swiglu_fp8_at_the_level2_size_on_the_gpu():
    x = _bf16((8192, 2 * 14336), 9, scale=2.0, device="cuda")
    q, scales = swiglu_fp8(x)
    want_q, want_scales = swiglu_fp8_reference(x)
    torch.testing.assert_close(scales, want_scales, rtol=8e-3, atol=0)
    _assert_same_fp8(q, want_q, max_moved=1e-3)

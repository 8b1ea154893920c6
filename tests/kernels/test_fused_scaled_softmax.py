"""Scaled, causally masked softmax (`kernels/fused/scaled_softmax.py`): under the interpreter, fp16
and fp32 against float64, causal (square and Nq < Nk) and not, packed short rows with a
tail program, a long row alone in its program, strided rows; the masked part exactly 0;
scores far past exp's range; every output written (poisoned outputs); bad inputs refused.
On a GPU: bf16 at the level-2 problem's size and across row lengths."""

from __future__ import annotations

import pytest
import torch

from kforge.kernels.fused.scaled_softmax import (MAX_ROW, scaled_softmax, scaled_softmax_min_bytes,
                                                 scaled_softmax_reference, softmax_tile)

# probabilities rounded once (2^-11 relative in fp16) after fp32 exp and sums
TOLERANCE = {torch.float16: dict(rtol=2e-3, atol=1e-5), torch.float32: dict(rtol=2e-5, atol=1e-7),
             torch.bfloat16: dict(rtol=8e-3, atol=1e-5)}


def _scores(shape, dtype, device="cpu", seed=0, spread=4.0):
    g = torch.Generator().manual_seed(seed)
    return (spread * torch.randn(shape, generator=g)).to(dtype=dtype, device=device)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("shape", [(2, 3, 37, 45), (1, 2, 19, 19), (3, 1000)], ids=str)
def test_matches_float64(shape, causal, dtype, nan_outputs):
    # 45 keys pad to 64: 32 rows a program, 222 rows in 7 programs (the last short); 1000 keys: 2 rows a program
    s = _scores(shape, dtype)
    p = scaled_softmax(s, 0.3, causal=causal)
    assert p.shape == s.shape and p.dtype == dtype and p.is_contiguous()
    torch.testing.assert_close(p.double(), scaled_softmax_reference(s, 0.3, causal=causal), **TOLERANCE[dtype])


def test_masked_scores_are_exact_zeros_and_row_zero_is_one_hot():
    p = scaled_softmax(_scores((1, 1, 9, 9), torch.float32, seed=1), 1.0)
    assert torch.equal(p[0, 0].triu(1), torch.zeros(9, 9))
    assert torch.equal(p[0, 0, 0], torch.eye(9)[0])
    torch.testing.assert_close(p.sum(-1), torch.ones(1, 1, 9))


def test_a_long_row_takes_a_program_of_its_own_and_strided_rows_are_read_in_place(nan_outputs):
    assert softmax_tile(3000) == (1, 4096, 8)
    wide = _scores((2, 3, 3100), torch.float16, seed=2)
    s = wide[..., :3000]  # rows of 3000 with a stride of 3100
    torch.testing.assert_close(scaled_softmax(s, 0.1, causal=False).double(),
                               scaled_softmax_reference(s, 0.1, causal=False), **TOLERANCE[torch.float16])
    torch.testing.assert_close(scaled_softmax(s[:, :2], 0.1).double(), scaled_softmax_reference(s[:, :2], 0.1),
                               **TOLERANCE[torch.float16])


def test_scores_far_past_exps_range_stay_finite():
    s = _scores((4, 64), torch.float32, seed=3, spread=1e4)
    p = scaled_softmax(s, 1.0, causal=False)
    assert torch.isfinite(p).all()
    torch.testing.assert_close(p.double(), scaled_softmax_reference(s, 1.0, causal=False), rtol=1e-5, atol=1e-7)


def test_min_bytes_read_the_visible_triangle_and_write_everything():
    assert scaled_softmax_min_bytes(64, 2048, 2048, causal=True) == 64 * (2048 * 2049 // 2 + 2048**2) * 2
    assert scaled_softmax_min_bytes(2, 3, 5, causal=False, itemsize=4) == 2 * 30 * 4


@pytest.mark.parametrize("bad, message", [
    (lambda: scaled_softmax(torch.randn(5), 1.0), "\\(..., Nq, Nk\\)"),
    (lambda: scaled_softmax(torch.randn(2, 0), 1.0), "\\(..., Nq, Nk\\)"),
    (lambda: scaled_softmax(torch.randn(2, 3).double(), 1.0), "float16, bfloat16 or float32"),
    (lambda: scaled_softmax(torch.randn(1, MAX_ROW + 1), 1.0, causal=False), "at most"),
    (lambda: scaled_softmax(torch.randn(2, 3), 0.0), "positive finite"),
    (lambda: scaled_softmax(torch.randn(4, 3), 1.0), "Nq <= Nk"),
])
def test_bad_inputs_are_refused_with_a_clear_error(bad, message):
    with pytest.raises(ValueError, match=message):
        bad()


@pytest.mark.gpu
def test_level2_size_on_the_gpu():
    s = _scores((2, 32, 2048, 2048), torch.bfloat16, "cuda", seed=4, spread=11.3)
    torch.testing.assert_close(scaled_softmax(s, 128**-0.5).double(), scaled_softmax_reference(s, 128**-0.5),
                               **TOLERANCE[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("n", [128, 1000, 4096, 8192, MAX_ROW])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_row_lengths_on_the_gpu(n, dtype):
    s = _scores((3, 64, n), dtype, "cuda", seed=5)
    for causal in (True, False):
        torch.testing.assert_close(scaled_softmax(s, 0.125, causal=causal).double(),
                                   scaled_softmax_reference(s, 0.125, causal=causal), **TOLERANCE[dtype])

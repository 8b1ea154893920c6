"""Softmax: the Triton kernels under the interpreter (fp16, fp32, bf16) against float64 on both
paths (rows in registers, packed several to a program, with odd widths; long rows in chunks,
walked by a persistent grid with fewer programs than rows), every output written; -inf
logits, including a first chunk of only -inf and a row of only -inf; strided and
transposed inputs; the tile plan; refusals. On a GPU: bf16/fp16/fp32 at vocabulary widths."""

import pytest
import torch

from kforge.kernels.reductions import rows
from kforge.kernels.reductions.softmax import softmax_forward, softmax_min_bytes, softmax_reference

# padding rows of a packed tile are all -inf: 0/0 there, masked out of the store, but numpy warns
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
# one rounding of the output (the interpreter truncates bf16: 2^-7), after fp32 exps and sums
TOLERANCE = {torch.float32: dict(rtol=2e-6, atol=1e-9), torch.float16: dict(rtol=1e-3, atol=1e-7),
             torch.bfloat16: dict(rtol=8e-3, atol=1e-9)}
# (shape, chunk): packed rows (2 of 1000 a program, a tail program), one row of 4099 (odd,
# unaligned), rows of 37 (32 a program), 5 rows walked in chunks of 64 with a tail of 44 by
# fewer programs than rows, and the default looped path (rows longer than 16384)
CASES = [((7, 1000), None), ((3, 4099), None), ((2, 3, 37), None), ((5, 300), 64), ((9, 300), 128), ((2, 16500), None)]


def _logits(shape, dtype, device="cpu", seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(shape, generator=g)).to(dtype=dtype, device=device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape,chunk", CASES, ids=str)
def test_softmax_matches_float64(shape, chunk, dtype, nan_outputs):
    x = _logits(shape, dtype)
    out = softmax_forward(x, chunk=chunk)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out.double(), softmax_reference(x), **TOLERANCE[dtype])


@pytest.mark.parametrize("chunk", [None, 64])
def test_minus_infinity_is_probability_zero_and_an_all_masked_row_is_nan_as_in_eager(chunk):
    x = _logits((3, 300), torch.float32)
    x[0, :200] = -float("inf")  # the first chunks hold nothing but -inf
    x[1] = -float("inf")
    x[2, ::7] = -float("inf")
    out = softmax_forward(x, chunk=chunk)
    expected = torch.softmax(x.double(), dim=-1)
    assert torch.isnan(out[1]).all() and torch.isnan(expected[1]).all()
    torch.testing.assert_close(out[[0, 2]].double(), expected[[0, 2]], **TOLERANCE[torch.float32])
    assert (out[0, :200] == 0).all() and (out[2, ::7] == 0).all()


def test_large_logits_do_not_overflow():
    x = torch.tensor([[1000.0, 999.0, -1000.0, 0.0]])
    torch.testing.assert_close(softmax_forward(x).double(), softmax_reference(x), rtol=1e-6, atol=1e-30)


def test_strided_rows_are_read_in_place_and_transposed_inputs_are_copied():
    x = _logits((6, 130), torch.float32)
    for view in (x[:, :100], x[::2, 5:105], x.t()):
        torch.testing.assert_close(softmax_forward(view, chunk=32).double(), softmax_reference(view),
                                   **TOLERANCE[torch.float32])


def test_plan_holds_rows_up_to_16384_in_registers_then_loops_in_chunks():
    assert rows.row_plan(1000) == rows.RowPlan(2, 1024, False, 4)
    assert rows.row_plan(37) == rows.RowPlan(32, 64, False, 4)
    assert rows.row_plan(16384) == rows.RowPlan(1, 16384, False, 16)
    assert rows.row_plan(16385) == rows.RowPlan(1, 8192, True, 16)
    assert rows.row_plan(300, chunk=64) == rows.RowPlan(1, 64, True, 4)
    assert rows.row_plan(64, chunk=64) == rows.RowPlan(32, 64, False, 4)
    assert rows.resident_programs(torch.device("cpu"), 100) == 8 and rows.resident_programs(torch.device("cpu"), 3) == 3
    with pytest.raises(ValueError, match="power of two >= 16"):
        rows.row_plan(100, chunk=48)


def test_bad_inputs_are_refused_before_any_kernel_runs():
    for bad, message in [(torch.tensor(1.0), "non-empty last dimension"), (torch.ones(3, 0), "non-empty last"),
                         (torch.ones(3, 4, dtype=torch.float64), "float16, bfloat16 or float32"),
                         (torch.ones(3, 4, dtype=torch.int32), "float16, bfloat16 or float32")]:
        with pytest.raises(ValueError, match=message):
            softmax_forward(bad)


def test_empty_batches_and_min_bytes():
    assert softmax_forward(torch.ones(0, 7)).shape == (0, 7)
    assert softmax_min_bytes(2048, 128256, torch.bfloat16) == 2 * 2048 * 128256 * 2


# --- on the GPU ------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(2048, 128256), (4096, 32000), (4097, 1000), (300, 16384), (8, 16385)], ids=str)
def test_softmax_on_the_gpu_matches_float64(shape, dtype):
    x = _logits(shape, dtype, "cuda")
    tolerance = dict(TOLERANCE[dtype], rtol=4e-3) if dtype == torch.bfloat16 else dict(TOLERANCE[dtype], rtol=1e-5)
    torch.testing.assert_close(softmax_forward(x).double(), softmax_reference(x), **tolerance)

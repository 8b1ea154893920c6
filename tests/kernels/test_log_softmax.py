"""Log-softmax: the Triton kernels under the interpreter (fp16, fp32, bf16) against float64 on
both paths (rows in registers, packed; long rows in chunks by a persistent grid), every output
written; tiny probabilities stay exact (x - lse, not log of an underflowed softmax); -inf
logits and an all -inf row as in eager; refusals. On a GPU: bf16/fp16/fp32 at vocabulary
widths. (The kernels' sm_90 machine code is checked in test_reductions_sm90.py.)"""

import pytest
import torch

from kforge.kernels.reductions.log_softmax import log_softmax_forward, log_softmax_reference

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on padding rows and -inf
# outputs ~ -10: one rounding of the output (bf16 truncated by the interpreter: 2^-7), fp32 lse ~1e-6
TOLERANCE = {torch.float32: dict(rtol=1e-6, atol=1e-5), torch.float16: dict(rtol=1e-3, atol=1e-5),
             torch.bfloat16: dict(rtol=8e-3, atol=1e-5)}
CASES = [((7, 1000), None), ((3, 4099), None), ((2, 3, 37), None), ((5, 300), 64), ((9, 300), 128), ((2, 16500), None)]


def _logits(shape, dtype, device="cpu", seed=1):
    g = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(shape, generator=g)).to(dtype=dtype, device=device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape,chunk", CASES, ids=str)
def test_log_softmax_matches_float64(shape, chunk, dtype, nan_outputs):
    x = _logits(shape, dtype)
    out = log_softmax_forward(x, chunk=chunk)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out.double(), log_softmax_reference(x), **TOLERANCE[dtype])


@pytest.mark.parametrize("chunk", [None, 16])
def test_probabilities_that_underflow_keep_their_log(chunk):
    x = torch.tensor([[0.0, -200.0, -300.0, 5.0] * 8])  # exp(-300) underflows fp32; its log does not
    torch.testing.assert_close(log_softmax_forward(x, chunk=chunk).double(), log_softmax_reference(x), rtol=1e-6,
                               atol=1e-5)


@pytest.mark.parametrize("chunk", [None, 64])
def test_minus_infinity_stays_minus_infinity_and_an_all_masked_row_is_nan_as_in_eager(chunk):
    x = _logits((3, 300), torch.float32)
    x[0, :200] = -float("inf")
    x[1] = -float("inf")
    out = log_softmax_forward(x, chunk=chunk)
    expected = torch.log_softmax(x.double(), dim=-1)
    assert torch.isnan(out[1]).all() and torch.isnan(expected[1]).all()
    assert torch.isneginf(out[0, :200]).all()
    torch.testing.assert_close(out[[0, 2]].double(), expected[[0, 2]], **TOLERANCE[torch.float32])


def test_strided_inputs_and_refusals():
    x = _logits((6, 130), torch.float32)
    torch.testing.assert_close(log_softmax_forward(x[::2, 3:103], chunk=32).double(),
                               log_softmax_reference(x[::2, 3:103]), **TOLERANCE[torch.float32])
    for bad in (torch.tensor(2.0), torch.ones(2, 0), torch.ones(2, 3, dtype=torch.float64)):
        with pytest.raises(ValueError, match="log_softmax"):
            log_softmax_forward(bad)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(4096, 32000), (1024, 128256), (4097, 1000), (8, 16385)], ids=str)
def test_log_softmax_on_the_gpu_matches_float64(shape, dtype):
    x = _logits(shape, dtype, "cuda")
    tolerance = dict(TOLERANCE[dtype], rtol=4e-3) if dtype == torch.bfloat16 else TOLERANCE[dtype]
    torch.testing.assert_close(log_softmax_forward(x).double(), log_softmax_reference(x), **tolerance)

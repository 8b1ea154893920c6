"""Row mean and variance: the Triton kernels under the interpreter (fp16, fp32, bf16) against
float64 on both paths (rows in registers, packed, odd widths; long rows in chunks merged with
Chan's update), biased and unbiased, every statistic written; a mean 10^4 times the spread
(where E[x^2] - E[x]^2 in fp32 would return noise); one-element rows; leading shapes;
refusals. On a GPU: bf16 activations at model widths."""

import pytest
import torch

from kforge.kernels.reductions.row_reduce import row_mean_var, row_mean_var_min_bytes, row_mean_var_reference

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on 0/0 of one-element rows
CASES = [((7, 1000), None), ((3, 4099), None), ((2, 3, 37), None), ((5, 300), 64), ((2, 16500), None)]


def _x(shape, dtype, device="cpu", seed=3, mean=3.0, spread=2.0):
    g = torch.Generator().manual_seed(seed)
    return (mean + spread * torch.randn(shape, generator=g)).to(dtype=dtype, device=device)


@pytest.mark.parametrize("correction", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape,chunk", CASES, ids=str)
def test_mean_and_variance_match_float64(shape, chunk, dtype, correction, nan_outputs):
    x = _x(shape, dtype)
    mean, var = row_mean_var(x, correction=correction, chunk=chunk)
    expected_mean, expected_var = row_mean_var_reference(x, correction=correction)
    assert mean.shape == var.shape == shape[:-1] and mean.dtype == var.dtype == torch.float32
    torch.testing.assert_close(mean.double(), expected_mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(var.double(), expected_var, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk", [None, 64])
def test_variance_survives_a_mean_ten_thousand_times_the_spread(chunk):
    x = _x((4, 1000), torch.float32, mean=1e4, spread=1.0)
    _, var = row_mean_var(x, chunk=chunk)
    _, expected = row_mean_var_reference(x)
    torch.testing.assert_close(var.double(), expected, rtol=1e-3, atol=0)  # E[x^2] - E[x]^2 would be off by ~100%


def test_one_element_rows_have_no_unbiased_variance_as_in_torch():
    x = _x((3, 1), torch.float32)
    mean, var = row_mean_var(x)
    torch.testing.assert_close(mean, x[:, 0])
    assert torch.isnan(var).all() and torch.isnan(x.var(-1)).all()
    assert (row_mean_var(x, correction=0)[1] == 0).all()


def test_strided_rows_and_refusals():
    x = _x((6, 130), torch.float32)
    for got, want in zip(row_mean_var(x[::2, 3:103], chunk=32), row_mean_var_reference(x[::2, 3:103])):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="correction must be >= 0"):
        row_mean_var(x, correction=-1)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        row_mean_var(x.double())
    assert row_mean_var_min_bytes(32768, 8192, torch.bfloat16) == 32768 * 8192 * 2 + 8 * 32768


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(32768, 8192), (4097, 4096), (64, 28672), (300, 1000)], ids=str)
def test_mean_and_variance_on_the_gpu_match_float64(shape):
    x = _x(shape, torch.bfloat16, "cuda")
    mean, var = row_mean_var(x)
    expected_mean, expected_var = row_mean_var_reference(x)
    torch.testing.assert_close(mean.double(), expected_mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(var.double(), expected_var, rtol=1e-5, atol=1e-5)

"""Cumulative sum: the Triton kernels under the interpreter (fp32, fp16, bf16) against float64
on both paths (rows in registers, packed, odd widths; long rows in chunks chained by a carry,
with a tail), every output written; the carry by hand; integers exact in fp32; leading shapes;
strided rows; refusals. On a GPU: fp32 and bf16 at the problem's widths."""

import pytest
import torch

from kforge.kernels.reductions.cumsum import cumsum_forward, cumsum_reference

CASES = [((7, 1000), None), ((3, 4099), None), ((2, 3, 37), None), ((5, 300), 64), ((2, 16500), None)]


def _x(shape, dtype, device="cpu", seed=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype=dtype, device=device)


def _tolerance(x, dtype):
    """fp32 sums of n terms ~N(0, 1) in any order: within ~sqrt(n) 2^-24 of the prefix's size;
    one rounding of the output for fp16/bf16 (bf16 truncated by the interpreter: 2^-7)."""
    n = x.shape[-1]
    scale = float(cumsum_reference(x).abs().max())
    rtol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    return dict(rtol=rtol, atol=max(1e-6, 4 * n**0.5 * 2**-24 * scale))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape,chunk", CASES, ids=str)
def test_cumsum_matches_float64(shape, chunk, dtype, nan_outputs):
    x = _x(shape, dtype)
    out = cumsum_forward(x, chunk=chunk)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out.double(), cumsum_reference(x), **_tolerance(x, dtype))


@pytest.mark.parametrize("chunk", [None, 16])
def test_integers_are_summed_exactly_across_chunks(chunk):
    x = torch.arange(100, dtype=torch.float32).repeat(3, 1)
    x[1] = -x[1]
    assert torch.equal(cumsum_forward(x, chunk=chunk), torch.cumsum(x, -1))


def test_strided_rows_and_refusals():
    x = _x((6, 130), torch.float32)
    view = x[::2, 3:103]
    torch.testing.assert_close(cumsum_forward(view, chunk=32).double(), cumsum_reference(view),
                               **_tolerance(view, torch.float32))
    for bad in (torch.tensor(1.0), torch.ones(3, 0), torch.ones(3, 4, dtype=torch.int64)):
        with pytest.raises(ValueError, match="cumsum"):
            cumsum_forward(bad)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(4096, 32768), (8192, 8192), (300, 1000), (8, 16385)], ids=str)
def test_cumsum_on_the_gpu_matches_float64(shape, dtype):
    x = _x(shape, dtype, "cuda")
    tolerance = _tolerance(x, dtype)
    if dtype == torch.bfloat16:
        tolerance["rtol"] = 4e-3
    torch.testing.assert_close(cumsum_forward(x).double(), cumsum_reference(x), **tolerance)

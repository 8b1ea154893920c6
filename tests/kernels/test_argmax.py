"""Argmax over the last dim: the Triton kernels under the interpreter against torch.argmax, its
semantics to the index (ties: the first; NaN: the first NaN; a row of -inf: 0), one block and
many, tails, every dtype it takes, strided rows; refusals. On a GPU: Llama 3's vocab."""

import pytest
import torch

from kforge.kernels.serving.argmax import argmax_last_dim

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _rows(rows, n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, n, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,n,block", [(3, 1000, 64), (2, 129, 16), (4, 50, 64), (1, 4096, 256)], ids=str)
def test_matches_torch_argmax(rows, n, block, dtype):
    x = _rows(rows, n, dtype)
    assert torch.equal(argmax_last_dim(x, block=block), x.argmax(dim=-1))


@pytest.mark.parametrize("block", [16, 4096], ids=str)  # many blocks, one block
def test_ties_nans_and_infinities_follow_torch(block):
    n = 300
    x = torch.full((6, n), -1.0)
    x[0, [7, 40, 299]] = 5.0  # ties across blocks: the first
    x[1, [33, 34]] = 5.0  # ties inside a block
    x[1, 200] = float("nan")  # a NaN beats a larger value before it
    x[2] = float("-inf")  # nothing but -inf: index 0
    x[3, [250, 20]] = float("nan")  # two NaNs: the first
    x[3, 5] = float("inf")
    x[4, 299] = float("inf")  # the last element, in the tail block
    x[5, 17] = float("inf")
    x[5, 18] = float("inf")
    expected = torch.tensor([7, 200, 0, 20, 299, 17])
    assert torch.equal(x.argmax(dim=-1), expected)  # the semantics the kernel must copy
    assert torch.equal(argmax_last_dim(x, block=block), expected)


def test_strided_rows_and_a_non_contiguous_last_dim():
    wide = _rows(4, 700, torch.float32, seed=1)
    x = wide[:, :500]  # row stride 700
    assert torch.equal(argmax_last_dim(x, block=64), x.argmax(dim=-1))
    y = _rows(500, 3, torch.float32, seed=2).t()  # last dim strided: copied first
    assert torch.equal(argmax_last_dim(y, block=64), y.argmax(dim=-1))


def test_no_rows_gives_an_empty_result():
    assert argmax_last_dim(torch.empty(0, 10)).shape == (0,)


@pytest.mark.parametrize("x,block,message", [
    (torch.zeros(3), 2048, "(rows, n)"),
    (torch.zeros(2, 3, dtype=torch.int32), 2048, "float16/bfloat16/float32"),
    (torch.zeros(2, 0), 2048, "empty row"),
    (torch.zeros(1, 10), 48, "power of two"),
    (torch.zeros(1, 4097 * 16), 16, "use torch.argmax"),
], ids=["1d", "int", "empty", "block", "too long"])
def test_refusals_say_why(x, block, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        argmax_last_dim(x, block=block)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_llama3_vocab_on_the_gpu(dtype):
    x = _rows(8, 128256, dtype, seed=3).cuda()
    x[5, [1000, 128255]] = 1e4  # a tie across blocks
    assert torch.equal(argmax_last_dim(x), x.argmax(dim=-1))

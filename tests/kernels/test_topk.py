"""Top-k: the Triton kernels under the interpreter against torch.topk (values and indices,
largest first) on rows of distinct values (fp32, fp16, bf16), one chunk or several with a
tail, k from 1 to the whole row; rows sorted both ways (every top-k in one chunk; every
chunk's radix select resolved only at the last byte); ties (exactly the largest values,
smaller indices first); infinities and signed zeros; every output written; refusals. On a
GPU: 512 x 128256 fp32 logits and odd shapes."""

import pytest
import torch

from kforge.kernels.reductions.topk import topk_forward, topk_min_bytes

# (rows, columns, k, chunk): one chunk; five chunks of 64 with a tail of 44; nine chunks of
# 128 with a tail of 76; k = 1; k = the whole row; k not a power of two over ten chunks
CASES = [((5, 1000), 50, None), ((3, 300), 7, 64), ((2, 1100), 50, 128), ((4, 999), 1, None), ((3, 40), 40, None),
         ((2, 2, 300), 20, 32)]


BITS = {torch.float32: (torch.int32, 0x3F800000, 31), torch.float16: (torch.int16, 0x3C00, 15),
        torch.bfloat16: (torch.int16, 0x3F80, 15)}  # integer view, the bits of 1.0, the sign bit


def _distinct(shape, dtype, device="cpu", seed=5):
    """Rows of distinct values, each row a random permutation of the same n: consecutive bit
    patterns up from 1.0 and their negatives (so distinct in any dtype, both signs)."""
    g = torch.Generator().manual_seed(seed)
    n = shape[-1]
    integer, one, sign = BITS[dtype]
    magnitudes = (one + torch.arange((n + 1) // 2)).to(integer).view(dtype)
    values = torch.cat((magnitudes, -magnitudes[: n // 2]))
    order = torch.rand(shape, generator=g).argsort(dim=-1)
    return values[order].to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape,k,chunk", CASES, ids=str)
@pytest.mark.slow
def test_topk_equals_torch_topk_on_distinct_values(shape, k, chunk, dtype, nan_outputs):
    x = _distinct(shape, dtype)
    values, indices = topk_forward(x, k, chunk=chunk)
    expected_values, expected_indices = torch.topk(x, k)
    assert values.dtype == x.dtype and indices.dtype == torch.int64 and values.shape == (*shape[:-1], k)
    assert torch.equal(values, expected_values) and torch.equal(indices, expected_indices)


@pytest.mark.parametrize("chunk", [None, 64])
@pytest.mark.slow
def test_sorted_rows_put_the_top_k_in_one_chunk_or_spread_it_over_all(chunk):
    x = torch.arange(1000, dtype=torch.float32).repeat(2, 1)
    x[1] = x[1].flip(0)
    values, indices = topk_forward(x, 50, chunk=chunk)
    expected_values, expected_indices = torch.topk(x, 50)
    assert torch.equal(values, expected_values) and torch.equal(indices, expected_indices)


def test_values_one_bit_apart_resolve_at_the_last_byte():
    base = torch.tensor(1.0).view(torch.int32)
    x = (base + torch.randperm(600, generator=torch.Generator().manual_seed(0))).view(torch.float32)[None]
    values, indices = topk_forward(x, 30, chunk=128)
    expected_values, expected_indices = torch.topk(x, 30)
    assert torch.equal(values, expected_values) and torch.equal(indices, expected_indices)


@pytest.mark.slow
def test_ties_give_exactly_the_largest_values_smaller_indices_first():
    x = torch.randint(0, 4, (3, 700), generator=torch.Generator().manual_seed(1)).float()
    values, indices = topk_forward(x, 50, chunk=128)
    assert torch.equal(values, torch.topk(x, 50).values)
    assert torch.equal(x.gather(1, indices), values)
    assert (values == 3).all()
    assert torch.equal(indices, (x == 3).int().argsort(dim=1, descending=True, stable=True)[:, :50])


def test_infinities_and_signed_zeros_order_as_floats():
    x = torch.tensor([[0.0, -0.0, float("inf"), -float("inf"), -1.0, 1.0, -2.5, 3.0]])
    values, indices = topk_forward(x, 8)
    assert values[0].tolist() == [float("inf"), 3.0, 1.0, 0.0, -0.0, -1.0, -2.5, -float("inf")]
    assert indices.tolist() == [[2, 7, 5, 0, 1, 4, 6, 3]]
    assert str(values[0, 4].item()) == "-0.0"


def test_bad_inputs_are_refused_before_any_kernel_runs():
    x = torch.randn(3, 100)
    for args, kwargs, message in [((x, 0), {}, "k must be an int in 1..min"), ((x, 101), {}, "k must be an int"),
                                  ((x, 2000), {}, "k must be an int"), ((x.double(), 5), {}, "float16, bfloat16"),
                                  ((torch.tensor(1.0), 1), {}, "at least one dimension"),
                                  ((x, 50), {"chunk": 32}, "power of two >= 64")]:
        with pytest.raises(ValueError, match=message):
            topk_forward(*args, **kwargs)
    assert topk_min_bytes(512, 128256, 50, torch.float32) == 512 * 128256 * 4 + 512 * 50 * 12


@pytest.mark.gpu
@pytest.mark.parametrize("shape,k", [((512, 128256), 50), ((7, 32000), 1000), ((1000, 4099), 3), ((1, 100), 100)],
                         ids=str)
def test_topk_on_the_gpu_equals_torch_topk(shape, k):
    x = _distinct(shape, torch.float32, "cuda")
    values, indices = topk_forward(x, k)
    expected_values, expected_indices = torch.topk(x, k)
    assert torch.equal(values, expected_values) and torch.equal(indices, expected_indices)

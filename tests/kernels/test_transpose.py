"""Transpose: the tiled Triton kernel under the interpreter, exact, on odd shapes over many
tiles (tails on both sides), batches, every dtype it takes, strided and already-transposed
inputs, degenerate shapes; every output written; refusals. On a GPU: 16384^2 bf16 and odd
shapes. (Its sm_90 machine code is checked in test_reductions_sm90.py.)"""

import pytest
import torch

from kforge.kernels.layout.transpose import transpose_forward, transpose_min_bytes


def _x(shape, dtype, device="cpu", seed=6):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype=dtype, device=device)
    return torch.randint(-100, 100, shape, generator=g).to(dtype=dtype, device=device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8,
                                   torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("shape,tile", [((67, 45), 16), ((3, 37, 130), 32), ((129, 1), 64), ((1, 200), 64),
                                        ((64, 64), 64)], ids=str)
def test_transpose_is_exact(shape, tile, dtype, nan_outputs):
    x = _x(shape, dtype)
    out = transpose_forward(x, tile=tile)
    assert out.is_contiguous() and out.dtype == dtype
    assert torch.equal(out, x.transpose(-1, -2))


def test_strided_and_already_transposed_inputs_are_read_in_place():
    x = _x((40, 50), torch.float32)
    for view in (x.t(), x[::2, 3:47], x[:, ::3]):
        assert torch.equal(transpose_forward(view, tile=16), view.t())
    batch = _x((3, 20, 30), torch.float16).transpose(0, 1)  # (20, 3, 30): a batch stride smaller than a row's
    assert torch.equal(transpose_forward(batch, tile=16), batch.transpose(1, 2))


def test_empty_matrices_and_refusals():
    assert transpose_forward(torch.ones(0, 5)).shape == (5, 0)
    for bad, message in [(torch.ones(3), "2-D"), (torch.ones(2, 2, 2, 2), "2-D"), (torch.ones(2, 2, dtype=torch.bool),
                                                                                  "does not take")]:
        with pytest.raises(ValueError, match=message):
            transpose_forward(bad)
    with pytest.raises(ValueError, match="power of two"):
        transpose_forward(torch.ones(4, 4), tile=24)
    assert transpose_min_bytes(16384 * 16384, torch.bfloat16) == 2 * 16384 * 16384 * 2


@pytest.mark.gpu
@pytest.mark.parametrize("shape,dtype", [((16384, 16384), torch.bfloat16), ((4099, 1000), torch.bfloat16),
                                         ((7, 4096, 130), torch.float32), ((1, 100000), torch.float16)], ids=str)
def test_transpose_on_the_gpu_is_exact(shape, dtype):
    x = _x(shape, dtype, "cuda")
    assert torch.equal(transpose_forward(x), x.transpose(-1, -2))

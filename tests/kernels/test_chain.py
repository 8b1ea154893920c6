"""The fused elementwise chain residual + sigmoid(gate) * gelu_tanh(x): the Triton kernel under
the interpreter (fp32, fp16, bf16) against float64 on sizes with a tail, every output written;
GELU's tanh form by hand at a few points; saturation without NaN at large |x|; strided
inputs (copied); refusals. On a GPU: bf16/fp16/fp32 at 8192 x 8192."""

import math

import pytest
import torch

from kforge.kernels.elementwise.chain import (gated_gelu_residual, gated_gelu_residual_min_bytes,
                                              gated_gelu_residual_reference)

# one rounding of the output (bf16 truncated by the interpreter: 2^-7), after fp32 math
TOLERANCE = {torch.float32: dict(rtol=2e-6, atol=2e-6), torch.float16: dict(rtol=1e-3, atol=1e-4),
             torch.bfloat16: dict(rtol=8e-3, atol=1e-3)}


def _inputs(shape, dtype, device="cpu", seed=7):
    g = torch.Generator().manual_seed(seed)
    return [(2 * torch.randn(shape, generator=g)).to(dtype=dtype, device=device) for _ in range(3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(7, 300), (2049,), (3, 4, 5)], ids=str)
def test_chain_matches_float64(shape, dtype, nan_outputs):
    x, gate, residual = _inputs(shape, dtype)
    out = gated_gelu_residual(x, gate, residual)
    assert out.shape == x.shape and out.dtype == dtype and out.is_contiguous()
    torch.testing.assert_close(out.double(), gated_gelu_residual_reference(x, gate, residual), **TOLERANCE[dtype])


def test_gelu_tanh_form_by_hand():
    x = torch.tensor([-3.0, -1.0, 0.0, 0.5, 2.0])
    zero = torch.zeros_like(x)

    def gelu(v):
        return 0.5 * v * (1 + math.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v**3)))

    # gate 0 -> sigmoid 1/2; residual 1
    expected = torch.tensor([1 + 0.5 * gelu(v) for v in x.tolist()], dtype=torch.float64)
    torch.testing.assert_close(gated_gelu_residual(x, zero, zero + 1).double(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # the interpreter's numpy
def test_large_inputs_saturate_without_nan():
    x = torch.tensor([-60.0, -12.0, 12.0, 60.0])
    gate = torch.tensor([-100.0, 100.0, 100.0, -100.0])
    out = gated_gelu_residual(x, gate, torch.zeros(4))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), gated_gelu_residual_reference(x, gate, torch.zeros(4)), rtol=1e-6,
                               atol=1e-30)


def test_strided_inputs_and_refusals():
    x, gate, residual = _inputs((20, 30), torch.float32)
    torch.testing.assert_close(gated_gelu_residual(x.t(), gate.t(), residual.t()).double(),
                               gated_gelu_residual_reference(x.t(), gate.t(), residual.t()), **TOLERANCE[torch.float32])
    for args, message in [((x, gate[:3], residual), "share shape and dtype"), ((x, gate.half(), residual),
                                                                              "share shape and dtype"),
                          ((x.double(), gate, residual), "float16, bfloat16 or float32"), ((x, gate, 1.0), "tensor")]:
        with pytest.raises(ValueError, match=message):
            gated_gelu_residual(*args)
    assert gated_gelu_residual_min_bytes(100, torch.bfloat16) == 800


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(8192, 8192), (4099, 1000)], ids=str)
def test_chain_on_the_gpu_matches_float64(shape, dtype):
    x, gate, residual = _inputs(shape, dtype, "cuda")
    tolerance = dict(TOLERANCE[dtype], rtol=4e-3) if dtype == torch.bfloat16 else dict(TOLERANCE[dtype], rtol=1e-5)
    torch.testing.assert_close(gated_gelu_residual(x, gate, residual).double(),
                               gated_gelu_residual_reference(x, gate, residual), **tolerance)

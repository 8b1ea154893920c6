"""Triton under the interpreter on a machine with no GPU, and the bf16 dot it mends."""

import pytest
import torch

from kforge.runtime.interpreter import interpreter_active, mend_bf16_dot

pytestmark = pytest.mark.skipif(not interpreter_active(), reason="Triton compiles here (a GPU machine)")


def test_kforge_turned_the_interpreter_on_before_triton_was_imported():
    import triton

    assert triton.knobs.runtime.interpret


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_tl_dot_is_exact_for_every_input_dtype(dtype):
    import triton
    import triton.language as tl

    mend_bf16_dot()

    @triton.jit
    def dot_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
        rm, rn, rk = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
        a = tl.load(a_ptr + rm[:, None] * K + rk[None, :])
        b = tl.load(b_ptr + rk[:, None] * N + rn[None, :])
        tl.store(c_ptr + rm[:, None] * N + rn[None, :], tl.dot(a, b))

    a, b = torch.randn(16, 32).to(dtype), torch.randn(32, 16).to(dtype)
    c = torch.full((16, 16), float("nan"))
    dot_kernel[(1,)](a, b, c, 16, 16, 32)
    expected = a.double() @ b.double()
    assert torch.allclose(c.double(), expected, rtol=1e-5, atol=1e-5)


def test_fp32_to_bf16_casts_round_to_nearest_even_as_torch_does():
    import triton
    import triton.language as tl

    from kforge.runtime.interpreter import mend_bf16_casts

    mend_bf16_casts()

    @triton.jit
    def cast_kernel(x_ptr, y_ptr, N: tl.constexpr):
        offsets = tl.arange(0, N)
        tl.store(y_ptr + offsets, tl.load(x_ptr + offsets).to(tl.bfloat16))

    one_ulp = 2.0**-7  # of bf16 at 1.0
    special = [1 + one_ulp / 2, 1 + 1.5 * one_ulp, -(1 + one_ulp / 2), 1 + one_ulp * 0.51, 3.3895e38, -3.4e38,
               float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1e-40]  # ties both ways, overflow, subnormal
    x = torch.cat([torch.tensor(special), torch.randn(52) * 1000]).float()
    y = torch.empty(64, dtype=torch.bfloat16)
    cast_kernel[(1,)](x, y, 64)
    expected = x.to(torch.bfloat16)
    assert torch.equal(y.view(torch.int16)[~x.isnan()], expected.view(torch.int16)[~x.isnan()])
    assert y[x.isnan()].isnan().all()


@pytest.mark.parametrize("source", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fp8, largest", [(torch.float8_e4m3fn, 448.0), (torch.float8_e5m2, 57344.0)], ids=str)
def test_casts_to_fp8_round_to_nearest_even_and_saturate_as_the_gpu_does(source, fp8, largest):
    import triton
    import triton.language as tl

    from kforge.runtime.interpreter import mend_fp8_casts

    mend_fp8_casts()
    target = tl.float8e4nv if fp8 == torch.float8_e4m3fn else tl.float8e5

    @triton.jit
    def cast_kernel(x_ptr, y_ptr, N: tl.constexpr, TARGET: tl.constexpr):
        offsets = tl.arange(0, N)
        tl.store(y_ptr + offsets, tl.load(x_ptr + offsets).to(TARGET))

    codes = torch.arange(0, 127, dtype=torch.uint8).view(fp8).float()  # every positive finite e4m3/e5m2 below NaN
    codes = codes[codes.isfinite()]
    midpoints = (codes[:-1] + codes[1:]) / 2  # ties: to the even pattern
    special = torch.tensor([0.49, 124.3, 0.98, largest * 1.5, -largest * 4, 1e-9, float("nan")])
    x = torch.cat([codes, midpoints, -midpoints, special, torch.randn(300) * largest / 8]).to(source)
    size = triton.next_power_of_2(x.numel())
    x = torch.cat([x, torch.zeros(size - x.numel(), dtype=source)])
    y = torch.empty(size, dtype=fp8)
    cast_kernel[(1,)](x, y, size, target)
    finite = ~x.isnan()
    expected = x.float().clamp(-largest, largest).to(fp8)  # the GPU's cvt.rn.satfinite
    assert torch.equal(y.view(torch.uint8)[finite], expected.view(torch.uint8)[finite])
    assert y.float()[~finite].isnan().all()

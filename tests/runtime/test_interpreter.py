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

"""fused_linear (`kernels/fused/linear.py`): on the CPU it is the Triton epilogue GEMM under the
interpreter, checked against float64 with a 3-D x; on an H100 bf16 goes to the CUDA rungs
(the rung the measured table picks), fp16 to Triton, both against float64 on odd shapes."""

from __future__ import annotations

import pytest
import torch

from kforge.kernels import gemm_bf16
from kforge.kernels.fused.gemm_epilogue import gemm_epilogue_reference
from kforge.kernels.fused.linear import fused_linear
from kforge.ops.matmul import best_kernel

CASES = [("none", False, False), ("none", True, False), ("gelu", True, False), ("gelu_tanh", True, False),
         ("silu", False, False), ("none", True, True), ("gelu", False, True)]


def _operands(shape, n, dtype, device, bias, residual, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    w = torch.randn(n, shape[-1], generator=g) / shape[-1] ** 0.5
    b = torch.randn(n, generator=g) if bias else None
    r = torch.randn(*shape[:-1], n, generator=g) if residual else None
    return [t.to(dtype=dtype, device=device) if t is not None else None for t in (x, w, b, r)]


def _assert_close(got, x, w, b, r, activation, tolerance):
    want = gemm_epilogue_reference(x, w, bias=b, activation=activation, residual=r)
    assert got.shape == want.shape and got.dtype == x.dtype
    err = ((got.double() - want).abs() / (1 + want.abs())).max().item()
    assert err < tolerance, err


@pytest.mark.parametrize("activation, bias, residual", CASES)
def test_cpu_takes_the_triton_kernel_and_matches_float64(activation, bias, residual):
    x, w, b, r = _operands((2, 19, 40), 24, torch.float16, "cpu", bias, residual)
    got = fused_linear(x, w, bias=b, activation=activation, residual=r)
    _assert_close(got, x, w, b, r, activation, 3e-3)


def test_bad_inputs_are_refused_with_the_epilogue_gemms_message():
    x, w, _, _ = _operands((4, 16), 8, torch.float16, "cpu", False, False)
    with pytest.raises(ValueError, match="activation must be one of"):
        fused_linear(x, w, activation="relu")
    with pytest.raises(ValueError, match="K must match"):
        fused_linear(x, w[:, :8])


@pytest.mark.gpu
@pytest.mark.parametrize("activation, bias, residual", CASES)
def test_gpu_bf16_goes_to_the_cuda_rungs_and_matches_float64(activation, bias, residual, monkeypatch):
    calls = []
    real = gemm_bf16.gemm
    monkeypatch.setattr(gemm_bf16, "gemm", lambda *args, **kwargs: calls.append(args[2]) or real(*args, **kwargs))
    for shape, n in (((3, 67, 1032), 264), ((8192, 768), 2304), ((300, 2048), 776)):
        x, w, b, r = _operands(shape, n, torch.bfloat16, "cuda", bias, residual)
        _assert_close(fused_linear(x, w, bias=b, activation=activation, residual=r), x, w, b, r, activation, 1e-2)
    assert len(calls) == 3, "bf16 on an H100 must take the CUDA rungs"
    if activation != "none" or residual:
        assert set(calls) == {4}, "an activation or a residual takes rung 4 (the measured table)"
    if activation == "none" and not residual:  # bias only: the rung matmul picks for the shape
        picks = [best_kernel(m, n, k, torch.cuda.get_device_properties(0).multi_processor_count)[0]
                 for m, n, k in ((201, 264, 1032), (8192, 2304, 768), (300, 776, 2048))]
        assert calls == picks, (calls, picks)


@pytest.mark.gpu
def test_gpu_fp16_takes_the_triton_kernel(monkeypatch):
    monkeypatch.setattr(gemm_bf16, "gemm", lambda *args, **kwargs: pytest.fail("fp16 has no CUDA rung"))
    x, w, b, _ = _operands((130, 72), 40, torch.float16, "cuda", True, False)
    _assert_close(fused_linear(x, w, bias=b, activation="gelu"), x, w, b, None, "gelu", 3e-3)

"""`kforge.ops.gemv(x, weight)`: y = x @ weight.T for 1 to 16 token rows, on kforge's decode GEMV;
`gemv_residual(x, weight, residual)` = residual + x @ weight.T and `gemv_swiglu(x, w_gate_up)` =
silu(x @ W_gate.T) * (x @ W_up.T), the op after the projection fused into its store.

x is (K,) or (batch, K) with batch <= 16, weight is (N, K) as nn.Linear stores it; y is
(N,) or (batch, N) in x's dtype, accumulated in fp32. Minimum HBM bytes: the weight read
once, plus x and y (`gemv_min_bytes`): the op is judged by the share of HBM bandwidth it
reaches. More rows than 16 are a GEMM's job and are refused.

A `torch.library` custom op (inference only: no autograd formula): torch.compile sees one
opaque node. The kernel runs for fp16/bf16/fp32 CUDA tensors on Hopper whose rows are
contiguous (x is made contiguous if it is not: it is small); anything else, the CPU
included, computes x @ weight.T in PyTorch. The fused two round the product to x's dtype
before the add or SwiGLU, so they give the bits of the unfused pair (`kforge.ops.swiglu` for
the SwiGLU): a decode step fused or not decodes the same tokens.
"""

from __future__ import annotations

import torch

from kforge.kernels.serving.gemv import EPI_RESIDUAL, EPI_SWIGLU, MAX_BATCH, gemv_epilogue_reference, gemv_reference


def ours_can_run(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether our kernel takes these tensors (else the op computes x @ weight.T in PyTorch)."""
    if not (x.is_cuda and torch.cuda.get_device_capability(x.device) >= (9, 0)):
        return False
    from kforge.kernels.serving.gemv import check_gemv_inputs

    try:
        check_gemv_inputs(x, weight)
    except ValueError:
        return False
    return True


def require(ok: bool, message) -> None:
    """The eager op's check: a plain ValueError, without torch._check_value's symbolic-shape
    machinery (a few microseconds a call, against a kernel of 13 us at the smallest shape)."""
    if not ok:
        raise ValueError(message())


def _check_shapes(x: torch.Tensor, weight: torch.Tensor, check=require) -> None:
    check(x.dim() in (1, 2) and weight.dim() == 2,
          lambda: f"kforge::gemv takes x (K,) or (batch, K) and weight (N, K); got {tuple(x.shape)} and "
                  f"{tuple(weight.shape)}")
    check(x.shape[-1] == weight.shape[1], lambda: f"x has K = {x.shape[-1]} but weight (N, K) is {tuple(weight.shape)}")
    check(x.dim() == 1 or x.shape[0] <= MAX_BATCH,
          lambda: f"kforge::gemv takes at most {MAX_BATCH} rows, got {x.shape[0]}: use a GEMM (kforge.ops.matmul, "
                  f"torch.matmul) for more")


@torch.library.custom_op("kforge::gemv", mutates_args=())
def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    _check_shapes(x, weight)
    x = x.contiguous()
    if not ours_can_run(x, weight):
        return gemv_reference(x, weight)
    from kforge.kernels.serving.gemv import launch_gemv

    y = launch_gemv(x.view(-1, x.shape[-1]), weight, None)  # inputs checked by ours_can_run
    return y.view(-1) if x.dim() == 1 else y


@gemv.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    _check_shapes(x, weight, torch._check_value)  # symbolic shapes: a check, not a guard
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _fused(x: torch.Tensor, weight: torch.Tensor, epilogue: int, residual: torch.Tensor | None) -> torch.Tensor:
    x = x.contiguous()
    rows = x.view(-1, x.shape[-1])
    if residual is not None:
        residual = residual.contiguous().view(rows.shape[0], -1)
    if not ours_can_run(x, weight):
        y = gemv_epilogue_reference(rows, weight, epilogue, residual)
    else:
        from kforge.kernels.serving.gemv import check_epilogue_inputs, launch_gemv

        check_epilogue_inputs(rows, weight, epilogue, residual)
        y = launch_gemv(rows, weight, None, epilogue=epilogue, residual=residual)
    return y.view(-1) if x.dim() == 1 else y


@torch.library.custom_op("kforge::gemv_residual", mutates_args=())
def gemv_residual(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    _check_shapes(x, weight)
    require(residual.shape == (*x.shape[:-1], weight.shape[0]) and residual.dtype == x.dtype,
            lambda: f"kforge::gemv_residual needs a residual of the result's shape "
                    f"{(*x.shape[:-1], weight.shape[0])} and dtype {x.dtype}, got {tuple(residual.shape)} "
                    f"{residual.dtype}")
    return _fused(x, weight, EPI_RESIDUAL, residual)


@gemv_residual.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    _check_shapes(x, weight, torch._check_value)
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("kforge::gemv_swiglu", mutates_args=())
def gemv_swiglu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    _check_shapes(x, weight)
    require(weight.shape[0] % 2 == 0,
            lambda: f"kforge::gemv_swiglu takes a fused gate/up weight (2 x hidden, K), got {tuple(weight.shape)}")
    return _fused(x, weight, EPI_SWIGLU, None)


@gemv_swiglu.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    _check_shapes(x, weight, torch._check_value)
    return x.new_empty((*x.shape[:-1], weight.shape[0] // 2))

"""`kforge.ops.gemv(x, weight)`: y = x @ weight.T for 1 to 16 token rows, on kforge's decode GEMV.

x is (K,) or (batch, K) with batch <= 16, weight is (N, K) as nn.Linear stores it; y is
(N,) or (batch, N) in x's dtype, accumulated in fp32. Minimum HBM bytes: the weight read
once, plus x and y (`gemv_min_bytes`): the op is judged by the share of HBM bandwidth it
reaches. More rows than 16 are a GEMM's job and are refused.

A `torch.library` custom op (inference only: no autograd formula): torch.compile sees one
opaque node. The kernel runs for fp16/bf16/fp32 CUDA tensors on Hopper whose rows are
contiguous (x is made contiguous if it is not: it is small); anything else, the CPU
included, computes x @ weight.T in PyTorch.
"""

from __future__ import annotations

import torch

from kforge.kernels.serving.gemv import MAX_BATCH, gemv_reference


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

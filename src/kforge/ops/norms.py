"""`kforge.ops.rms_norm(x, weight, eps=1e-6, residual=None)` and
`kforge.ops.layer_norm(x, weight, bias=None, eps=1e-5, residual=None)`: normalization over
the last dimension on kforge's Triton kernels (`kforge.kernels.serving.norms`).

Without a residual each returns norm(x) * weight [+ bias]; with one, h = x + residual
(rounded to x's dtype) and the pair (norm(h) * weight [+ bias], h): h is the block's new
residual stream, so "add, then norm" is one pass over memory. Statistics in fp32, output
in x's dtype; x of any leading shape; the weight (and bias) may be fp32 under bf16/fp16
activations. Both outputs are new contiguous tensors: the inputs are not modified.

Four `torch.library` custom ops (`kforge::rms_norm`, `kforge::fused_add_rms_norm`,
`kforge::layer_norm`, `kforge::fused_add_layer_norm`) with fake implementations, so
torch.compile sees one opaque node each. Inference only: no autograd formula is
registered. The kernel runs for fp16/bf16/fp32 CUDA tensors; anything else (CPU tensors,
float64) runs the eager reference in PyTorch, with the same semantics.
"""

from __future__ import annotations

import torch

from kforge.kernels.serving.norms import (KERNEL_DTYPES, check_norm_inputs, layer_norm_reference,
                                          rms_norm_reference)


def ours_can_run(x: torch.Tensor, *params: torch.Tensor | None) -> bool:
    """Whether our kernel takes these tensors (else the op runs the PyTorch reference)."""
    return x.is_cuda and all(t is None or t.dtype in KERNEL_DTYPES for t in (x, *params))


def _check_shapes(x, weight, bias=None, residual=None) -> None:
    hidden = x.shape[-1]
    torch._check(weight.shape == (hidden,), lambda: f"weight {tuple(weight.shape)} does not match hidden {hidden}")
    torch._check(bias is None or bias.shape == (hidden,), lambda: f"bias {tuple(bias.shape)} != ({hidden},)")
    torch._check(residual is None or residual.shape == x.shape,
                 lambda: f"residual {tuple(residual.shape)} != x {tuple(x.shape)}")


def _contiguous(result):  # the reference keeps x's strides; the kernel (and the fake) return contiguous
    return tuple(t.contiguous() for t in result) if isinstance(result, tuple) else result.contiguous()


@torch.library.custom_op("kforge::rms_norm", mutates_args=())
def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _check_shapes(x, weight)
    if ours_can_run(x, weight):
        from kforge.kernels.serving.norms import rms_norm_forward

        return rms_norm_forward(x, weight, eps)
    return _contiguous(rms_norm_reference(x, weight, eps))


@_rms_norm.register_fake
def _(x, weight, eps):
    _check_shapes(x, weight)
    return x.new_empty(x.shape)


@torch.library.custom_op("kforge::fused_add_rms_norm", mutates_args=())
def _fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    _check_shapes(x, weight, residual=residual)
    if ours_can_run(x, weight):
        from kforge.kernels.serving.norms import rms_norm_forward

        return rms_norm_forward(x, weight, eps, residual)
    return _contiguous(rms_norm_reference(x, weight, eps, residual))


@_fused_add_rms_norm.register_fake
def _(x, residual, weight, eps):
    _check_shapes(x, weight, residual=residual)
    return x.new_empty(x.shape), x.new_empty(x.shape)


@torch.library.custom_op("kforge::layer_norm", mutates_args=())
def _layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    _check_shapes(x, weight, bias)
    if ours_can_run(x, weight, bias):
        from kforge.kernels.serving.norms import layer_norm_forward

        return layer_norm_forward(x, weight, bias, eps)
    return _contiguous(layer_norm_reference(x, weight, bias, eps))


@_layer_norm.register_fake
def _(x, weight, bias, eps):
    _check_shapes(x, weight, bias)
    return x.new_empty(x.shape)


@torch.library.custom_op("kforge::fused_add_layer_norm", mutates_args=())
def _fused_add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    _check_shapes(x, weight, bias, residual)
    if ours_can_run(x, weight, bias):
        from kforge.kernels.serving.norms import layer_norm_forward

        return layer_norm_forward(x, weight, bias, eps, residual)
    return _contiguous(layer_norm_reference(x, weight, bias, eps, residual))


@_fused_add_layer_norm.register_fake
def _(x, residual, weight, bias, eps):
    _check_shapes(x, weight, bias, residual)
    return x.new_empty(x.shape), x.new_empty(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None):
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension; with `residual`, the pair
    (rms_norm(x + residual), x + residual)."""
    check_norm_inputs(x, weight, None, residual, eps)
    if residual is None:
        return _rms_norm(x, weight, float(eps))
    return _fused_add_rms_norm(x, residual, weight, float(eps))


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, eps: float = 1e-5,
               residual: torch.Tensor | None = None):
    """(x - mean) / sqrt(var + eps) * weight [+ bias] over the last dimension (biased variance,
    as torch.nn.functional.layer_norm); with `residual`, the pair (layer_norm(x + residual),
    x + residual)."""
    check_norm_inputs(x, weight, bias, residual, eps)
    if residual is None:
        return _layer_norm(x, weight, bias, float(eps))
    return _fused_add_layer_norm(x, residual, weight, bias, float(eps))

"""`kforge.ops.swiglu(x)`: silu(gate) * up on kforge's Triton kernel
(`kforge.kernels.serving.swiglu`).

x is the output of a fused gate/up projection, (..., 2H) with the gate in the first H
columns and up in the last H (a Llama-style `gate_up_proj` weight, gate rows first);
the result is (..., H) in x's dtype, computed in fp32 and rounded once.

A `torch.library` custom op (`kforge::swiglu`) with a fake implementation, so
torch.compile sees one opaque node. Inference only: no autograd formula is registered.
The kernel runs for fp16/bf16/fp32 CUDA tensors; anything else (CPU tensors, float64)
runs the eager reference in PyTorch, with the same semantics.
"""

from __future__ import annotations

import torch

from kforge.kernels.serving.swiglu import KERNEL_DTYPES, check_swiglu_input, swiglu_reference


def ours_can_run(x: torch.Tensor) -> bool:
    """Whether our kernel takes x (else the op runs the PyTorch reference)."""
    return x.is_cuda and x.dtype in KERNEL_DTYPES


@torch.library.custom_op("kforge::swiglu", mutates_args=())
def _swiglu(x: torch.Tensor) -> torch.Tensor:
    torch._check(x.shape[-1] % 2 == 0, lambda: f"kforge::swiglu needs an even last dimension, got {tuple(x.shape)}")
    if ours_can_run(x):
        from kforge.kernels.serving.swiglu import swiglu_forward

        return swiglu_forward(x)
    return swiglu_reference(x).contiguous()


@_swiglu.register_fake
def _(x):
    torch._check(x.shape[-1] % 2 == 0, lambda: f"kforge::swiglu needs an even last dimension, got {tuple(x.shape)}")
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :H]) * x[..., H:] for x (..., 2H): gate first, then up."""
    check_swiglu_input(x)
    return _swiglu(x)

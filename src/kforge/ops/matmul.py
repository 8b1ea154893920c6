"""`kforge.ops.matmul(a, b)`: C = a @ b on kforge's best bf16 GEMM for the shape.

A `torch.library` custom op: torch.compile sees one opaque node with a fake (shape-only)
implementation, and autograd uses the same op for the backward products. Our kernels
take bf16 2-D operands on a Hopper GPU with N and K multiples of 8 (TMA's 16-byte rows);
b may be K x N row-major or the transpose of an N x K row-major tensor (a linear layer's
weight, `w.t()`), which the kernel reads as it lies. Anything else goes to torch.matmul.
"""

from __future__ import annotations

import functools

import torch


def best_kernel(m: int, n: int, k: int, sms: int = 132) -> tuple[int, dict[str, int]]:
    """Which rung and variant for an M x N x K product on `sms` SMs, from the H100 tables
    (benchmarks/notes/2026-11-22-session7: gemm-bf16-variants-{epilogue,shortk}.txt, the
    ladders ladder-{4096,8192}.txt, and `kforge bench gemm`):

    - 128 x 256 tiles leaving more than half the SMs idle (skinny M, 1024^3): rung 4's split-K
      variant cuts each 128 x 128 tile's K loop across the idle SMs.
    - K <= 1024, or 128 x 256 tiles filling their last wave less than 3/4: rung 6. Its two
      consumers take turns, one's epilogue under the other's k-loop, which pays where the
      k-loop is short (GPT-2's 8192 x 2304 x 768: 1.03x cuBLAS against rung 4's 0.92x; the LM
      head 8192 x 50304 x 768: 0.99x against 0.95x) or the tiles few (8192 x 768 x 3072, 1.45
      waves: 0.94x against 0.77x).
    - Wide, long products (M > 128, N >= 4096, K >= 8192) of two waves or more: rung 5, whose
      2-CTA clusters share each B panel over many k-tiles (8192^3 through the harness: 1.000x
      cuBLAS against rung 4's 0.981x). At K = 4096 it is a tie on the device (4096^3 0.976x
      and 0.978x) and through kforge.ops.matmul rung 4 measured the faster (the Level 1
      linear 4096^3: 196 against 240 us); where N is narrow the pairs cost more than they
      share (12608 x 1024 x 4096: 0.77x against rung 4's 1.00x).
    - Otherwise rung 4, the 128 x 256 cooperative kernel."""
    from kforge.kernels.gemm_bf16 import SPLIT_K_VARIANT

    tiles = -(-m // 128) * -(-n // 256)
    if 2 * tiles <= sms:
        return 4, dict(SPLIT_K_VARIANT)
    if k <= 1024 or tiles / sms / -(-tiles // sms) < 0.75:
        return 6, {}
    if m > 128 and n >= 4096 and k >= 8192 and tiles >= 2 * sms:  # (a cluster pairs two row tiles)
        return 5, {}
    return 4, {}


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _layout(b: torch.Tensor) -> str | None:
    if b.is_contiguous():
        return "kn"
    if b.t().is_contiguous():
        return "nk"
    return None


def ours_can_run(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the shape and placement suit our kernels (else the op falls back to torch.matmul)."""
    if a.dim() != 2 or b.dim() != 2 or a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
        return False
    if not (a.is_cuda and b.is_cuda and a.device == b.device and a.is_contiguous()):
        return False
    if torch.cuda.get_device_capability(a.device) != (9, 0):
        return False
    m, k = a.shape
    n = b.shape[1]
    return (m > 0 and n % 8 == 0 and k % 8 == 0 and k > 0 and _layout(b) is not None
            and a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0)


@torch.library.custom_op("kforge::matmul", mutates_args=())
def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if not ours_can_run(a, b):
        return torch.matmul(a, b)
    from kforge.kernels.gemm_bf16 import gemm

    layout = _layout(b)
    step, defines = best_kernel(a.shape[0], b.shape[1], a.shape[1], _sm_count(a.device.index))
    return gemm(a, b if layout == "kn" else b.t(), step, b_layout=layout, defines=defines)


@matmul.register_fake
def _(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    torch._check(a.dim() == 2 and b.dim() == 2, lambda: "kforge::matmul takes 2-D tensors")
    torch._check(a.shape[1] == b.shape[0], lambda: f"inner dimensions differ: {a.shape} @ {b.shape}")
    return a.new_empty((a.shape[0], b.shape[1]))


def _backward(ctx, grad: torch.Tensor):
    a, b = ctx.saved_tensors
    grad_a = matmul(grad, b.t()) if ctx.needs_input_grad[0] else None
    grad_b = matmul(a.t().contiguous(), grad) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b


def _save(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


matmul.register_autograd(_backward, setup_context=_save)

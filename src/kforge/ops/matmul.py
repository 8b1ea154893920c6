"""`kforge.ops.matmul(a, b)`: C = a @ b on kforge's best bf16 GEMM for the shape.

A `torch.library` custom op: torch.compile sees one opaque node with a fake (shape-only)
implementation, and autograd uses the same op for the backward products. Our kernels
take bf16 2-D operands on a Hopper GPU with N and K multiples of 8 (TMA's 16-byte rows);
b may be K x N row-major or the transpose of an N x K row-major tensor (a linear layer's
weight, `w.t()`), which the kernel reads as it lies. Anything else goes to torch.matmul.

Which kernel: this GPU's dispatch table where it holds the shape (`kforge tune gemm` writes it
from timings against cuBLAS; where none of ours was faster it says cuBLAS, and the op calls
torch.matmul), else `best_kernel`'s rules below.
"""

from __future__ import annotations

import functools

import torch

from kforge.device import sm_count


def best_kernel(m: int, n: int, k: int, sms: int = 132) -> tuple[int, dict[str, int]]:
    """Which rung and variant for an M x N x K product on `sms` SMs, from H100 device time
    against cuBLAS in the same run (scripts/gemm_bf16_variants.py; docs/worklogs/gemm-bf16.md),
    with rung 4's epilogue under the next tile's k-loop:

    - 128 x 256 tiles leaving more than half the SMs idle (skinny M, 1024^3): rung 4's split-K
      variant cuts each 128 x 128 tile's K loop across the idle SMs.
    - 128 x 192 tiles filling the SMs at least 15% better than 128 x 256 (by the share of the
      last wave's SMs busy): rung 4 on 128 x 192 tiles, cuBLAS's own width at these shapes
      (`gemm_bf16_variants.py narrow`): 512 x 6144 x 4096 1.005x
      cuBLAS against rung 6's 0.775x; 1024 x 6144 x 4096 1.017x against 0.948x; 768 x 4096 x 4096
      1.006x against 0.774x; 8192 x 768 x 3072 1.010x against 0.948x; 512 x 10240 x 8192 0.869x
      against 0.801x.
    - 128 x 256 tiles filling their last wave less than 3/4: rung 6, whose 128 x 128 tiles
      fill it better (8192 x 768 x 3072, 1.45 waves: 0.95x cuBLAS against rung 4's 0.80x;
      8192 x 768 x 768: 1.04x against 0.89x).
    - Wide outputs over a short K (N >= 32768, K <= 1024: an LM head): rung 5, whose 2-CTA
      clusters share each B panel (8192 x 50304 x 768: 1.065x against rung 4's 1.045x, two runs).
    - Otherwise rung 4, the 128 x 256 cooperative kernel: 1.006-1.009x at 4096^3, 1.03x at
      8192^3, 0.98-1.02x over the M = 4096 Llama-3 projections, where rung 5 is no faster
      (0.99-1.02x). At short K rung 4 also wins (12608 x 3072 x 1024: 1.08x against rung 6's
      1.01x), except 8192 x 2304 x 768 (1.03x against 1.07x)."""
    from kforge.kernels.gemm_bf16 import NARROW_TILE, SPLIT_K_VARIANT, narrow_tile_fills_better, wave_fill

    tiles = -(-m // 128) * -(-n // 256)
    if 2 * tiles <= sms:
        return 4, dict(SPLIT_K_VARIANT)
    if narrow_tile_fills_better(m, n, sms):
        return 4, dict(NARROW_TILE)
    if wave_fill(m, n, 256, sms) < 0.75:
        return 6, {}
    if n >= 32768 and k <= 1024 and tiles >= 2 * sms:  # (a cluster pairs two row tiles)
        return 5, {}
    return 4, {}


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_properties(index).name


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

    from kforge.tune import choose

    layout = _layout(b)
    index = a.device.index
    choice = choose(a.shape[0], b.shape[1], a.shape[1], layout, _device_name(index), sm_count(index))
    if choice is None:  # the dispatch table measured cuBLAS faster here, or a few rows with no entry (kforge.tune)
        return torch.matmul(a, b)
    step, defines = choice
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

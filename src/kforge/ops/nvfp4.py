"""`kforge.ops.nvfp4_batched_gemv(a, a_scales, a_gs, b, b_scales, b_gs)`: c = dequant(a) @ dequant(b)^T
per batch, [L, M, 1] fp16, on kforge's NVFP4 GEMV (`kforge.kernels.quant.nvfp4_gemv`).

a [L, M, K // 2] uint8 (E2M1 codes, two a byte), a_scales [L, M, K // 16] float8_e4m3fn and
a_gs a one-element fp32 tensor, as `formats.quantize_nvfp4` returns them; b the same with
M = 1. Sums in fp32, c rounded once to fp16. Minimum HBM bytes: both operands' codes and
scales once and c (`nvfp4_gemv_min_bytes`): the op is judged by bandwidth.

A `torch.library` custom op (inference only): torch.compile sees one opaque node. The kernel
runs for CUDA tensors on Hopper whose rows are contiguous (and start at multiples of 4
bytes, as fresh tensors' do); anything else, the CPU included, dequantizes with PyTorch
and multiplies (`nvfp4_gemv_reference`).
"""

from __future__ import annotations

import torch

from kforge.kernels.quant.nvfp4_gemv import nvfp4_gemv_reference
from kforge.ops.gemv import require


def ours_can_run(a: torch.Tensor, a_scales: torch.Tensor, a_gs: torch.Tensor, b: torch.Tensor,
                 b_scales: torch.Tensor, b_gs: torch.Tensor) -> bool:
    """Whether our kernel takes these tensors (else the op runs `nvfp4_gemv_reference`)."""
    if not (a.is_cuda and torch.cuda.get_device_capability(a.device) >= (9, 0)):
        return False
    from kforge.kernels.quant.nvfp4_gemv import check_nvfp4_gemv_inputs

    try:
        check_nvfp4_gemv_inputs(a, a_scales, a_gs, b, b_scales, b_gs)
    except ValueError:
        return False
    return True


def _check_shapes(a: torch.Tensor, a_scales: torch.Tensor, a_gs: torch.Tensor, b: torch.Tensor,
                  b_scales: torch.Tensor, b_gs: torch.Tensor, check=require) -> None:
    check(a.dim() == 3 and a_scales.dim() == 3 and b.dim() == 3 and b_scales.dim() == 3,
          lambda: f"kforge::nvfp4_batched_gemv takes 3-D a, a_scales, b, b_scales; got {tuple(a.shape)}, "
                  f"{tuple(a_scales.shape)}, {tuple(b.shape)}, {tuple(b_scales.shape)}")
    batches, m, half_k = a.shape
    check(tuple(b.shape) == (batches, 1, half_k),
          lambda: f"b must be (L, 1, K // 2) = {(batches, 1, half_k)}, got {tuple(b.shape)}")
    check(half_k % 8 == 0,
          lambda: f"K = {2 * half_k} must be a multiple of the NVFP4 block, 16")
    check(tuple(a_scales.shape) == (batches, m, half_k // 8) and tuple(b_scales.shape) == (batches, 1, half_k // 8),
          lambda: f"scales must be (L, M, K // 16) and (L, 1, K // 16); got {tuple(a_scales.shape)}, "
                  f"{tuple(b_scales.shape)}")
    check(a_gs.numel() == 1 and b_gs.numel() == 1,
          lambda: f"a_gs and b_gs must have one element, got shapes {tuple(a_gs.shape)}, {tuple(b_gs.shape)}")


@torch.library.custom_op("kforge::nvfp4_batched_gemv", mutates_args=())
def nvfp4_batched_gemv(a: torch.Tensor, a_scales: torch.Tensor, a_gs: torch.Tensor, b: torch.Tensor,
                       b_scales: torch.Tensor, b_gs: torch.Tensor) -> torch.Tensor:
    _check_shapes(a, a_scales, a_gs, b, b_scales, b_gs)
    if not ours_can_run(a, a_scales, a_gs, b, b_scales, b_gs):
        return nvfp4_gemv_reference(a, a_scales, a_gs, b, b_scales, b_gs)
    from kforge.kernels.quant.nvfp4_gemv import launch_nvfp4_gemv

    return launch_nvfp4_gemv(a, a_scales, a_gs, b, b_scales, b_gs, None)  # inputs checked by ours_can_run


@nvfp4_batched_gemv.register_fake
def _(a: torch.Tensor, a_scales: torch.Tensor, a_gs: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
      b_gs: torch.Tensor) -> torch.Tensor:
    _check_shapes(a, a_scales, a_gs, b, b_scales, b_gs, torch._check_value)  # symbolic shapes: a check, not a guard
    return a.new_empty((a.shape[0], a.shape[1], 1), dtype=torch.float16)

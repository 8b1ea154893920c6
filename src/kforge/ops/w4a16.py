"""`kforge.ops.w4a16_matmul(x, qweight, scales, group=128)`: y = x @ dequantize_int4(qweight, scales).T
for 1 to 32 token rows, the 4-bit weight dequantized in registers (`kforge.kernels.quant.w4a16`).

x is (K,) or (M, K) bf16 with M <= 32; qweight (N, K // 2) uint8 and scales (N, K // group)
bf16 are what `formats.quantize_int4(w, group)` returns for nn.Linear's weight w (N, K); y
is (N,) or (M, N) bf16, summed in fp32 (each q * scale exact, where eager rounds it to bf16
first: they differ by less than y's own rounding). Minimum HBM bytes: the packed weight
and scales once, x and y (`w4a16_min_bytes`): the op is judged by bandwidth.

A `torch.library` custom op (inference only: no autograd formula): torch.compile sees one
opaque node. The kernels run for CUDA tensors on Hopper (x and scales are made contiguous,
they are small; qweight's rows must start at multiples of 4 bytes, as a fresh tensor's
do); anything else, the CPU included, dequantizes with PyTorch and calls F.linear.
"""

from __future__ import annotations

import torch

from kforge.kernels.quant.w4a16 import MAX_BATCH, w4a16_reference
from kforge.ops.gemv import require


def ours_can_run(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group: int) -> bool:
    """Whether our kernels take these tensors (else the op runs `w4a16_reference`)."""
    if not (x.is_cuda and torch.cuda.get_device_capability(x.device) >= (9, 0)):
        return False
    from kforge.kernels.quant.w4a16 import check_w4a16_inputs

    try:
        check_w4a16_inputs(x, qweight, scales, group)
    except ValueError:
        return False
    return True


def _check_shapes(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group: int, check=require) -> None:
    check(x.dim() in (1, 2) and qweight.dim() == 2 and scales.dim() == 2,
          lambda: f"kforge::w4a16_matmul takes x (K,) or (M, K), qweight (N, K // 2), scales (N, K // group); got "
                  f"{tuple(x.shape)}, {tuple(qweight.shape)}, {tuple(scales.shape)}")
    check(x.shape[-1] == 2 * qweight.shape[1],
          lambda: f"x has K = {x.shape[-1]} but qweight {tuple(qweight.shape)} holds K = {2 * qweight.shape[1]}")
    check(group > 0 and x.shape[-1] % group == 0,
          lambda: f"K = {x.shape[-1]} is not a multiple of the group ({group})")
    check(scales.shape[0] == qweight.shape[0] and scales.shape[1] * group == x.shape[-1],
          lambda: f"scales must be (N, K // group) = ({qweight.shape[0]}, {x.shape[-1] // group}), got "
                  f"{tuple(scales.shape)}")
    check(x.dim() == 1 or x.shape[0] <= MAX_BATCH,
          lambda: f"kforge::w4a16_matmul takes at most {MAX_BATCH} rows, got {x.shape[0]}: dequantize and use a GEMM "
                  f"for more")


@torch.library.custom_op("kforge::w4a16_matmul", mutates_args=())
def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group: int = 128) -> torch.Tensor:
    _check_shapes(x, qweight, scales, group)
    x, scales = x.contiguous(), scales.contiguous()
    if not ours_can_run(x, qweight, scales, group):
        return w4a16_reference(x, qweight, scales, group)
    from kforge.kernels.quant.w4a16 import launch_w4a16

    y = launch_w4a16(x.view(-1, x.shape[-1]), qweight, scales, group, None)  # inputs checked by ours_can_run
    return y.view(-1) if x.dim() == 1 else y


@w4a16_matmul.register_fake
def _(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group: int = 128) -> torch.Tensor:
    _check_shapes(x, qweight, scales, group, torch._check_value)  # symbolic shapes: a check, not a guard
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


def _check_residual(x: torch.Tensor, qweight: torch.Tensor, residual: torch.Tensor, check=require) -> None:
    want = (*x.shape[:-1], qweight.shape[0])
    check(tuple(residual.shape) == want and residual.dtype == torch.bfloat16 and residual.device == x.device,
          lambda: f"residual must be a torch.bfloat16 tensor of y's shape {want} on {x.device}, got "
                  f"{residual.dtype} {tuple(residual.shape)} on {residual.device}")


@torch.library.custom_op("kforge::w4a16_matmul_residual", mutates_args=())
def w4a16_matmul_residual(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, residual: torch.Tensor,
                          group: int = 128) -> torch.Tensor:
    """residual + `w4a16_matmul(x, qweight, scales, group)`, the unfused pair's bits (the product
    rounded to bf16, then torch's bf16 add); for one token on the GPU the add is in the kernel's
    store (`w4a16_gemv.cu` or `w4a16_mma.cu` built RESIDUAL), one launch less a decode layer."""
    _check_shapes(x, qweight, scales, group)
    _check_residual(x, qweight, residual)
    x, scales = x.contiguous(), scales.contiguous()
    if not ours_can_run(x, qweight, scales, group):
        return residual + w4a16_reference(x, qweight, scales, group)
    from kforge.kernels.quant.w4a16 import launch_w4a16

    y = launch_w4a16(x.view(-1, x.shape[-1]), qweight, scales, group, None, residual.view(-1, qweight.shape[0]))
    return y.view(-1) if x.dim() == 1 else y


@w4a16_matmul_residual.register_fake
def _(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, residual: torch.Tensor,
      group: int = 128) -> torch.Tensor:
    _check_shapes(x, qweight, scales, group, torch._check_value)
    _check_residual(x, qweight, residual, torch._check_value)
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))

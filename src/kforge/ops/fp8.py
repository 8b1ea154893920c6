"""`kforge.ops.fp8.fp8_gemm(a, b, a_scale, b_scale, scaling="block")`: C = dequant(a) @ dequant(b)^T
in bf16, from fp8 e4m3 operands, on kforge's kernels (`kforge.kernels.quant.fp8_gemm`: Triton, and
for block scaling the CUDA kernel `fp8_block_gemm`). `fp8_gemv(x, q, scale)` below: the decode
GEMV against a block-scaled fp8 weight, x in bf16.

a [M, K] and b [N, K] as a linear layer keeps them (activations, weight: out x in); fp32
scales per `scaling`: "tensor" (two 0-d scales), "row" (a_scale [M, 1], b_scale [N, 1]) or
"block" (DeepGEMM's: a_scale [M, K/128] per 1 x 128 tile, b_scale [ceil(N/128), K/128] per
128 x 128 block). fp32 accumulation, promoted out of the tensor cores every 128 K.

A `torch.library` custom op (`kforge::fp8_gemm`, inference only) with a fake implementation,
so torch.compile sees one opaque node. The kernel runs on a Hopper GPU for contiguous,
16-byte aligned a and b with K a multiple of 16; anything else, the CPU included, runs the
reference: both operands dequantized (formats.dequantize_fp8) and multiplied in fp32,
rounded once to bf16.
"""

from __future__ import annotations

import torch

from kforge.kernels.quant.fp8_gemm import (SCALE_BLOCK, check_fp8_gemm_inputs, check_fp8_gemm_operands,
                                           fp8_gemm_reference)
from kforge.kernels.quant.fp8_gemv import MAX_BATCH as GEMV_MAX_ROWS
from kforge.kernels.quant.fp8_gemv import check_fp8_gemv_operands, check_fp8_residual, fp8_gemv_reference


def ours_can_run(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
                 scaling: str) -> bool:
    """Whether our kernel takes these tensors (else the op runs the reference)."""
    if not a.is_cuda:
        return False
    try:
        check_fp8_gemm_inputs(a, b, a_scale, b_scale, scaling)
    except ValueError:
        return False
    return True


@torch.library.custom_op("kforge::fp8_gemm", mutates_args=())
def _fp8_gemm(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
              scaling: str) -> torch.Tensor:
    check_fp8_gemm_operands(a, b, a_scale, b_scale, scaling)
    if not ours_can_run(a, b, a_scale, b_scale, scaling):
        return fp8_gemm_reference(a, b, a_scale, b_scale, scaling)
    from kforge.kernels.quant.fp8_gemm import fp8_gemm as launch

    return launch(a, b, a_scale, b_scale, scaling)


@_fp8_gemm.register_fake
def _(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor, scaling: str) -> torch.Tensor:
    torch._check_value(a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[1],
                       lambda: f"kforge::fp8_gemm takes a [M, K] and b [N, K], got {tuple(a.shape)} and "
                               f"{tuple(b.shape)}")
    torch._check_value(scaling in ("tensor", "row", "block"), lambda: f"unknown scaling {scaling!r}")
    if scaling == "block":
        torch._check_value(a.shape[1] % SCALE_BLOCK == 0, lambda: f"block scaling needs K % {SCALE_BLOCK} == 0")
    return a.new_empty((a.shape[0], b.shape[0]), dtype=torch.bfloat16)


def fp8_gemm(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
             scaling: str = "block") -> torch.Tensor:
    """bf16 [M, N] = (a * a_scale) @ (b * b_scale)^T for fp8 e4m3 a [M, K], b [N, K] (see above)."""
    check_fp8_gemm_operands(a, b, a_scale, b_scale, scaling)
    return _fp8_gemm(a, b, a_scale, b_scale, scaling)


# --- the decode GEMV: x bf16, W fp8 in 128 x 128 blocks ------------------------------------------------

def gemv_can_run(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether our kernels take these operands (already through `check_fp8_gemv_operands`): a GPU
    with fp8 conversions (sm_89 on; Triton's e4m3 needs it too), rows contiguous along K and 32-bit
    offsets (`check_fp8_gemv_inputs`' remaining conditions); else the op runs the reference."""
    from kforge.kernels.quant.fp8_gemv import capability

    return (x.is_cuda and capability(x.device.index) >= (8, 9) and x.stride(-1) == 1 and q.stride(1) == 1
            and scale.stride(1) == 1 and q.numel() < 2**31)


@torch.library.custom_op("kforge::fp8_gemv", mutates_args=())
def _fp8_gemv(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    check_fp8_gemv_operands(x, q, scale)
    x = x.contiguous()  # (at most 16 rows: small)
    if not gemv_can_run(x, q, scale):
        return fp8_gemv_reference(x, q, scale)
    from kforge.kernels.quant.fp8_gemv import launch_fp8_gemv

    y = launch_fp8_gemv(x.view(-1, x.shape[-1]), q, scale, None)
    return y.view(-1) if x.dim() == 1 else y


@_fp8_gemv.register_fake
def _(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    torch._check_value(x.dim() in (1, 2) and q.dim() == 2 and x.shape[-1] == q.shape[1],
                       lambda: f"kforge::fp8_gemv takes x (K,) or (M, K) and q (N, K), got {tuple(x.shape)} and "
                               f"{tuple(q.shape)}")
    torch._check_value(q.shape[1] % SCALE_BLOCK == 0, lambda: f"fp8_gemv needs K % {SCALE_BLOCK} == 0")
    torch._check_value(x.dim() == 1 or x.shape[0] <= GEMV_MAX_ROWS,
                       lambda: f"fp8_gemv takes at most {GEMV_MAX_ROWS} rows, got {x.shape[0]}")
    return x.new_empty((*x.shape[:-1], q.shape[0]), dtype=torch.bfloat16)


def fp8_gemv(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """bf16 y = x @ (q * scale)^T for x (K,) or (M <= 16, K) bf16, q (N, K) e4m3 and scale
    (ceil(N/128), K/128) fp32: `quantize_fp8(w, "block", block=(128, 128))`'s weight. fp32 sums, x
    not quantized (`kforge.kernels.quant.fp8_gemv`). One-line ValueError on bad dtypes or shapes."""
    check_fp8_gemv_operands(x, q, scale)
    return _fp8_gemv(x, q, scale)


@torch.library.custom_op("kforge::fp8_gemv_residual", mutates_args=())
def _fp8_gemv_residual(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    check_fp8_gemv_operands(x, q, scale)
    check_fp8_residual((*x.shape[:-1], q.shape[0]), x, residual)
    x = x.contiguous()
    if not gemv_can_run(x, q, scale):
        return residual + fp8_gemv_reference(x, q, scale)
    from kforge.kernels.quant.fp8_gemv import launch_fp8_gemv

    y = launch_fp8_gemv(x.view(-1, x.shape[-1]), q, scale, None, residual.view(-1, q.shape[0]))
    return y.view(-1) if x.dim() == 1 else y


@_fp8_gemv_residual.register_fake
def _(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    torch._check_value(residual.shape == (*x.shape[:-1], q.shape[0]),
                       lambda: f"kforge::fp8_gemv_residual: residual {tuple(residual.shape)} is not y's shape")
    return x.new_empty((*x.shape[:-1], q.shape[0]), dtype=torch.bfloat16)


def fp8_gemv_residual(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + `fp8_gemv(x, q, scale)`, the add in the GEMV's store on the GPU (one launch less
    a decode layer) and the pair's bits: the product rounded to bf16, then torch's bf16 add."""
    check_fp8_gemv_operands(x, q, scale)
    check_fp8_residual((*x.shape[:-1], q.shape[0]), x, residual)
    return _fp8_gemv_residual(x, q, scale, residual)

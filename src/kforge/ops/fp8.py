"""`kforge.ops.fp8.fp8_gemm(a, b, a_scale, b_scale, scaling="block")`: C = dequant(a) @ dequant(b)^T
in bf16, from fp8 e4m3 operands, on kforge's kernels (`kforge.kernels.quant.fp8_gemm`: Triton, and
for block scaling the CUDA kernel `fp8_block_gemm`).

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

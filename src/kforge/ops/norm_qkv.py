"""`kforge.ops.rms_norm_qkv(x, norm_weight, qkv_weight, eps=1e-6)`: RMSNorm fused into the QKV
projection, y = rmsnorm(x; norm_weight, eps) @ qkv_weight.T, the normed rows never in HBM.

x is (..., K), norm_weight (K,), qkv_weight (N, K) as nn.Linear stores it; y is (..., N)
in x's dtype. The norm's statistic and every sum are fp32. Up to 16 rows run the decode
GEMV (one kernel, x * norm_weight rounded to x's dtype before the products, as eager rounds
the normed rows). More rows run a prefill GEMM, one kernel that square-sums x and multiplies
it by norm_weight as it streams it, 1/rms applied per output row at the end: in bf16 on
Hopper the GEMM ladder's rung 4 (NORM_A), otherwise a Triton GEMM; except bf16 decode batches
whose GEMM tiles would fill under half the SMs, which run the norm, then cuBLAS (the normed
rows then do pass through HBM: `kernels/serving/norm_qkv.py`, `fused_fills_half_the_sms`).
Minimum HBM bytes of the fused paths: x, the weights and y once (`rms_norm_qkv_min_bytes`).

A `torch.library` custom op (inference only: no autograd formula). The kernels run for
fp16/bf16/fp32 CUDA tensors on Hopper with contiguous rows (x is made contiguous if it is
not; over 16 rows, K a multiple of 16 bytes for TMA); anything else, the CPU included,
runs the eager pair F.rms_norm then F.linear (`rms_norm_qkv_reference`).
"""

from __future__ import annotations

import torch

from kforge.kernels.serving.norm_qkv import rms_norm_qkv_reference
from kforge.ops.gemv import require


def ours_can_run(x: torch.Tensor, norm_weight: torch.Tensor, qkv_weight: torch.Tensor, eps: float) -> bool:
    """Whether our kernels take these tensors (else the op runs the eager pair)."""
    if not (x.is_cuda and torch.cuda.get_device_capability(x.device) >= (9, 0)):
        return False
    from kforge.kernels.serving.norm_qkv import check_norm_qkv_inputs

    try:
        check_norm_qkv_inputs(x, norm_weight, qkv_weight, eps)
    except ValueError:
        return False
    return True


def _check_shapes(x: torch.Tensor, norm_weight: torch.Tensor, qkv_weight: torch.Tensor,
                  check=require) -> None:
    check(x.dim() >= 1 and norm_weight.dim() == 1 and qkv_weight.dim() == 2,
          lambda: f"kforge::rms_norm_qkv takes x (..., K), norm_weight (K,), qkv_weight (N, K); got {tuple(x.shape)}, "
                  f"{tuple(norm_weight.shape)}, {tuple(qkv_weight.shape)}")
    check(x.shape[-1] == norm_weight.shape[0] and x.shape[-1] == qkv_weight.shape[1],
          lambda: f"K differs: x {tuple(x.shape)}, norm_weight {tuple(norm_weight.shape)}, qkv_weight "
                  f"{tuple(qkv_weight.shape)}")


@torch.library.custom_op("kforge::rms_norm_qkv", mutates_args=())
def rms_norm_qkv(x: torch.Tensor, norm_weight: torch.Tensor, qkv_weight: torch.Tensor,
                 eps: float = 1e-6) -> torch.Tensor:
    _check_shapes(x, norm_weight, qkv_weight)
    x = x.contiguous()
    if not ours_can_run(x, norm_weight, qkv_weight, eps):
        return rms_norm_qkv_reference(x, norm_weight, qkv_weight, eps)
    from kforge.kernels.serving.norm_qkv import launch_rms_norm_qkv

    return launch_rms_norm_qkv(x, norm_weight, qkv_weight, eps, None)  # inputs checked by ours_can_run


@rms_norm_qkv.register_fake
def _(x: torch.Tensor, norm_weight: torch.Tensor, qkv_weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    _check_shapes(x, norm_weight, qkv_weight, torch._check_value)  # symbolic shapes: a check, not a guard
    return x.new_empty((*x.shape[:-1], qkv_weight.shape[0]))

"""y = act(x W^T + b) [+ r]: a linear layer with its epilogue fused, on the best kernel kforge has.

On a Hopper GPU, for bf16 with N and K multiples of 8 and 16-byte aligned rows, the CUDA GEMM
rungs with the epilogue compiled in (`gemm_bf16.gemm`'s bias / activation / residual: the
math on the fp32 accumulator, one rounding). Anything else (fp16, another GPU, the CPU
under Triton's interpreter) takes the Triton kernel of `gemm_epilogue.py`, the same math.

Which rung, from H100 device time (`scripts/fused_linear_bench.py`, against eager's F.linear
then a second pass):

    with an activation or a residual   rung 4: GELU layers 1.03x (16384 x 4096 x 4096) to
                                       1.22x (GPT-2's tanh-GELU c_fc) eager; the ping-pong
                                       rung 6 measured 0.94-1.12x there
    bias only                          `kforge.ops.matmul.best_kernel`'s pick for the shape
                                       (rung 4 at short K, its epilogue running under the
                                       next tile's k-loop)

The residual epilogue reads its operand with plain loads inside the epilogue, which the
mainloop does not hide: 0.73-0.95x eager where K is short (GPT-2's 768 x 768 projection).
Where a norm follows, the better fusion is the norm's own residual add (`norms.py`): the
projection keeps only its bias, and the add rides on a pass the norm makes anyway.
"""

from __future__ import annotations

import functools

import torch

from kforge.device import sm_count
from kforge.kernels import gemm_bf16
from kforge.kernels.fused.gemm_epilogue import check_gemm_epilogue_inputs, gemm_epilogue
from kforge.ops.matmul import best_kernel


@functools.cache
def _hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def _cuda_rungs_fit(x: torch.Tensor, weight: torch.Tensor, bias, residual) -> bool:
    tensors = [t for t in (x, weight, bias, residual) if t is not None]
    return (x.is_cuda and _hopper(x.device.index) and all(t.dtype == torch.bfloat16 for t in tensors)
            and all(t.is_contiguous() for t in tensors) and x.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0
            and all(t.data_ptr() % 4 == 0 for t in (bias, residual) if t is not None))


def fused_linear(x: torch.Tensor, weight: torch.Tensor, *, bias: torch.Tensor | None = None,
                 activation: str = "none", residual: torch.Tensor | None = None) -> torch.Tensor:
    """act(x @ weight.T + bias) + residual for x (..., K), weight (N, K) as nn.Linear keeps it.

    activation: "none", "gelu" (erf), "gelu_tanh" or "silu"; residual: (..., N) like the output.
    Returns (..., N) in x's dtype. Raises ValueError on inputs neither path can take."""
    check_gemm_epilogue_inputs(x, weight, bias, activation, residual, None)
    if not _cuda_rungs_fit(x, weight, bias, residual):
        return gemm_epilogue(x, weight, bias=bias, activation=activation, residual=residual)

    n, k = weight.shape
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    step, defines = best_kernel(m, n, k, sm_count(x.device))
    if (activation != "none" or residual is not None) and step != 4:
        step, defines = 4, {}
    out = gemm_bf16.gemm(rows, weight, step, b_layout="nk", defines=defines, bias=bias, activation=activation,
                         residual=residual.reshape(m, n) if residual is not None else None)
    return out.view(*x.shape[:-1], n)

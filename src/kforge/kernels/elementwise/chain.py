"""A chain of elementwise ops fused into one Triton kernel: a gated residual branch,

    out = residual + sigmoid(gate) * gelu_tanh(x),
    gelu_tanh(x) = x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) = x sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3)),

(the second form because 1 + tanh(u) = 2 sigmoid(2u): one exp instead of tanh's two).
All math in fp32, the result rounded once to the inputs' dtype.

Eager PyTorch runs it as four kernels, each a pass over memory: gelu (read 1, write 1),
sigmoid (read 1, write 1), the product (read 2, write 1), the sum (read 2, write 1): ten
tensor-sized accesses, and it rounds to bf16 after each. Fused: three reads, one write.
At 8192 x 8192 bf16: 537 MB against eager's 1.34 GB, ~0.18 ms at ~3 TB/s.

Choices, for the H100: the tensors are flat streams, 2048 elements a program over 8
warps: 8 elements a thread, one 16-byte vector per bf16 stream (three loads, one store
in flight a thread), ~30 registers, many programs an SM. Offsets are 64-bit. A few dozen
FLOPs an element (two exps) are far below what the SMs can do at this byte rate.
Expected (not measured here): ~90% of copy bandwidth, as kforge's SwiGLU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048
NUM_WARPS = 8
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
GELU_SCALE = tl.constexpr(2 * 0.7978845608028654)  # 2 sqrt(2/pi)


@triton.jit
def gated_gelu_residual_kernel(x_ptr, gate_ptr, residual_ptr, out_ptr, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < numel
    x = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    residual = tl.load(residual_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    gelu = x * tl.sigmoid((x + 0.044715 * x * x * x) * GELU_SCALE)
    tl.store(out_ptr + offs, (residual + tl.sigmoid(gate) * gelu).to(out_ptr.dtype.element_ty), mask=inside)


def gated_gelu_residual(x: torch.Tensor, gate: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + sigmoid(gate) * gelu(x, approximate="tanh") in one pass; three tensors of one
    shape and dtype (fp16/bf16/fp32); a new contiguous tensor of that shape."""
    for name, t in (("x", x), ("gate", gate), ("residual", residual)):
        if not isinstance(t, torch.Tensor) or t.dtype not in DTYPES:
            raise ValueError(f"{name} must be a float16, bfloat16 or float32 tensor, got "
                             f"{getattr(t, 'dtype', type(t).__name__)}")
    if not x.shape == gate.shape == residual.shape or not x.dtype == gate.dtype == residual.dtype:
        raise ValueError(f"x, gate and residual must share shape and dtype, got {tuple(x.shape)} {x.dtype}, "
                         f"{tuple(gate.shape)} {gate.dtype}, {tuple(residual.shape)} {residual.dtype}")
    if not x.device == gate.device == residual.device:
        raise ValueError(f"x, gate and residual are on different devices: {x.device}, {gate.device}, "
                         f"{residual.device}")
    x, gate, residual = (t.contiguous() for t in (x, gate, residual))
    out = torch.empty_like(x)
    if x.numel():
        gated_gelu_residual_kernel[(triton.cdiv(x.numel(), BLOCK),)](x, gate, residual, out, x.numel(), BLOCK=BLOCK,
                                                                     num_warps=NUM_WARPS)
    return out


def gated_gelu_residual_reference(x: torch.Tensor, gate: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """The chain in float64, for checking."""
    x, gate, residual = x.double(), gate.double(), residual.double()
    return residual + torch.sigmoid(gate) * torch.nn.functional.gelu(x, approximate="tanh")


def gated_gelu_residual_min_bytes(numel: int, dtype: torch.dtype) -> int:
    """HBM bytes: three inputs read once, the output written once."""
    return 4 * numel * torch.empty((), dtype=dtype).element_size()

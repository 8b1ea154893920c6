"""`kforge.ops.rope_(q, k, positions, *, max_position, base=10000.0, rotary_dim=None,
interleaved=False)`: rotary position embedding applied in place to q and k in one launch
of kforge's Triton kernel (`kforge.kernels.serving.rope`).

q is (tokens, q_heads, head_dim) and k (tokens, kv_heads, head_dim) with positions
(tokens,), or both (batch, seq, heads, head_dim) with positions (batch, seq); int32 or
int64 positions in [0, max_position), in any order, repeats allowed. The first
rotary_dim dims (all of head_dim by default) are rotated, half-split (GPT-NeoX / Hugging
Face Llama) or, with `interleaved`, in adjacent pairs (GPT-J / Meta's Llama); the rest
are untouched. q and k may be strided views (e.g. of a fused QKV output) with a
contiguous last dimension. Returns (q, k), the same tensors.

cos/sin come from `kforge.kernels.serving.rope.cos_sin_table`, built once per
(max_position, rotary_dim, base, device) and cached; the op looks it up on each call
(an lru_cache hit), inside the op, so compiled graphs never rebuild or capture it.

A `torch.library` custom op (`kforge::rope`, mutates q and k) with a fake
implementation, so torch.compile sees one opaque node. Inference only: no autograd
formula is registered. The kernel runs for fp16/bf16/fp32 CUDA tensors; anything else
(CPU tensors, float64) runs the eager reference in PyTorch, in place as well.
"""

from __future__ import annotations

import torch

from kforge.kernels.serving.rope import KERNEL_DTYPES, check_rope_inputs, cos_sin_table, rope_reference_


def ours_can_run(q: torch.Tensor) -> bool:
    """Whether our kernel takes q and k (else the op runs the PyTorch reference)."""
    return q.is_cuda and q.dtype in KERNEL_DTYPES


@torch.library.custom_op("kforge::rope", mutates_args=("q", "k"))
def _rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, max_position: int, rotary_dim: int,
          base: float, interleaved: bool) -> None:
    cos_sin = cos_sin_table(max_position, rotary_dim, base, q.device)
    if ours_can_run(q):
        from kforge.kernels.serving.rope import apply_rope_

        apply_rope_(q, k, positions, cos_sin, interleaved=interleaved)
    else:
        rope_reference_(q, k, positions, cos_sin, interleaved=interleaved)


@_rope.register_fake
def _(q, k, positions, max_position, rotary_dim, base, interleaved):
    return None


def rope_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, *, max_position: int, base: float = 10000.0,
          rotary_dim: int | None = None, interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k in place by their tokens' positions; returns (q, k)."""
    rotary_dim = q.shape[-1] if rotary_dim is None else int(rotary_dim)
    check_rope_inputs(q, k, positions, rotary_dim)
    if max_position < 1 or not base > 0:
        raise ValueError(f"max_position must be >= 1 and base > 0, got {max_position} and {base}")
    _rope(q, k, positions, int(max_position), rotary_dim, float(base), bool(interleaved))
    return q, k

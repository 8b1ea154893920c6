"""Per-head RMSNorm of q and k (QK-norm, as Qwen3, OLMo 2 and Gemma 3 do) followed by rotary
position embedding, both tensors in one launch, out of place, in Triton.

The math. For one head's row x of D values, its norm weight g (D,) and its token's position p:

    n = x / sqrt(mean(x^2) + eps) * g                     (skipped without weights: plain RoPE)
    n1, n2 = n[:D/2], n[D/2:]                             (half-split pairs: GPT-NeoX / HF Llama)
    out = [n1 cos(p theta) - n2 sin(p theta),  n2 cos(p theta) + n1 sin(p theta)]

with theta_i = base^(-2i/D) and cos/sin read from `serving.rope.cos_sin_table` (float64
angles rounded to fp32 once, cached per (max_position, D, base, device)).

What fusing saves. Eager runs the norm as ~7 kernels per tensor (upcast, square, mean,
rsqrt, scale, downcast, weight) and rotate_half RoPE as ~6 more (two slices and a cat
build rotate_half, then x cos + rotate_half(x) sin), each reading and writing the whole
of q or k: ~26 bytes and more per bf16 element. Here each element is read once and
written once (4 bytes), the statistic and the rotation in fp32 registers, one rounding.

Choices, each for the H100 (those of `serving/rope.py`, whose table this shares):
- Grid (tokens, q head blocks + k head blocks): a program takes HEADS_BLOCK heads of one
  token of q or of k, ~2048 elements over 4 warps, and loads its token's cos/sin once.
  Each head's two halves load as two contiguous runs (16-byte vectors at D = 128).
- The norm needs a whole head row: D <= 512 keeps it in registers.
- q and k are read through their strides (views of a fused QKV output need no copy);
  outputs are new contiguous tensors of q's and k's shapes, so a caller's inputs are
  never modified.
- A position outside [0, max_position) writes NaN into its token, never reading outside
  the table (the same convention as serving/rope.py).

Expected on the H100 (not measured here): ~85-90% of copy bandwidth on 2 x (Hq + Hk) x D
x E bytes per token, plus a table row per token (mostly L2 hits).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kforge.kernels.serving.rope import cos_sin_row

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 512
TILE = 2048


@triton.jit
def _norm_rotate_store(src, dst, heads, n_heads, w_ptr, cos, sin, half, eps,
                       NORM: tl.constexpr, HALF_BLOCK: tl.constexpr):
    """Heads `heads` of one token: src/dst point at the token's first head, heads as (rows, stride)."""
    cols = tl.arange(0, HALF_BLOCK)
    mask = (heads < n_heads)[:, None] & (cols < half)[None, :]
    x1 = tl.load(src + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if NORM:
        rstd = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * half) + eps)[:, None]
        w1 = tl.load(w_ptr + cols, mask=cols < half, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + half + cols, mask=cols < half, other=0.0).to(tl.float32)[None, :]
        x1 = x1 * rstd * w1
        x2 = x2 * rstd * w2
    tl.store(dst + cols[None, :], (x1 * cos - x2 * sin).to(dst.dtype.element_ty), mask=mask)
    tl.store(dst + half + cols[None, :], (x2 * cos + x1 * sin).to(dst.dtype.element_ty), mask=mask)


@triton.jit
def qk_norm_rope_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, qw_ptr, kw_ptr, pos_ptr, table_ptr,
                        n_q_heads, n_k_heads, seq_len, q_batch_stride, q_seq_stride, q_head_stride,
                        k_batch_stride, k_seq_stride, k_head_stride, max_position, half, eps,
                        NORM: tl.constexpr, HEADS_BLOCK: tl.constexpr, HALF_BLOCK: tl.constexpr):
    token = tl.program_id(0)
    head_block = tl.program_id(1)
    batch = (token // seq_len).to(tl.int64)
    seq = (token % seq_len).to(tl.int64)
    position = tl.load(pos_ptr + token).to(tl.int64)
    cos, sin = cos_sin_row(table_ptr, position, max_position, half, HALF_BLOCK)
    q_blocks = tl.cdiv(n_q_heads, HEADS_BLOCK)
    head_dim = 2 * half
    if head_block < q_blocks:
        heads = head_block * HEADS_BLOCK + tl.arange(0, HEADS_BLOCK)
        src = q_ptr + batch * q_batch_stride + seq * q_seq_stride + heads[:, None] * q_head_stride
        dst = q_out_ptr + token.to(tl.int64) * n_q_heads * head_dim + heads[:, None] * head_dim
        _norm_rotate_store(src, dst, heads, n_q_heads, qw_ptr, cos, sin, half, eps, NORM, HALF_BLOCK)
    else:
        heads = (head_block - q_blocks) * HEADS_BLOCK + tl.arange(0, HEADS_BLOCK)
        src = k_ptr + batch * k_batch_stride + seq * k_seq_stride + heads[:, None] * k_head_stride
        dst = k_out_ptr + token.to(tl.int64) * n_k_heads * head_dim + heads[:, None] * head_dim
        _norm_rotate_store(src, dst, heads, n_k_heads, kw_ptr, cos, sin, half, eps, NORM, HALF_BLOCK)


def check_qk_norm_rope_inputs(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                              q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float) -> None:
    """Raise ValueError on anything the kernel cannot take."""
    if q.dim() not in (3, 4) or k.dim() != q.dim():
        raise ValueError(f"q and k must both be (tokens, heads, head_dim) or (batch, seq, heads, head_dim); got "
                         f"{tuple(q.shape)} and {tuple(k.shape)}")
    if k.shape[:-2] != q.shape[:-2] or positions.shape != q.shape[:-2]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and positions {tuple(positions.shape)} must share "
                         f"the leading (token) dimensions")
    dim = q.shape[-1]
    if k.shape[-1] != dim or dim % 2 or not 2 <= dim <= MAX_HEAD_DIM or 0 in (q.shape[-2], k.shape[-2]):
        raise ValueError(f"q and k need >= 1 head and one even head_dim <= {MAX_HEAD_DIM}; got {tuple(q.shape)} "
                         f"and {tuple(k.shape)}")
    if q.dtype != k.dtype or q.dtype not in KERNEL_DTYPES:
        raise ValueError(f"q and k must share one dtype of float16, bfloat16, float32; got {q.dtype} and {k.dtype}")
    if positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be int32 or int64, got {positions.dtype}")
    if cos_sin.dim() != 2 or cos_sin.shape[1] != dim or cos_sin.dtype != torch.float32:
        raise ValueError(f"cos_sin must be a (max_position, {dim}) float32 table (serving.rope.cos_sin_table), got "
                         f"{cos_sin.dtype} {tuple(cos_sin.shape)}")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("give both q_weight and k_weight (QK-norm) or neither (RoPE only)")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w is not None and (w.shape != (dim,) or w.dtype not in KERNEL_DTYPES):
            raise ValueError(f"{name} must be a float vector of head_dim = {dim}, got {w.dtype} {tuple(w.shape)}")
    tensors = [t for t in (k, positions, cos_sin, q_weight, k_weight) if t is not None]
    if any(t.device != q.device for t in tensors):
        raise ValueError(f"all tensors must be on {q.device}")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError(f"q and k need a contiguous last dimension; strides {q.stride()} and {k.stride()}")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps}")


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, *,
                 q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                 eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """(rope(rmsnorm(q) * q_weight), rope(rmsnorm(k) * k_weight)) per head, or plain RoPE without
    weights; new contiguous tensors of q's and k's shapes and dtype.

    q (tokens, Hq, D) and k (tokens, Hk, D) with positions (tokens,), or (batch, seq, heads, D)
    with positions (batch, seq); cos_sin = serving.rope.cos_sin_table(max_position, D, base)."""
    check_qk_norm_rope_inputs(q, k, positions, cos_sin, q_weight, k_weight, eps)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    tokens = positions.numel()
    if tokens == 0:
        return q_out, k_out
    if q.dim() == 3:
        seq_len, q_strides, k_strides = q.shape[0], (0, *q.stride()[:2]), (0, *k.stride()[:2])
    else:
        seq_len, q_strides, k_strides = q.shape[1], q.stride()[:3], k.stride()[:3]
    q_heads, k_heads, half = q.shape[-2], k.shape[-2], q.shape[-1] // 2
    half_block = triton.next_power_of_2(half)
    heads_block = min(max(1, TILE // (2 * half_block)), triton.next_power_of_2(max(q_heads, k_heads)))
    grid = (tokens, triton.cdiv(q_heads, heads_block) + triton.cdiv(k_heads, heads_block))
    norm = q_weight is not None
    qk_norm_rope_kernel[grid](q, k, q_out, k_out, q_weight if norm else cos_sin, k_weight if norm else cos_sin,
                              positions.reshape(-1), cos_sin.contiguous(), q_heads, k_heads, seq_len, *q_strides,
                              *k_strides, cos_sin.shape[0], half, float(eps), NORM=norm, HEADS_BLOCK=heads_block,
                              HALF_BLOCK=half_block, num_warps=4)
    return q_out, k_out


def qk_norm_rope_reference(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                           weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """One tensor's result in float64 (unrounded): x (..., heads, D), positions x.shape[:-2]."""
    x = x.double()
    if weight is not None:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    half = x.shape[-1] // 2
    row = cos_sin.double()[positions.long()][..., None, :]  # (..., 1, D): broadcast over heads
    cos, sin = row[..., :half], row[..., half:]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def qk_norm_rope_min_bytes(tokens: int, q_heads: int, k_heads: int, head_dim: int, itemsize: int = 2) -> int:
    """HBM bytes the op must move: q and k read once and written once, an int64 position per
    token, the two weights. The cos/sin rows are not counted: an op may compute them, and
    ours mostly find them in L2."""
    return 2 * tokens * (q_heads + k_heads) * head_dim * itemsize + 8 * tokens + 2 * head_dim * itemsize

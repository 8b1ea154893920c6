"""Rotary position embedding (RoPE) in Triton, applied in place to q and k in one launch.

Token t at position p rotates each pair (x1, x2) of its first `rotary_dim` dims by the
angle p * theta_i, theta_i = base^(-2i / rotary_dim), i = 0 .. rotary_dim/2 - 1:

    x1' = x1 cos(p theta_i) - x2 sin(p theta_i)
    x2' = x2 cos(p theta_i) + x1 sin(p theta_i)

Which dims pair up is the layout:
- half-split (GPT-NeoX, Llama in Hugging Face): x1 = x[i], x2 = x[i + rotary_dim/2];
- interleaved (GPT-J, Meta's original Llama): x1 = x[2i], x2 = x[2i + 1].
Dims past rotary_dim (partial rotary: GPT-NeoX's rotary_pct, GPT-J's rotary_dim = 64 of
256) are neither read nor written.

cos and sin come from a table built once per (max_position, rotary_dim, base, device):
`cos_sin_table` returns a (max_position, rotary_dim) fp32 tensor, cos(p theta_i) in the
first rotary_dim/2 columns and sin in the rest, one row per position, computed in
float64 then rounded (fp32 angles lose their low bits by position ~10^4: p theta_0 = p).
It is memoized with functools.lru_cache, keyed on the four values with the device made
explicit ("cuda" means the current one): `cos_sin_table.cache_info()` counts builds
(misses) and reuses (hits), `cos_sin_table.cache_clear()` frees the tables.

Bytes, E bytes an element: each rotated element read once and written once, 2 * tokens *
(q_heads + kv_heads) * rotary_dim * E, plus the positions and each token's table row
(rotary_dim * 4 bytes; 1/(q_heads + kv_heads) of the q/k traffic at E = 2, ~2.5% for
Llama-3-8B's 32 + 8 heads, and mostly L2 hits: the table is 4 MB at 8192 positions x 128).

Choices, each for the H100 (132 SMs, ~3 TB/s):
- Grid (tokens, q head blocks + k head blocks): a program rotates HEADS_BLOCK heads of
  one token of q, or of k; both tensors in one launch. It loads the token's cos/sin row
  once for all its heads. A tile is HEADS_BLOCK x rotary_dim ~ 2048 elements over 4 warps:
  16 elements a thread, 16-byte accesses (ld/st.v4 in the sm_90 PTX at rotary_dim 128,
  32-40 registers). Prefill (thousands of tokens x 3 programs a token at Llama-3-8B)
  keeps every SM full.
- Half-split loads the two halves as two contiguous runs; interleaved loads the pairs as
  one contiguous run and splits even/odd in registers (tl.split/tl.join), so neither
  layout makes stride-2 accesses.
- q and k are addressed through their strides (batch, seq, head; the last dim must be
  contiguous): views into a fused QKV projection output are rotated where they lie.
- A position outside [0, max_position) is the caller's bug: the kernel never reads outside
  the table, and writes NaN into that token's rotated dims so the bug shows downstream
  (checking on the host would cost a device sync per call).

Expected on the H100 (not measured here): a streaming in-place kernel, ~90% of copy
bandwidth at prefill sizes (thousands of tokens). Decode (one token per sequence, tens of
tokens) is launch-bound, a few microseconds.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TILE = 2048  # elements of q or k a program rotates
NUM_WARPS = 4


def _explicit_device(device: torch.device | str | None) -> torch.device:
    device = torch.device("cpu" if device is None else device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


@functools.lru_cache(maxsize=16)
def _build_cos_sin_table(max_position: int, rotary_dim: int, base: float, device: torch.device) -> torch.Tensor:
    inv_freq = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=device) / rotary_dim)
    angles = torch.arange(max_position, dtype=torch.float64, device=device)[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=1).to(torch.float32)


def cos_sin_table(max_position: int, rotary_dim: int, base: float = 10000.0,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """The (max_position, rotary_dim) fp32 [cos | sin] table, built on first use and cached."""
    if max_position < 1:
        raise ValueError(f"max_position must be >= 1, got {max_position}")
    if rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even and >= 2, got {rotary_dim}")
    if not base > 0:
        raise ValueError(f"base must be > 0, got {base}")
    return _build_cos_sin_table(int(max_position), int(rotary_dim), float(base), _explicit_device(device))


cos_sin_table.cache_info = _build_cos_sin_table.cache_info
cos_sin_table.cache_clear = _build_cos_sin_table.cache_clear


@triton.jit
def _rotate_heads(row0_ptr, head_stride, n_heads, head0, cos, sin, half,
                  HEADS_BLOCK: tl.constexpr, HALF_BLOCK: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Rotate heads head0 .. head0 + HEADS_BLOCK - 1 (those < n_heads) of one token in place."""
    heads = head0 + tl.arange(0, HEADS_BLOCK)
    rows = row0_ptr + heads[:, None] * head_stride
    if INTERLEAVED:
        cols = tl.arange(0, 2 * HALF_BLOCK)
        mask = (heads < n_heads)[:, None] & (cols < 2 * half)[None, :]
        x = tl.load(rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x1, x2 = tl.split(x.reshape(HEADS_BLOCK, HALF_BLOCK, 2))
        y = tl.join(x1 * cos - x2 * sin, x2 * cos + x1 * sin).reshape(HEADS_BLOCK, 2 * HALF_BLOCK)
        tl.store(rows + cols[None, :], y.to(row0_ptr.dtype.element_ty), mask=mask)
    else:
        cols = tl.arange(0, HALF_BLOCK)
        mask = (heads < n_heads)[:, None] & (cols < half)[None, :]
        x1 = tl.load(rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(rows + half + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(rows + cols[None, :], (x1 * cos - x2 * sin).to(row0_ptr.dtype.element_ty), mask=mask)
        tl.store(rows + half + cols[None, :], (x2 * cos + x1 * sin).to(row0_ptr.dtype.element_ty), mask=mask)


@triton.jit
def cos_sin_row(table_ptr, position, max_position, half, HALF_BLOCK: tl.constexpr):
    """(cos, sin) of `position` from a [cos | sin] table, each (1, HALF_BLOCK): NaN for a position
    outside [0, max_position) (never memory outside the table), so its token shows it."""
    cols = tl.arange(0, HALF_BLOCK)
    valid = (cols < half) & (position >= 0) & (position < max_position)
    table_row = table_ptr + position * (2 * half)
    cos = tl.load(table_row + cols, mask=valid, other=float("nan"))[None, :]
    sin = tl.load(table_row + half + cols, mask=valid, other=float("nan"))[None, :]
    return cos, sin


@triton.jit
def rope_kernel(q_ptr, k_ptr, pos_ptr, table_ptr, n_q_heads, n_k_heads, seq_len,
                q_batch_stride, q_seq_stride, q_head_stride, k_batch_stride, k_seq_stride, k_head_stride,
                max_position, half,
                HEADS_BLOCK: tl.constexpr, HALF_BLOCK: tl.constexpr, INTERLEAVED: tl.constexpr):
    token = tl.program_id(0)
    head_block = tl.program_id(1)
    batch = (token // seq_len).to(tl.int64)
    seq = (token % seq_len).to(tl.int64)
    position = tl.load(pos_ptr + token).to(tl.int64)
    cos, sin = cos_sin_row(table_ptr, position, max_position, half, HALF_BLOCK)
    q_blocks = tl.cdiv(n_q_heads, HEADS_BLOCK)
    if head_block < q_blocks:
        _rotate_heads(q_ptr + batch * q_batch_stride + seq * q_seq_stride, q_head_stride, n_q_heads,
                      head_block * HEADS_BLOCK, cos, sin, half, HEADS_BLOCK, HALF_BLOCK, INTERLEAVED)
    else:
        _rotate_heads(k_ptr + batch * k_batch_stride + seq * k_seq_stride, k_head_stride, n_k_heads,
                      (head_block - q_blocks) * HEADS_BLOCK, cos, sin, half, HEADS_BLOCK, HALF_BLOCK, INTERLEAVED)


def check_rope_inputs(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rotary_dim: int) -> None:
    """Raise ValueError on inputs no RoPE can take (the kernel also needs KERNEL_DTYPES)."""
    if q.dim() not in (3, 4) or k.dim() != q.dim():
        raise ValueError(f"q and k must both be (tokens, heads, head_dim) or (batch, seq, heads, head_dim); got "
                         f"{tuple(q.shape)} and {tuple(k.shape)}")
    if k.shape[:-2] != q.shape[:-2] or positions.shape != q.shape[:-2]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and positions {tuple(positions.shape)} must "
                         f"share the leading (token) dimensions")
    if q.shape[-1] != k.shape[-1] or q.shape[-2] == 0 or k.shape[-2] == 0:
        raise ValueError(f"q and k need >= 1 head and one head_dim; got {tuple(q.shape)} and {tuple(k.shape)}")
    if q.dtype != k.dtype or not q.is_floating_point():
        raise ValueError(f"q and k must share one floating-point dtype, got {q.dtype} and {k.dtype}")
    if positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be int32 or int64, got {positions.dtype}")
    if not q.device == k.device == positions.device:
        raise ValueError(f"q, k and positions must share a device, got {q.device}, {k.device}, {positions.device}")
    if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > q.shape[-1]:
        raise ValueError(f"rotary_dim must be even, >= 2 and <= head_dim {q.shape[-1]}; got {rotary_dim}")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError(f"q and k are rotated in place and need a contiguous last dimension; strides {q.stride()} "
                         f"and {k.stride()}")


def _check_table(cos_sin: torch.Tensor, device: torch.device) -> None:
    if cos_sin.dim() != 2 or cos_sin.dtype != torch.float32 or cos_sin.device != device:
        raise ValueError(f"cos_sin must be a (max_position, rotary_dim) float32 table on {device} (see "
                         f"cos_sin_table), got {tuple(cos_sin.shape)} {cos_sin.dtype} on {cos_sin.device}")


def rope_tile(q_heads: int, kv_heads: int, rotary_dim: int) -> tuple[int, int]:
    """(HEADS_BLOCK, HALF_BLOCK): half a rotary row padded to a power of two, and as many
    heads as make a TILE-element tile (no more than the larger tensor has)."""
    half_block = triton.next_power_of_2(rotary_dim // 2)
    return min(max(1, TILE // (2 * half_block)), triton.next_power_of_2(max(q_heads, kv_heads))), half_block


def apply_rope_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, *,
                interleaved: bool = False) -> None:
    """Rotate q (tokens, q_heads, head_dim) and k (tokens, kv_heads, head_dim) in place on the
    Triton kernel, token t by positions[t]; or q, k (batch, seq, heads, head_dim) with
    positions (batch, seq). cos_sin: a `cos_sin_table`; its width is the rotary_dim."""
    _check_table(cos_sin, q.device)
    check_rope_inputs(q, k, positions, cos_sin.shape[1])
    if q.dtype not in KERNEL_DTYPES:
        raise ValueError(f"the kernel takes float16, bfloat16 or float32 q and k, got {q.dtype}")
    if q.dim() == 3:  # one sequence of tokens: no batch stride
        seq_len, q_strides, k_strides = q.shape[0], (0, *q.stride()[:2]), (0, *k.stride()[:2])
    else:
        seq_len, q_strides, k_strides = q.shape[1], q.stride()[:3], k.stride()[:3]
    tokens = positions.numel()
    if tokens == 0:
        return
    q_heads, kv_heads = q.shape[-2], k.shape[-2]
    heads_block, half_block = rope_tile(q_heads, kv_heads, cos_sin.shape[1])
    grid = (tokens, triton.cdiv(q_heads, heads_block) + triton.cdiv(kv_heads, heads_block))
    rope_kernel[grid](q, k, positions.reshape(-1), cos_sin.contiguous(), q_heads, kv_heads, seq_len, *q_strides,
                      *k_strides, cos_sin.shape[0], cos_sin.shape[1] // 2, HEADS_BLOCK=heads_block,
                      HALF_BLOCK=half_block, INTERLEAVED=bool(interleaved), num_warps=NUM_WARPS)


def rope_reference_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, *,
                    interleaved: bool = False) -> None:
    """RoPE in eager PyTorch, in place, same arguments as `apply_rope_`: computed in fp32 (or
    float64) from the same table, rounded once."""
    rotary_dim = cos_sin.shape[1]
    half = rotary_dim // 2
    rows = cos_sin[positions].unsqueeze(-2)  # (..., 1, rotary_dim): broadcast over heads
    for x in (q, k):
        work = torch.promote_types(x.dtype, torch.float32)
        cos, sin = rows[..., :half].to(work), rows[..., half:].to(work)
        rot = x[..., :rotary_dim].to(work)
        x1, x2 = (rot[..., 0::2], rot[..., 1::2]) if interleaved else (rot[..., :half], rot[..., half:])
        y1, y2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        y = torch.stack((y1, y2), dim=-1).flatten(-2) if interleaved else torch.cat((y1, y2), dim=-1)
        x[..., :rotary_dim] = y.to(x.dtype)


def rope_min_bytes(tokens: int, q_heads: int, kv_heads: int, rotary_dim: int, dtype: torch.dtype,
                   positions_dtype: torch.dtype = torch.int64) -> int:
    """HBM bytes RoPE must move: the rotated dims of q and k read and written once, and the
    positions read (the cos/sin table is not counted: it could be computed in registers)."""
    rotated = 2 * tokens * (q_heads + kv_heads) * rotary_dim * torch.empty((), dtype=dtype).element_size()
    return rotated + tokens * torch.empty((), dtype=positions_dtype).element_size()

"""Scaled, causally masked softmax over rows of attention scores, one pass, in Triton.

The math. For a score matrix S (Nq x Nk) per (batch, head), a scale c and the causal mask
(query i sees keys j <= i, top-left aligned as SDPA's is_causal):

    P_ij = exp(c S_ij - m_i) / sum_{j' <= i} exp(c S_ij' - m_i)   for j <= i,   P_ij = 0 for j > i
    m_i  = max_{j <= i} c S_ij

Eager PyTorch runs it as a chain (the "eager" attention of Hugging Face's GPT-2 and of
most hand-written attention): scale (read and write S: 4 bytes per bf16 score), mask
(read S and a bool mask, write: 5), softmax (read, write: 4), ~13 bytes in three launches
(more with an fp32 upcast before the softmax, as some models do). Here one
program loads its rows, scales, masks and normalizes them in fp32 registers, and writes P
once, rounded to S's dtype: 2 bytes read (only where the mask lets a key through: keys
after the query are never read, their P is a known 0) and 2 written per score.

Choices, each for the H100:
- Whole rows in registers, up to MAX_ROW = 16384 keys: one read, one write, the max and
  the sum are register reductions. Short rows pack several to a program so each program
  holds ~2048 scores (16 a thread over 4 warps; 8 warps from 4096 keys up, 16 at 16384).
- Causal rows read only their first i + 1 keys (a masked load of the rest costs no
  bytes): half the reads of a square matrix. The mask is the index compare, not a tensor.
- Row offsets are 64-bit: batch x heads x Nq x Nk passes 2^31 at 16 x 32 x 2048^2.
- c is applied in fp32 to the raw scores (eager rounds c S to bf16 first: within half an
  ulp of the score, ~1% of a probability at |c S| ~ 4, inside the problems' tolerance).

Expected on the H100 (not measured here): a streaming row kernel, ~85-90% of copy
bandwidth on the bytes it moves: 3 per bf16 score causal (half of them read), 4 not.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_ROW = 16384  # keys per row held in registers
TILE = 2048  # scores per program, at least


@triton.jit
def scaled_softmax_kernel(s_ptr, p_ptr, n_rows, n_q, n_k, row_stride, scale,
                          CAUSAL: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_K)
    in_row = (rows < n_rows)[:, None] & (cols < n_k)[None, :]
    visible = in_row
    if CAUSAL:
        visible = visible & (cols[None, :] <= (rows % n_q)[:, None])
    rows = rows.to(tl.int64)
    s = tl.load(s_ptr + rows[:, None] * row_stride + cols[None, :], mask=visible, other=0.0)
    s = tl.where(visible, s.to(tl.float32) * scale, float("-inf"))
    row_max = tl.max(s, 1)
    row_max = tl.where(row_max == float("-inf"), 0.0, row_max)  # rows past n_rows: all masked, stay finite
    e = tl.exp(s - row_max[:, None])
    # a real row's sum is >= 1 (its max gives exp(0)); the max only keeps masked rows from 0 / 0
    p = e / tl.maximum(tl.sum(e, 1), 1.0)[:, None]
    tl.store(p_ptr + rows[:, None] * n_k + cols[None, :], p.to(p_ptr.dtype.element_ty), mask=in_row)


def softmax_tile(n_k: int) -> tuple[int, int, int]:
    """(BLOCK_ROWS, BLOCK_K, num_warps) for rows of n_k scores."""
    block_k = triton.next_power_of_2(n_k)
    block_rows = max(1, TILE // block_k)
    return block_rows, block_k, 4 if block_rows * block_k <= 2048 else (8 if block_k <= 8192 else 16)


def check_scaled_softmax_inputs(scores: torch.Tensor, scale: float, causal: bool) -> None:
    """Raise ValueError on anything the kernel cannot take."""
    if scores.dim() < 2 or scores.shape[-1] == 0:
        raise ValueError(f"scores must be (..., Nq, Nk) with Nk > 0, got shape {tuple(scores.shape)}")
    if scores.dtype not in KERNEL_DTYPES:
        raise ValueError(f"scores must be float16, bfloat16 or float32, got {scores.dtype}")
    if scores.shape[-1] > MAX_ROW:
        raise ValueError(f"rows of {scores.shape[-1]} keys: at most {MAX_ROW} are held in registers")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number, got {scale}")
    if causal and scores.shape[-2] > scores.shape[-1]:
        raise ValueError(f"causal needs Nq <= Nk (query i sees keys 0..i), got {tuple(scores.shape[-2:])}")


def scaled_softmax(scores: torch.Tensor, scale: float, *, causal: bool = True) -> torch.Tensor:
    """softmax(scale * scores) over the last dim, keys after each query masked when `causal`.

    scores (..., Nq, Nk) fp16/bf16/fp32 with a contiguous last dim; returns P of the same
    shape and dtype, contiguous, computed in fp32 and rounded once."""
    check_scaled_softmax_inputs(scores, scale, causal)
    n_q, n_k = scores.shape[-2:]
    rows = scores.reshape(-1, n_k)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    p = torch.empty(scores.shape, dtype=scores.dtype, device=scores.device)
    if rows.shape[0]:
        block_rows, block_k, warps = softmax_tile(n_k)
        scaled_softmax_kernel[(triton.cdiv(rows.shape[0], block_rows),)](
            rows, p, rows.shape[0], n_q, n_k, rows.stride(0), float(scale), CAUSAL=bool(causal),
            BLOCK_ROWS=block_rows, BLOCK_K=block_k, num_warps=warps)
    return p


def scaled_softmax_reference(scores: torch.Tensor, scale: float, *, causal: bool = True) -> torch.Tensor:
    """The same math in float64 (unrounded)."""
    s = scores.double() * scale
    if causal:
        n_q, n_k = s.shape[-2:]
        visible = torch.ones(n_q, n_k, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~visible, float("-inf"))
    return torch.softmax(s, -1)


def scaled_softmax_min_bytes(batch_heads: int, n_q: int, n_k: int, causal: bool, itemsize: int = 2) -> int:
    """HBM bytes the op must move: the visible scores read (j <= i when causal), P written."""
    visible = n_q * (n_q + 1) // 2 if causal else n_q * n_k  # causal: row i reads i + 1 (Nq <= Nk)
    return batch_heads * (visible + n_q * n_k) * itemsize

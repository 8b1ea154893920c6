"""Argmax over the last dimension in Triton: the greedy token of a decode step's logits.

torch.argmax's semantics, exactly: the first index of the largest value; a NaN counts as
larger than everything (the first NaN wins); a row of -inf gives 0.

Why a kernel: on the H200 torch.argmax over one row of Llama 3's 128,256 fp32 logits took
27.3 us (`scripts/decode_profile.py`, llama3-8b bf16: 0.6% of the 4.37 ms step), a single
reduction walking 513 KB. The floor is ~0.1 us of HBM time, so the cost is latency: spread
the row over many programs, then reduce their winners.

Two launches. Stage 1: program (row, block) reduces BLOCK elements to (value, index): the
first NaN's index if the block holds one (value NaN), else the block's maximum and the
first index holding it. Stage 2: one program a row takes the blocks' winners the same way;
blocks are in index order, so "the smallest index among the tied winners" is "the first".
A row that fits one block is done in stage 1 (one launch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048  # elements a stage-1 program reduces: 8 KB of fp32, 16 a thread at 4 warps
MAX_BLOCKS = 4096  # stage 2 holds every block's winner of a row in one program
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _first_winner(values, indices, valid):
    """(value, index) of the winner among `values` at `indices`, `valid` masking the padding."""
    is_nan = (values != values) & valid
    first_nan = tl.min(tl.where(is_nan, indices, 2147483647), axis=0)
    finite = tl.where(valid & ~is_nan, values, float("-inf"))
    top = tl.max(finite, axis=0)
    first_top = tl.min(tl.where(valid & (finite == top), indices, 2147483647), axis=0)
    has_nan = first_nan != 2147483647
    return tl.where(has_nan, float("nan"), top), tl.where(has_nan, first_nan, first_top)


@triton.jit
def argmax_blocks_kernel(x_ptr, part_value_ptr, part_index_ptr, out_ptr, n, row_stride, blocks,
                         BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr):
    row, block = tl.program_id(0), tl.program_id(1)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    valid = offs < n
    values = tl.load(x_ptr + row.to(tl.int64) * row_stride + offs, mask=valid).to(tl.float32)
    value, index = _first_winner(values, offs, valid)
    if ONE_BLOCK:
        tl.store(out_ptr + row, index.to(tl.int64))
    else:
        tl.store(part_value_ptr + row * blocks + block, value)
        tl.store(part_index_ptr + row * blocks + block, index)


@triton.jit
def argmax_winners_kernel(part_value_ptr, part_index_ptr, out_ptr, blocks, BLOCKS: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCKS)
    valid = offs < blocks
    values = tl.load(part_value_ptr + row * blocks + offs, mask=valid)
    indices = tl.load(part_index_ptr + row * blocks + offs, mask=valid)
    _, index = _first_winner(values, indices, valid)
    tl.store(out_ptr + row, index.to(tl.int64))


def argmax_last_dim(x: torch.Tensor, *, block: int = BLOCK) -> torch.Tensor:
    """x (rows, n) float16/bfloat16/float32, last dim contiguous -> int64 (rows,): torch.argmax(x, -1)."""
    if x.dim() != 2 or x.dtype not in KERNEL_DTYPES:
        raise ValueError(f"argmax_last_dim takes a (rows, n) float16/bfloat16/float32 tensor, got "
                         f"{tuple(x.shape)} {x.dtype}")
    rows, n = x.shape
    if n == 0:
        raise ValueError("argmax of an empty row")
    if block < 16 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 16, got {block}")
    if n > MAX_BLOCKS * block:
        raise ValueError(f"rows of {n} elements exceed {MAX_BLOCKS} blocks of {block}: use torch.argmax")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    blocks = triton.cdiv(n, block)
    if blocks == 1:
        argmax_blocks_kernel[(rows, 1)](x, out, out, out, n, x.stride(0), 1, BLOCK=block, ONE_BLOCK=True,
                                        num_warps=4)
        return out
    part_value = torch.empty(rows, blocks, dtype=torch.float32, device=x.device)
    part_index = torch.empty(rows, blocks, dtype=torch.int32, device=x.device)
    argmax_blocks_kernel[(rows, blocks)](x, part_value, part_index, out, n, x.stride(0), blocks, BLOCK=block,
                                         ONE_BLOCK=False, num_warps=4)
    argmax_winners_kernel[(rows,)](part_value, part_index, out, blocks, BLOCKS=triton.next_power_of_2(blocks),
                                   num_warps=4)
    return out

"""RMSNorm and LayerNorm over the last dimension in Triton, with an optional fused residual add.

For a row h of H values (h = x, or h = x + residual when a residual is given):

    RMSNorm:    y = h / sqrt(mean(h^2) + eps) * w
    LayerNorm:  y = (h - mean(h)) / sqrt(var(h) + eps) * w [+ b]     (var biased, as torch's)

With a residual the op returns (y, h): h is the block's new residual stream, so a
transformer block's "add, then norm" is one pass over memory instead of three (add: read
2, write 1; norm: read 1, write 1). h is rounded to the input dtype before the statistics
are taken, so y is exactly the norm of the h returned (what eager `norm(x + residual)`
computes). Statistics and the affine step run in fp32; y is rounded once, to x's dtype.
The weight (and bias) may be fp32 under bf16/fp16 activations.

Bytes per row, E bytes an element: read H*E (x) [+ H*E residual], write H*E (y) [+ H*E h].
The weight is read by every row but lives in L2 after the first (evict_last keeps it there);
`rms_norm_min_bytes`/`layer_norm_min_bytes` count it once. No FLOP worth counting: a few
per element against 4-8 bytes, so the roof is HBM bandwidth and the target is a
copy's: each element read once and written once.

Choices, each for the H100 (132 SMs, ~3 TB/s, 50 MB L2):
- Rows of up to 16384 elements (`MAX_ROW_IN_REGISTERS`) are held whole in registers: one
  program loads its row, reduces it, scales and stores it: one read, one write. Tiles are
  sized so each thread holds 16 elements (32 at 16384): two 16-byte vectors per bf16
  stream (four at 16384). Compiled for sm_90 (ptxas -v, bf16): 32-40 registers a thread
  up to H = 8192, so 6-8 programs share an SM (48-64 KB of each stream in flight per SM,
  where Little's law asks ~16 KB: 3 TB/s x ~700 ns / 132 SMs); 64 at H = 16384, two
  512-thread programs an SM (LayerNorm without residual spills 8 bytes). Rows shorter than 2048
  elements are packed several to a program (a [BLOCK_ROWS, BLOCK_H] tile, reduced along
  axis 1) so programs stay big enough to be worth scheduling: per-head QK-norm (H = 128)
  runs 16 rows to a program.
- Longer rows (28672, 32768, ...) would spill, so they loop over 4096-element chunks
  twice: pass 1 takes the statistics (and, with a residual, writes h), pass 2 reads h
  back (from the new-residual buffer it just wrote, or from x), normalizes and stores.
  The second read nearly always hits L2: a program's row is 56-64 KB and a few hundred
  rows in flight fit in 50 MB, so HBM still sees one read and one write per element.
  RMSNorm accumulates h^2 lane-wise and reduces once; LayerNorm takes each chunk's mean
  and centred sum of squares exactly in registers and merges them into the row's with
  Chan et al.'s pairwise update, so a large mean never cancels the variance away (the
  E[h^2] - E[h]^2 shortcut would).
- Row offsets are 64-bit: rows * stride passes 2^31 for long prompts at H >= 16384.
- Input rows may be strided (any leading shape that flattens to rows with one stride and
  a contiguous last dim; anything else is copied first); outputs are contiguous.

Expected on the H100 (not measured here): the per-row work is one reduction between a
load and a store, so with >= 4 rows per SM in flight (a few thousand rows) the register
path should sit at ~90% of copy bandwidth, as Liger-Kernel's one-row-per-program RMSNorm
does (2.83 TB/s). H = 16384 has only two programs an SM, each stalled on its reduction
between load and store, so expect it a few points lower; the looped path pays an L2
re-read and a serial chunk loop, expect 80-90%. Odd H (1000, 4099) leaves rows unaligned
to 16 bytes: scalar accesses, correct but slower. Decode batches (tens of rows) cannot fill 132 SMs: they
are launch- and latency-bound (a few microseconds) whatever the kernel does.
`block_size` forces the chunk size (and so the looped path) to compare both on the GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_ROW_IN_REGISTERS = 16384  # longer rows loop over chunks (see the module docstring)
LOOP_CHUNK = 4096
MIN_TILE = 2048  # elements per program: short rows are packed until a tile holds this many


@triton.jit
def _load_h(x_ptr, res_ptr, new_res_ptr, rows, cols, mask, hidden, x_stride, res_stride,
            HAS_RESIDUAL: tl.constexpr):
    """One tile of h in fp32, 0 outside the mask. With a residual h = x + residual, rounded to
    the activations' dtype and stored as the new residual (contiguous rows of `hidden`)."""
    x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + rows[:, None] * res_stride + cols[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(new_res_ptr.dtype.element_ty)
        tl.store(new_res_ptr + rows[:, None] * hidden + cols[None, :], x, mask=mask)
    return x.to(tl.float32)


@triton.jit
def _scale_and_store(y, w_ptr, b_ptr, out_ptr, rows, cols, mask, hidden, HAS_BIAS: tl.constexpr):
    in_row = cols < hidden
    # every row reads the same weight: keep it in L2 while the activations stream past
    w = tl.load(w_ptr + cols, mask=in_row, other=0.0, eviction_policy="evict_last").to(tl.float32)
    y = y * w[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=in_row, other=0.0, eviction_policy="evict_last").to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * hidden + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def norm_kernel(x_ptr, res_ptr, w_ptr, b_ptr, out_ptr, new_res_ptr, n_rows, hidden, x_stride, res_stride, eps,
                RMS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                BLOCK_ROWS: tl.constexpr, BLOCK_H: tl.constexpr, LOOPED: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < n_rows
    rows = rows.to(tl.int64)
    if not LOOPED:  # the whole row in registers: one read, one write
        cols = tl.arange(0, BLOCK_H)
        mask = row_ok[:, None] & (cols < hidden)[None, :]
        h = _load_h(x_ptr, res_ptr, new_res_ptr, rows, cols, mask, hidden, x_stride, res_stride, HAS_RESIDUAL)
        if RMS:
            y = h * tl.rsqrt(tl.sum(h * h, 1) / hidden + eps)[:, None]
        else:
            centred = tl.where(mask, h - (tl.sum(h, 1) / hidden)[:, None], 0.0)
            y = centred * tl.rsqrt(tl.sum(centred * centred, 1) / hidden + eps)[:, None]
        _scale_and_store(y, w_ptr, b_ptr, out_ptr, rows, cols, mask, hidden, HAS_BIAS)
    else:
        # pass 1: the row's statistics, chunk by chunk (writing h when there is a residual)
        if RMS:
            sum_sq = tl.zeros([BLOCK_ROWS, BLOCK_H], tl.float32)
            for start in range(0, hidden, BLOCK_H):
                cols = start + tl.arange(0, BLOCK_H)
                mask = row_ok[:, None] & (cols < hidden)[None, :]
                h = _load_h(x_ptr, res_ptr, new_res_ptr, rows, cols, mask, hidden, x_stride, res_stride,
                            HAS_RESIDUAL)
                sum_sq += h * h
            mean = tl.zeros([BLOCK_ROWS], tl.float32)  # RMSNorm does not centre
            rstd = tl.rsqrt(tl.sum(sum_sq, 1) / hidden + eps)
        else:  # Chan et al.: merge (count, mean, M2) of the row so far with the chunk's, exact in each
            count = 0.0
            mean = tl.zeros([BLOCK_ROWS], tl.float32)
            m2 = tl.zeros([BLOCK_ROWS], tl.float32)
            for start in range(0, hidden, BLOCK_H):
                cols = start + tl.arange(0, BLOCK_H)
                mask = row_ok[:, None] & (cols < hidden)[None, :]
                h = _load_h(x_ptr, res_ptr, new_res_ptr, rows, cols, mask, hidden, x_stride, res_stride,
                            HAS_RESIDUAL)
                n_chunk = tl.minimum(hidden - start, BLOCK_H).to(tl.float32)
                chunk_mean = tl.sum(h, 1) / n_chunk
                centred = tl.where(mask, h - chunk_mean[:, None], 0.0)
                total = count + n_chunk
                delta = chunk_mean - mean
                mean += delta * (n_chunk / total)
                m2 += tl.sum(centred * centred, 1) + delta * delta * (count * n_chunk / total)
                count = total
            rstd = tl.rsqrt(m2 / hidden + eps)
        if HAS_RESIDUAL:
            tl.debug_barrier()  # pass 2 reads back h that other threads of this program stored
        # pass 2: normalize (h comes back from L2: see the module docstring)
        for start in range(0, hidden, BLOCK_H):
            cols = start + tl.arange(0, BLOCK_H)
            mask = row_ok[:, None] & (cols < hidden)[None, :]
            if HAS_RESIDUAL:
                h = tl.load(new_res_ptr + rows[:, None] * hidden + cols[None, :], mask=mask, other=0.0)
            else:
                h = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=mask, other=0.0)
            y = (h.to(tl.float32) - mean[:, None]) * rstd[:, None]
            _scale_and_store(y, w_ptr, b_ptr, out_ptr, rows, cols, mask, hidden, HAS_BIAS)


@dataclass(frozen=True)
class NormConfig:
    block_rows: int  # rows per program
    block_h: int  # elements of a row per tile: the whole (padded) row, or the loop's chunk
    looped: bool
    num_warps: int


def norm_config(hidden: int, block_size: int | None = None) -> NormConfig:
    """The tile for rows of `hidden` elements: whole rows in registers up to
    MAX_ROW_IN_REGISTERS, else a two-pass loop over LOOP_CHUNK chunks. `block_size` (a
    power of two) caps the tile's row length: below the row's padded length it forces the loop."""
    row = triton.next_power_of_2(hidden)
    if block_size is not None:
        if block_size < 16 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 16, got {block_size}")
        cap = block_size
    else:
        cap = MAX_ROW_IN_REGISTERS
    if row <= cap:
        block_h, looped = row, False
    else:
        block_h, looped = min(cap, LOOP_CHUNK), True
    block_rows = 1 if looped else max(1, MIN_TILE // block_h)
    tile = block_rows * block_h
    return NormConfig(block_rows, block_h, looped, num_warps=min(16, max(4, tile // 512)))


def check_norm_inputs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      residual: torch.Tensor | None, eps: float) -> None:
    """Raise ValueError on inputs no norm can take (the kernel also needs KERNEL_DTYPES)."""
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last (hidden) dimension, got shape {tuple(x.shape)}")
    hidden = x.shape[-1]
    for name, t in (("x", x), ("weight", weight), ("bias", bias), ("residual", residual)):
        if t is not None and not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and tuple(t.shape) != (hidden,):
            raise ValueError(f"{name} must have shape ({hidden},) to match x's last dimension, got {tuple(t.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual must match x in shape and dtype: x {tuple(x.shape)} {x.dtype}, residual "
                         f"{tuple(residual.shape)} {residual.dtype}")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps}")


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as (rows, hidden) with a unit last stride: a view where one exists, else a copy."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(1) == 1 or rows.shape[1] == 1 else rows.contiguous()


def _norm_forward(x, weight, bias, residual, eps, rms, block_size):
    check_norm_inputs(x, weight, bias, residual, eps)
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is not None and t.dtype not in KERNEL_DTYPES:
            raise ValueError(f"the kernel takes float16, bfloat16 or float32 {name}, got {t.dtype}")
    config = norm_config(x.shape[-1], block_size)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    new_residual = torch.empty_like(out) if residual is not None else None
    x_rows = _rows(x)
    res_rows = _rows(residual) if residual is not None else x_rows  # unread without a residual
    n_rows, hidden = x_rows.shape
    if n_rows:
        weight = weight.contiguous()
        norm_kernel[(triton.cdiv(n_rows, config.block_rows),)](
            x_rows, res_rows, weight, bias.contiguous() if bias is not None else weight, out,
            new_residual if new_residual is not None else out, n_rows, hidden, x_rows.stride(0),
            res_rows.stride(0), float(eps), RMS=rms, HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
            BLOCK_ROWS=config.block_rows, BLOCK_H=config.block_h, LOOPED=config.looped, num_warps=config.num_warps)
    return out if residual is None else (out, new_residual)


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None,
                     *, block_size: int | None = None):
    """RMSNorm of x over its last dimension on the Triton kernel: out, or (out, x + residual)
    when a residual is given. x, residual: (..., H) in fp16/bf16/fp32; weight: (H,)."""
    return _norm_forward(x, weight, None, residual, eps, True, block_size)


def layer_norm_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, eps: float = 1e-5,
                       residual: torch.Tensor | None = None, *, block_size: int | None = None):
    """LayerNorm of x over its last dimension on the Triton kernel: out, or (out, x + residual)
    when a residual is given. x, residual: (..., H) in fp16/bf16/fp32; weight, bias: (H,)."""
    return _norm_forward(x, weight, bias, residual, eps, False, block_size)


# --- the eager PyTorch references: the op's fallback, the tests' oracle (in float64), the bench's "eager" ---

def _residual_sum(x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    return x if residual is None else x + residual  # rounded to x's dtype, as the kernel's h is


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                       residual: torch.Tensor | None = None):
    """RMSNorm as eager PyTorch writes it (fp32 statistics, one rounding at the end)."""
    h = _residual_sum(x, residual)
    work = torch.promote_types(x.dtype, torch.float32)
    hw = h.to(work)
    y = hw * torch.rsqrt(hw.pow(2).mean(-1, keepdim=True) + eps) * weight.to(work)
    return y.to(x.dtype) if residual is None else (y.to(x.dtype), h)


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                         eps: float = 1e-5, residual: torch.Tensor | None = None):
    """LayerNorm through torch.nn.functional.layer_norm in fp32 (or float64), rounded once."""
    h = _residual_sum(x, residual)
    work = torch.promote_types(x.dtype, torch.float32)
    y = torch.nn.functional.layer_norm(h.to(work), (x.shape[-1],), weight.to(work),
                                       None if bias is None else bias.to(work), eps)
    return y.to(x.dtype) if residual is None else (y.to(x.dtype), h)


def rms_norm_min_bytes(rows: int, hidden: int, dtype: torch.dtype, residual: bool,
                       weight_dtype: torch.dtype | None = None) -> int:
    """HBM bytes RMSNorm must move: x [and residual] read, out [and the new residual]
    written, the weight read once."""
    e = torch.empty((), dtype=dtype).element_size()
    w = torch.empty((), dtype=weight_dtype or dtype).element_size()
    streams = 4 if residual else 2
    return streams * rows * hidden * e + hidden * w


def layer_norm_min_bytes(rows: int, hidden: int, dtype: torch.dtype, residual: bool, bias: bool = True,
                         weight_dtype: torch.dtype | None = None) -> int:
    """HBM bytes LayerNorm must move: as RMSNorm's, plus the bias read once."""
    w = torch.empty((), dtype=weight_dtype or dtype).element_size()
    return rms_norm_min_bytes(rows, hidden, dtype, residual, weight_dtype) + (hidden * w if bias else 0)

"""Cross-entropy from logits in Triton: loss_i = logsumexp(x_i) - x_i[t_i], then the mean over
the rows whose target is not `ignore_index` (what `F.cross_entropy` computes, reduction
"mean"; "sum" and "none" too).

Kernel 1, one program a row: one pass over the row's logits in 8192-element chunks with
the online max and sum (`rows.online_max_sum`), so lse = m + log s; one more load fetches
the target's logit. Nothing is written but the row's loss (fp32): the logits are read
once and never materialized in fp32 or as log-probabilities. Rows whose target is
ignore_index get loss 0 and do not count; a target outside [0, vocab) gives a NaN loss
(eager PyTorch raises a device-side assert; reading the device to raise here would cost
a synchronization a call), and its logit is never read out of bounds.
Kernel 2, one program: the sum of the losses over the count of kept rows, in fp32.

Bytes: the logits once (rows x vocab x E) plus the targets; the FLOPs (one exp an
element) are free beside them. At 4096 tokens x 128256 (Llama 3's vocabulary) in bf16:
1.05 GB, ~0.35 ms at ~3 TB/s. Eager `F.cross_entropy(logits.float(), targets)` (how Hugging
Face's Llama computes its loss) upcasts (read 2, write 4 bytes an element), runs
log_softmax (read 4 two or three times, write 4) and gathers: ~7x the bytes.

Choices, each for the H100: one program of 16 warps a row (rows are long: 16 chunks of
8192 at 128k), 16 KB of bf16 loads a chunk, 32 registers a thread (compiled for sm_90),
so four programs share an SM: 64 KB of loads in flight, where Little's law asks ~23 KB.
Thousands of rows fill 132 SMs many times over. Row offsets are 64-bit (row x 128256
passes 2^31 from row 16744 on).
Expected (not measured here): ~85-90% of copy bandwidth on the logits, as a streaming
reduction with no write.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kforge.kernels.reductions.rows import CHUNK, as_rows, check_rows_input, finite_shift, online_max_sum, warps_for

REDUCTIONS = ("mean", "sum", "none")
MEAN_BLOCK = 1024


@triton.jit
def cross_entropy_rows_kernel(x_ptr, targets_ptr, loss_ptr, n_cols, x_stride, ignore_index, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_stride
    target = tl.load(targets_ptr + row).to(tl.int64)
    m, s = online_max_sum(x_row, n_cols, CHUNK)
    in_range = (target >= 0) & (target < n_cols)
    picked = tl.load(x_row + tl.where(in_range, target, 0)).to(tl.float32)
    loss = finite_shift(m) + tl.log(s) - picked
    loss = tl.where(in_range, loss, float("nan"))
    tl.store(loss_ptr + row, tl.where(target == ignore_index, 0.0, loss))


@triton.jit
def mean_of_kept_kernel(loss_ptr, targets_ptr, out_ptr, n_rows, ignore_index, DIVIDE: tl.constexpr,
                        BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    kept = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_rows, BLOCK):
        inside = start + offs < n_rows
        total += tl.load(loss_ptr + start + offs, mask=inside, other=0.0)
        target = tl.load(targets_ptr + start + offs, mask=inside, other=ignore_index)
        kept += (target != ignore_index).to(tl.float32)
    result = tl.sum(total, 0)
    if DIVIDE:
        result = result / tl.sum(kept, 0)
    tl.store(out_ptr, result)


def check_cross_entropy_inputs(logits: torch.Tensor, targets: torch.Tensor, reduction: str) -> None:
    """ValueError on anything the kernels cannot take."""
    check_rows_input(logits, "cross_entropy")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
    if not isinstance(targets, torch.Tensor) or targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"targets must be an int64 or int32 tensor of class indices, got "
                         f"{getattr(targets, 'dtype', type(targets).__name__)}")
    if tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"targets {tuple(targets.shape)} must match the logits' leading shape "
                         f"{tuple(logits.shape[:-1])} (logits (..., vocab), one target a row)")
    if targets.device != logits.device:
        raise ValueError(f"targets are on {targets.device}, logits on {logits.device}")


def cross_entropy_forward(logits: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100,
                          reduction: str = "mean", chunk: int | None = None) -> torch.Tensor:
    """Cross-entropy of logits (..., vocab) fp16/bf16/fp32 against class indices (...), in fp32.

    reduction "mean": a 0-dim tensor, the mean over rows whose target is not ignore_index
    (NaN if none is kept, as eager); "sum": their sum; "none": the per-row losses, 0 where
    ignored. `chunk` (a power of two >= 16) sets the chunk the rows are walked in.
    """
    check_cross_entropy_inputs(logits, targets, reduction)
    rows = as_rows(logits)
    flat_targets = targets.reshape(-1)
    n_rows, n_cols = rows.shape
    block = CHUNK if chunk is None else chunk
    if block < 16 or block & (block - 1):
        raise ValueError(f"chunk must be a power of two >= 16, got {chunk}")
    block = min(block, triton.next_power_of_2(n_cols))
    losses = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    if n_rows:
        cross_entropy_rows_kernel[(n_rows,)](rows, flat_targets, losses, n_cols, rows.stride(0), ignore_index,
                                             CHUNK=block, num_warps=warps_for(block))
    if reduction == "none":
        return losses.view(targets.shape)
    out = torch.empty((), dtype=torch.float32, device=logits.device)
    mean_of_kept_kernel[(1,)](losses, flat_targets, out, n_rows, ignore_index, DIVIDE=reduction == "mean",
                              BLOCK=MEAN_BLOCK, num_warps=4)
    return out


def cross_entropy_reference(logits: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100,
                            reduction: str = "mean") -> torch.Tensor:
    """Eager cross-entropy in float64 over (..., vocab) logits, for checking."""
    flat = logits.double().reshape(-1, logits.shape[-1])
    return torch.nn.functional.cross_entropy(flat, targets.reshape(-1).long(), ignore_index=ignore_index,
                                             reduction=reduction).view(targets.shape if reduction == "none" else ())


def cross_entropy_min_bytes(rows: int, vocab: int, dtype: torch.dtype) -> int:
    """HBM bytes cross-entropy must move: the logits once, the int64 targets once (the loss is 4 bytes)."""
    return rows * vocab * torch.empty((), dtype=dtype).element_size() + 8 * rows + 4

"""`kforge.ops.flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
max_seqlen_k, causal=..., scale=...)`: attention over packed variable-length sequences
(a prefill batch without padding) on kforge's FlashAttention kernel, in flash-attn's
varlen layout.

q is (total_q, heads, head_dim), k and v (total_k, kv_heads, head_dim) with kv_heads
dividing heads; sequence b owns rows cu_seqlens_q[b]:cu_seqlens_q[b+1] of q and
cu_seqlens_k[b]:cu_seqlens_k[b+1] of k and v (int32, (batch + 1,), from 0) and attends
only to itself. Causal is top-left aligned per sequence (query i sees keys 0..i of its
sequence, as SDPA's is_causal), or with `bottom_right=True` aligned to the last key (query i
sees keys up to i + len_k - len_q, as flash-attn aligns it: a chunk that continues a cached
prompt); a query row that sees no key gives 0 (log-sum-exp -inf). The output is
(total_q, heads, head_dim); the optional log-sum-exp is fp32 (heads, total_q).

A `torch.library` custom op: torch.compile sees one opaque node. Forward only (prefill):
no autograd formula. The kernel runs for fp16/bf16/fp32 CUDA tensors on Hopper with
head_dim 16..256 (powers of 2) and TMA-friendly strides; anything else (CPU, float64,
other head dims) loops over the sequences with naive attention in PyTorch. Bad input
raises ValueError either way, before any work; checking the cu_seqlens' contents reads
them on the host (a sync), which `check_lengths=False` skips. max_seqlen_q sizes the
kernel's grid; max_seqlen_k is checked only (flash-attn's signature).

For the benchmark: `varlen_attention_reference` (eager SDPA, sequence by sequence),
`varlen_attention_flops` and `varlen_attention_min_bytes`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kforge.kernels.attention.naive import naive_attention


def cumulative_seqlens(lengths: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
    """cu_seqlens for these sequence lengths: int32 (batch + 1,), 0 then the running sums."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    return cu.to(device) if device is not None else cu


def _sequences(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor):
    """(q rows, k rows) slices of each sequence, read on the host."""
    offsets_q, offsets_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(offsets_q) - 1):
        yield slice(offsets_q[b], offsets_q[b + 1]), slice(offsets_k[b], offsets_k[b + 1])


def _heads_first(t: torch.Tensor) -> torch.Tensor:  # (tokens, heads, d) -> (heads, tokens, d)
    return t.transpose(0, 1)


def ours_can_run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: int) -> bool:
    """Whether our kernel takes these (already checked) tensors, else naive attention runs."""
    if not (q.is_cuda and torch.cuda.get_device_capability(q.device) >= (9, 0)):
        return False
    from kforge.kernels.attention.flash_varlen import kernel_limitation

    return kernel_limitation(q, k, v, batch) is None


def _naive_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, bottom_right):
    out = q.new_empty(q.shape)
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    for rows_q, rows_k in _sequences(cu_seqlens_q, cu_seqlens_k):
        # with no keys, softmax over nothing @ v is 0 and logsumexp over nothing is -inf, as in our kernel
        o, s = naive_attention(*(_heads_first(t)[None] for t in (q[rows_q], k[rows_k], v[rows_k])),
                               causal=causal, scale=scale, return_lse=True, bottom_right=bottom_right)
        out[rows_q], lse[:, rows_q] = _heads_first(o[0]), s[0]
    return out, lse


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    torch._check(q.dim() == 3 and k.dim() == 3 and v.dim() == 3,
                 lambda: "kforge::flash_attention_varlen takes 3-D q, k, v (tokens, heads, head_dim)")
    torch._check(k.shape == v.shape, lambda: f"k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    torch._check(q.shape[2] == k.shape[2], lambda: f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in head_dim")
    torch._check(k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0,
                 lambda: f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")


@torch.library.custom_op("kforge::flash_attention_varlen", mutates_args=())
def _flash_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                            scale: float | None, check_lengths: bool, bottom_right: bool
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    from kforge.kernels.attention.flash_varlen import check_varlen_inputs, flash_attention_varlen

    scale = check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                                check_lengths=check_lengths)
    if ours_can_run(q, k, v, cu_seqlens_q.numel() - 1):
        return flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      causal=causal, scale=scale, check_lengths=False, bottom_right=bottom_right)
    return _naive_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, bottom_right)


@_flash_attention_varlen.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, check_lengths, bottom_right):
    _check_shapes(q, k, v)
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def flash_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *,
                           causal: bool = False, scale: float | None = None, return_lse: bool = False,
                           check_lengths: bool = True, bottom_right: bool = False):
    """Per sequence, softmax(q k^T * scale) v, packed as q: (total_q, heads, head_dim); with
    `return_lse`, also the fp32 log-sum-exp of each query row, (heads, total_q)."""
    out, lse = _flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
                                       bool(causal), None if scale is None else float(scale), bool(check_lengths),
                                       bool(causal and bottom_right))
    return (out, lse) if return_lse else out


# --- for the benchmark -----------------------------------------------------------------------

def varlen_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                               cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *,
                               causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """What eager PyTorch code writes: SDPA once per sequence, each result copied into the
    packed output. Inputs go to SDPA 4-D, (1, heads, tokens, d): its fused backends take
    4-D inputs only, and with 3-D ones it would fall back to the N x N math. max_seqlen_* are
    unused (kept for the signature)."""
    out = q.new_empty(q.shape)
    for rows_q, rows_k in _sequences(cu_seqlens_q, cu_seqlens_k):
        o = F.scaled_dot_product_attention(*(_heads_first(t)[None] for t in (q[rows_q], k[rows_k], v[rows_k])),
                                           is_causal=causal, scale=scale, enable_gqa=True)
        out[rows_q] = _heads_first(o[0])
    return out


def _visible_pairs(len_q: int, len_k: int, causal: bool) -> int:
    """(query, key) pairs that enter the softmax; causal top-left: query i sees min(i + 1, len_k) keys."""
    if not causal:
        return len_q * len_k
    diagonal = min(len_q, len_k)  # rows 0..diagonal-1 see i + 1 keys, the rest all len_k
    return diagonal * (diagonal + 1) // 2 + (len_q - diagonal) * len_k


def varlen_attention_flops(seqlens_q: Sequence[int], seqlens_k: Sequence[int], heads: int, head_dim: int,
                           causal: bool = False) -> int:
    """Multiply-adds x 2 of Q K^T and P V over the visible pairs only: 4 d per pair and head."""
    return 4 * heads * head_dim * sum(_visible_pairs(a, b, causal) for a, b in zip(seqlens_q, seqlens_k, strict=True))


def varlen_attention_min_bytes(seqlens_q: Sequence[int], seqlens_k: Sequence[int], heads: int, kv_heads: int,
                               head_dim: int, element_size: int = 2) -> int:
    """HBM bytes no implementation can avoid: q, k, v read once, the output written once
    (our kernel also writes the fp32 log-sum-exp, 2/head_dim of the output's bytes in bf16)."""
    return element_size * head_dim * (2 * heads * sum(seqlens_q) + 2 * kv_heads * sum(seqlens_k))

"""Variable-length FlashAttention forward: many sequences packed into one tensor, no padding.

A prefill batch holds sequences of different lengths. Padding them to the longest wastes
FLOPs and bytes on the padding; packing them end to end does not. The layout is
flash-attn's varlen one: q is (total_q, heads, d) with sequence b in rows
cu_seqlens_q[b] .. cu_seqlens_q[b + 1], k and v are (total_k, kv_heads, d) cut up by
cu_seqlens_k the same way. Sequence b's queries attend to sequence b's keys only:

    O[b] = softmax(Q[b] K[b]^T * scale) V[b]

with causal top-left aligned per sequence (as SDPA's is_causal and our dense kernel):
query i of a sequence sees that sequence's keys 0..i, whatever its two lengths are. A
sequence with no keys has no softmax: its rows come out 0 with log-sum-exp -inf.
FLOPs: 4 * heads * d * sum_b(visible (query, key) pairs of b); HBM bytes at least
q, k, v read once and the output written once, as for the dense kernel.

The work is the dense kernel's (`flash_forward.py`): one program owns BLOCK_M query rows
of one head of one sequence and runs the same `_key_blocks` loop (online softmax, exp2,
no masking on key blocks wholly inside the sequence and below the diagonal). What
changes:
- The grid is (query blocks of the longest sequence, heads, sequences); a program whose
  block starts past its sequence's end returns after reading two offsets. Sequences go
  on the grid's z axis so that batch * heads is not bounded by y's 65535. x runs fastest,
  so the query blocks of one (sequence, head) run side by side and share its K and V in
  L2, as in the dense kernel; the heads of a GQA group follow one another.
- Q, K, V are read through 4-D TMA descriptors over the packed tensors viewed as
  (1, heads, tokens, d), the dense kernel's layout with one batch: a tile starts at
  row cu_seqlens[b] + offset, wherever that falls. TMA zero-fills only past the end of the
  whole tensor; inside it, rows past a sequence's end are the next sequence's. So key
  blocks reaching past the sequence go through the masked loop (keys >= the sequence's
  end get -inf), and query rows past it are computed but never stored.
- The output is stored through pointers with a row mask, not a TMA store: a TMA store
  would write a whole BLOCK_M box, and the rows past this sequence's end belong to the
  next sequence. (A TMA store could be clipped by giving each sequence its own
  descriptor, built on the device, or by an overlapping-stride 3-D descriptor whose
  bounds move with the coordinates; both cost more code and setup than they can save:
  the store is BLOCK_M x d elements once per program, after BLOCK_M x len_k x d x 4 FLOPs
  of work, the same bytes either way.) The log-sum-exp is stored the same way.
- No autotuner. Lengths change with every batch a server sees, and an autotuner keyed on
  them would re-tune on the critical path; keyed on nothing, it would keep whatever won on
  the first (often tiny warm-up) batch. In bf16/fp16 each head dim takes the tile the
  dense kernel's sweep put first in its `CONFIGS` list (hd 128: 128 x 128, 8 warps, 3
  stages); fp32 takes smaller tiles that fit shared memory (`default_config`); `config`
  overrides either.

Expected on the H100 (for the lead to measure): the inner loop, tiles and pipelining
are the dense kernel's, so on sequences of a few thousand tokens the TFLOP/s should sit
close to its ~500 at N = 4096, hd 128 (counting only the FLOPs of visible pairs, as
`varlen_attention_flops` does). The costs on top:
(1) each sequence's last query block and last key block are partial, on average half
    empty: about 1/(2 * blocks per sequence) of the work, 3% at ~2,000 tokens in 128-row
    tiles, under 2% at ~4,000.
(2) programs past a sequence's end start, read two offsets (L2 hits) and exit: ~0.5-1 us
    each, and as one 128 x 128 hd-128 tile fills an SM's shared memory they take an SM
    while they do. 8 sequences of 100..4000 tokens at 32 heads put 2,816 real programs
    and 5,376 such on the grid: 20-40 us against ~1 ms of work non-causal (2-4%), twice
    that in share causal. Sequences of similar length leave almost none.
(3) masked pointer stores instead of a TMA store: the same bytes; the MMA-layout tile is
    reshuffled through shared memory once per program.
If (2) shows on spread lengths, the remedy is a per-call list of (sequence, block)
pairs for the grid, built where the lengths are already read on the host.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kforge.kernels.attention.flash_forward import CONFIGS, HEAD_DIMS, INTERPRETER_CONFIG, LOG2E, _key_blocks

MAX_SEQUENCES = 65535  # the grid's z dimension


@triton.jit
def flash_varlen_kernel(q_desc, k_desc, v_desc, out_ptr, lse_ptr, cu_seqlens_q, cu_seqlens_k,
                        out_row_stride, out_head_stride, total_q, kv_group, qk_scale,
                        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        CAUSAL: tl.constexpr, BOTTOM_RIGHT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q + seq)
    q_len = tl.load(cu_seqlens_q + seq + 1) - q_start
    if start_m >= q_len:  # the grid covers the longest sequence; this one is shorter
        return
    k_start = tl.load(cu_seqlens_k + seq)
    k_len = tl.load(cu_seqlens_k + seq + 1) - k_start
    kv_head = head // kv_group
    offs_m = start_m + tl.arange(0, BLOCK_M)  # query rows within the sequence

    q = q_desc.load([0, head, q_start + start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    # Bottom-right alignment shifts every query by len_k - len_q: query i sees keys up to
    # i + len_k - len_q (a chunk continuing a cached prompt sees the whole prefix). Negative
    # when there are fewer keys than queries: the first rows then see none.
    shift = k_len - q_len if BOTTOM_RIGHT else 0
    if CAUSAL:  # within the sequence, as the dense kernel
        hi = tl.maximum(tl.minimum(start_m + shift + BLOCK_M, k_len), 0)
        unmasked_hi = tl.maximum(tl.minimum(start_m + shift + 1, k_len), 0) // BLOCK_N * BLOCK_N
    else:
        hi = k_len
        unmasked_hi = k_len // BLOCK_N * BLOCK_N
    # _key_blocks counts keys in rows of the packed tensor: shift the bounds by k_start, and
    # the query rows too, so its causal test (query row >= key row) compares within the sequence.
    # Its length bound becomes the sequence's end, which masks off the next sequence's keys.
    k_end = k_start + k_len
    acc, l_i, m_i = _key_blocks(acc, l_i, m_i, q, k_desc, v_desc, 0, kv_head, k_start + shift + offs_m, k_start,
                                k_start + unmasked_hi, k_end, qk_scale, BLOCK_N, HEAD_DIM, False, CAUSAL,
                                DOT_PRECISION)
    acc, l_i, m_i = _key_blocks(acc, l_i, m_i, q, k_desc, v_desc, 0, kv_head, k_start + shift + offs_m,
                                k_start + unmasked_hi, k_start + hi, k_end, qk_scale, BLOCK_N, HEAD_DIM, True,
                                CAUSAL, DOT_PRECISION)

    if BOTTOM_RIGHT:  # a row that sees no key ran its masked blocks on -inf - -inf = NaN: reset it
        sees_a_key = offs_m + shift >= 0
        acc = tl.where(sees_a_key[:, None], acc, 0.0)
        l_i = tl.where(sees_a_key, l_i, 0.0)
        m_i = tl.where(sees_a_key, m_i, float("-inf"))
    # l_i >= 1 for every row that sees a key (top-left: each row sees its key 0); a row that
    # sees none has acc = l_i = 0: its output is 0, its log-sum-exp log(0) = -inf.
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    in_sequence = offs_m < q_len
    rows = (q_start + offs_m).to(tl.int64)  # rows * row stride passes 2^31 at ~500k tokens of 32 x 128
    offs_d = tl.arange(0, HEAD_DIM)
    out_ptrs = out_ptr + head * out_head_stride + rows[:, None] * out_row_stride + offs_d[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=in_sequence[:, None])
    lse = (m_i + tl.math.log2(l_i)) / 1.4426950408889634  # back from log2 units to natural log
    tl.store(lse_ptr + head.to(tl.int64) * total_q + rows, lse, mask=in_sequence)


def _check_cu_seqlens(name: str, cu: torch.Tensor, total: int, max_seqlen: int, lengths_of: str) -> None:
    """The contents of one cu_seqlens (on the host): 0, non-decreasing, ending at `total`."""
    offsets = cu.tolist()
    if offsets[0] != 0:
        raise ValueError(f"{name} must start at 0, got {offsets[0]}")
    lengths = [b - a for a, b in zip(offsets, offsets[1:])]
    if min(lengths) < 0:
        raise ValueError(f"{name} must be non-decreasing; sequence {lengths.index(min(lengths))} has length "
                         f"{min(lengths)}")
    if offsets[-1] != total:
        raise ValueError(f"{name} ends at {offsets[-1]} but {lengths_of} has {total} rows")
    if max(lengths) > max_seqlen:
        raise ValueError(f"max_seqlen {max_seqlen} is below the longest sequence in {name} ({max(lengths)})")


def check_varlen_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                        cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, scale: float | None,
                        *, check_lengths: bool = True) -> float:
    """Raise ValueError on anything that is not packed varlen attention; return the softmax scale.

    Shapes, dtypes and devices cost nothing to check. `check_lengths` also reads both
    cu_seqlens on the host (one device-to-host copy each, so a sync): they must start at 0,
    not decrease, end at the number of rows, and no sequence may be longer than its
    max_seqlen (the grid is sized by max_seqlen_q; a longer sequence would be cut short
    silently). What only our kernel cannot take is `kernel_limitation`'s business.
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be 3-D (tokens, heads, head_dim), got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if not q.dtype == k.dtype == v.dtype or not q.dtype.is_floating_point:
        raise ValueError(f"q, k, v must share one floating-point dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    devices = {t.device for t in (q, k, v, cu_seqlens_q, cu_seqlens_k)}
    if len(devices) > 1:
        raise ValueError(f"q, k, v and both cu_seqlens must be on one device, got {sorted(map(str, devices))}")
    heads, dim = q.shape[1:]
    if k.shape != v.shape or k.shape[2] != dim:
        raise ValueError(f"k and v must be (total_k, kv_heads, head_dim) with q's head_dim {dim}; got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[1] == 0 or heads % k.shape[1]:
        raise ValueError(f"query heads ({heads}) must be a multiple of key/value heads ({k.shape[1]})")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dim() != 1 or cu.dtype != torch.int32 or cu.numel() < 2:
            raise ValueError(f"{name} must be int32 of shape (batch + 1,) with batch >= 1, got {cu.dtype} "
                             f"{tuple(cu.shape)}")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k count different batches: {cu_seqlens_q.numel() - 1} and "
                         f"{cu_seqlens_k.numel() - 1}")
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    scale = 1.0 / math.sqrt(dim) if scale is None else float(scale)
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"scale must be a positive finite number, got {scale}")
    if check_lengths:
        _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, "q")
        _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k, "k")
    return scale


def kernel_limitation(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: int) -> str | None:
    """Why our kernel cannot take these (checked) inputs, or None if it can."""
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {q.dtype} is not supported (float16, bfloat16, float32)"
    if q.shape[2] not in HEAD_DIMS:
        return f"head_dim {q.shape[2]} is not supported (supported: {', '.join(map(str, HEAD_DIMS))})"
    if batch > MAX_SEQUENCES:
        return f"{batch} sequences; at most {MAX_SEQUENCES} in one call (the grid's z dimension)"
    for name, t in (("q", q), ("k", k), ("v", v)):  # what TMA needs
        if t.stride(2) != 1 or any(s * t.element_size() % 16 for s in t.stride()[:2]) or t.data_ptr() % 16:
            return (f"{name} needs a contiguous last dimension, 16-byte aligned strides and start (TMA); "
                    f"got strides {t.stride()}")
    return None


def _heads_major(t: torch.Tensor, block_rows: int) -> TensorDescriptor:
    """A descriptor over (tokens, heads, d) viewed as (1, heads, tokens, d): the dense kernel's
    4-D layout with one batch, so its key loop reads packed keys unchanged."""
    view = t.unsqueeze(0).transpose(1, 2)
    return TensorDescriptor.from_tensor(view, [1, 1, block_rows, t.shape[2]])


def default_config(head_dim: int, dtype: torch.dtype) -> dict:
    """For 2-byte types, the dense kernel's first (swept fastest) tile for this head dim.
    fp32 tiles take twice the shared memory, (BLOCK_M + 2 * stages * BLOCK_N) * d * 4 bytes:
    hd 128's 128 x 128 x 3 stages would need 448 KB of the H100's 228, so fp32 (a checking
    precision, on CUDA cores) takes small tiles that fit: at most 160 KB at hd 256."""
    if dtype == torch.float32:
        return {"BLOCK_M": 64 if head_dim <= 128 else 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    tuned = CONFIGS[max(head_dim, 64)][0]
    return {**tuned.kwargs, "num_warps": tuned.num_warps, "num_stages": tuned.num_stages}


def flash_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *,
                           causal: bool = False, scale: float | None = None, out: torch.Tensor | None = None,
                           check_lengths: bool = True, config: dict | None = None, bottom_right: bool = False
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, LSE) for packed sequences: q (total_q, H, d), k and v (total_k, Hkv, d), Hkv dividing H,
    sequence b in rows cu_seqlens_q[b]:cu_seqlens_q[b+1] of q and cu_seqlens_k[b]:cu_seqlens_k[b+1]
    of k and v (int32, (batch + 1,), from 0).

    O is (total_q, H, d) in q's dtype, written into `out` if given (any strides with a
    contiguous last dimension); LSE is fp32 (H, total_q), the natural log of each row's
    softmax denominator (flash-attn's varlen layout). `check_lengths=False` skips reading the
    cu_seqlens on the host (no sync, e.g. inside a CUDA graph): the caller then vouches for
    them. `bottom_right` aligns the causal mask to the last key: query i of a sequence
    sees keys up to i + len_k - len_q (flash-attn's convention since 2.1; the default is
    SDPA's top-left). `config` (BLOCK_M, BLOCK_N, num_warps, num_stages) replaces the default tile; the
    CPU tests run small ones under the Triton interpreter.
    """
    scale = check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                                check_lengths=check_lengths)
    limitation = kernel_limitation(q, k, v, cu_seqlens_q.numel() - 1)
    if limitation:
        raise ValueError(limitation)
    total_q, heads, dim = q.shape
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(2) != 1:
        raise ValueError(f"out must be {q.dtype} {tuple(q.shape)} on {q.device} with a contiguous last dimension, "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device} with strides {out.stride()}")
    lse = torch.empty((heads, total_q), dtype=torch.float32, device=q.device)
    if total_q == 0 or max_seqlen_q == 0:
        return out, lse
    if k.shape[0] == 0:  # no sequence has a key (nothing for a descriptor to cover)
        return out.zero_(), lse.fill_(float("-inf"))
    if config is None:
        config = default_config(dim, q.dtype) if q.is_cuda else INTERPRETER_CONFIG
    block_m, block_n = config["BLOCK_M"], config["BLOCK_N"]
    grid = (triton.cdiv(max_seqlen_q, block_m), heads, cu_seqlens_q.numel() - 1)
    flash_varlen_kernel[grid](
        _heads_major(q, block_m), _heads_major(k, block_n), _heads_major(v, block_n), out, lse,
        cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), out.stride(0), out.stride(1), total_q,
        heads // k.shape[1], scale * LOG2E,
        HEAD_DIM=dim, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=bool(causal),
        BOTTOM_RIGHT=bool(causal and bottom_right),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=config.get("num_warps", 4), num_stages=config.get("num_stages", 2))
    return out, lse

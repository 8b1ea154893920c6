"""DeepSeek Sparse Attention (DSA, DeepSeek-V3.2) at decode: a lightning indexer scores every
past token for each query token, the top k are kept, and MLA attends only to those.

The indexer has its own small heads (V3.2: 64 heads of 128 dims, FP8) and one key per token,
k_idx,t (128 dims, FP8 with one scale per token), cached beside the latent. For query token i of
request b, the index score of token t is

    I[b, i, t] = k_scale[t] * sum_j w[b, i, j] * relu(q_idx[b, i, j] . k_idx[t]),   t < limit(b, i),

where w folds the per-head gate, the query's FP8 scales and the softmax scale together (the
caller's job, as in DeepSeek's model code), and limit(b, i) is MLA decode's causal limit
(n_b - s_q + i + 1, or n_b without `causal`). Tokens past the limit score -inf. The top k of
each row (k = 2048 in V3.2) become the query token's index list, padded with -1 when fewer
than k tokens are visible; every head of that query token attends to the same list.

Sparse MLA is `decode.py`'s attention with the token loop replaced by the index list:

    out[b, i, h] = sum_{t in S(b, i)} softmax_t(scale * q[b, i, h] . K_t) V_t,   S(b, i) = the valid indices,

so its work is 2 x (576 + 512) FLOPs and 576 cached values per (row, selected token): at k =
2048 of a 128k context, 1/64 of dense MLA's. The indexer pays for that: 2 x 128 FLOPs per
(index head, past token) and 128 bytes (FP8) + 4 (scale) per past token, once per query token.
Which side wins, by context length, is for the GPU to say (`kforge bench mla` does not time
DSA yet).

Kernels (Triton):
- `indexer_kernel`: one program per (request, query token, block of BLOCK_N tokens): the query
  token's index heads [H_I, D_I] against BLOCK_N keys gathered through the block table in one
  tl.dot, ReLU, the weighted sum over heads, the token's scale. Scores are fp32.
- `sparse_decode_kernel`: one program per (request, query token, block of BLOCK_M heads, split
  of the index list): the index tile is loaded first, each valid index (0 <= t < n_b) names a
  page and a slot, and the gathered rows feed the same two dots and online softmax as dense
  decode. Splits of the list write partials that `decode.mla_decode_combine_kernel` merges (the
  list's length plays the context length). With PAGED off it reads a contiguous kv instead (row
  t at t x the row stride, no block table, no lengths): `sparse_prefill.py` runs DSA's prefill
  that way, each prompt token a request of one token, through `launch_sparse_mla`.
The top-k between them is `torch.topk` (on the GPU for GPU tensors): ties are broken as it
breaks them, so tests compare the selected scores, not the order of equal ones.
Its plan is dense decode's (`decode.plan_mla_decode`); on the H200 at 2,048 indices it takes
141 us at batch 128 and 16 heads and 515 us at 128 heads (mla-decode-sweep.txt, part 5).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kforge.device import sm_count
from kforge.kernels.mla.decode import (H100_SMS, LOG2E, MAX_COMBINE_BLOCK, PAGE_SIZES, _empty, check_mla_inputs,
                                       check_mla_table_values, mla_decode_combine_kernel, plan_mla_decode)

INDEX_DTYPES = (torch.float8_e4m3fn, torch.bfloat16, torch.float16, torch.float32)
# How far the FP8 indexer's scores may sit from float64, relative to the largest: each FP8 q.k
# product is exact in fp32, but Hopper's FP8 wgmma keeps only about 14 bits of its running sum
# (the DeepSeek-V3 report, section 3.3.2). Measured on an H200 (2026-11-28): 1e-4 to 2e-4.
# Under the interpreter the sums are exact fp32 (error below 1e-6).
FP8_INDEX_ERROR = 1e-3


@triton.jit
def indexer_kernel(q_ptr, w_ptr, k_ptr, k_scale_ptr, block_table_ptr, seqlens_ptr, scores_ptr,
                   stride_qb, stride_qs, stride_qh, stride_wb, stride_ws, stride_kp, stride_kt,
                   stride_sp, stride_table, stride_out_b, stride_out_s,
                   s_q, max_pages, max_tokens,
                   H_I: tl.constexpr, D_I: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
                   CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr):
    request = tl.program_id(0) // s_q
    token = tl.program_id(0) % s_q  # the query token i of s_q
    length = tl.minimum(tl.load(seqlens_ptr + request), max_pages * PAGE_SIZE)
    limit = length - s_q + token + 1 if CAUSAL else length

    heads = tl.arange(0, H_I)
    offs_d = tl.arange(0, D_I)
    q_row = q_ptr + request.to(tl.int64) * stride_qb + token * stride_qs
    q = tl.load(q_row + heads[:, None] * stride_qh + offs_d[None, :])  # [H_I, D_I]
    w = tl.load(w_ptr + request.to(tl.int64) * stride_wb + token * stride_ws + heads)  # [H_I] fp32

    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    visible = offs_n < limit
    page = tl.load(block_table_ptr + request.to(tl.int64) * stride_table + offs_n // PAGE_SIZE, mask=visible,
                   other=0).to(tl.int64)
    slot = offs_n % PAGE_SIZE
    k = tl.load(k_ptr + page[:, None] * stride_kp + slot[:, None] * stride_kt + offs_d[None, :],
                mask=visible[:, None], other=0.0)  # [BLOCK_N, D_I]
    logits = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [H_I, BLOCK_N], fp32
    score = tl.sum(tl.maximum(logits, 0.0) * w[:, None], 0)
    score *= tl.load(k_scale_ptr + page * stride_sp + slot, mask=visible, other=0.0)
    out = scores_ptr + request.to(tl.int64) * stride_out_b + token * stride_out_s + offs_n
    tl.store(out, tl.where(visible, score, float("-inf")), mask=offs_n < max_tokens)


@triton.jit
def sparse_decode_kernel(
        q_ptr, cache_ptr, block_table_ptr, seqlens_ptr, index_ptr, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
        stride_qb, stride_qs, stride_qh, stride_cp, stride_ct, stride_table, stride_ib, stride_is,
        h_q, s_q, max_pages, topk, num_splits, split_size, qk_scale,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_V: tl.constexpr, D_ROPE: tl.constexpr,
        PAGE_SIZE: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, PAGED: tl.constexpr = True):
    m_blocks = tl.cdiv(h_q, BLOCK_M)
    query = tl.program_id(0) // m_blocks  # (request, query token), flattened
    request = query // s_q
    token = query % s_q
    heads = (tl.program_id(0) % m_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    real = heads < h_q
    split = tl.program_id(1)
    length = max_pages * PAGE_SIZE  # unpaged: the kv's rows, as pages of one token
    if PAGED:
        length = tl.minimum(tl.load(seqlens_ptr + request), length)
    start = split * split_size
    end = tl.minimum(start + split_size, topk)

    offs_v = tl.arange(0, D_V)
    offs_r = tl.arange(0, D_ROPE)
    q_rows = q_ptr + request.to(tl.int64) * stride_qb + token * stride_qs + heads * stride_qh
    q_nope = tl.load(q_rows[:, None] + offs_v[None, :], mask=real[:, None], other=0.0)
    q_rope = tl.load(q_rows[:, None] + D_V + offs_r[None, :], mask=real[:, None], other=0.0)
    table = block_table_ptr + request.to(tl.int64) * stride_table
    indices = index_ptr + request.to(tl.int64) * stride_ib + token * stride_is

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_V], tl.float32)
    for tile in range(start, end, BLOCK_N):
        offs_n = tile + tl.arange(0, BLOCK_N)
        picked = tl.load(indices + offs_n, mask=offs_n < end, other=-1)
        valid = (picked >= 0) & (picked < length)  # -1 pads the list; a bad index reads nothing
        if PAGED:
            page = tl.load(table + picked // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
            token_rows = cache_ptr + page * stride_cp + (picked % PAGE_SIZE) * stride_ct
        else:
            token_rows = cache_ptr + picked.to(tl.int64) * stride_ct
        kv = tl.load(token_rows[:, None] + offs_v[None, :], mask=valid[:, None], other=0.0)  # K's first 512 and V
        k_rope = tl.load(token_rows[:, None] + D_V + offs_r[None, :], mask=valid[:, None], other=0.0)
        s = tl.dot(q_nope, tl.trans(kv), input_precision=DOT_PRECISION)
        s = tl.dot(q_rope, tl.trans(k_rope), s, input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing valid yet
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(kv.dtype), kv, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    seen = l_i > 0.0
    out = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
    lse2 = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    flat = query * h_q + heads  # (request, query token, head), as decode.py lays rows out
    if SPLIT:
        partial = flat.to(tl.int64) * num_splits + split
        tl.store(part_lse_ptr + partial, lse2, mask=real)
        tl.store(part_out_ptr + partial[:, None] * D_V + offs_v[None, :], out, mask=real[:, None])
    else:
        tl.store(out_ptr + flat.to(tl.int64)[:, None] * D_V + offs_v[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=real[:, None])
        tl.store(lse_ptr + (request * h_q + heads) * s_q + token, lse2 * 0.6931471805599453, mask=real)  # x ln 2


# --- the indexer and the selection ------------------------------------------------------------------

def check_indexer_inputs(q_idx: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor, k_scale: torch.Tensor,
                         block_table: torch.Tensor, cache_seqlens: torch.Tensor) -> None:
    """Raise ValueError on what `index_scores` cannot take (shapes, dtypes, devices, strides)."""
    if q_idx.dim() != 4:
        raise ValueError(f"q_idx must be 4-D (batch, s_q, index_heads, index_dim), got {tuple(q_idx.shape)}")
    batch, s_q, heads, dim = q_idx.shape
    if k_cache.dim() != 3 or k_cache.shape[2] != dim:
        raise ValueError(f"k_cache must be (num_pages, page_size, index_dim={dim}), got {tuple(k_cache.shape)}")
    num_pages, page_size, _ = k_cache.shape
    if k_scale.shape != (num_pages, page_size) or k_scale.dtype != torch.float32:
        raise ValueError(f"k_scale must be fp32 (num_pages={num_pages}, page_size={page_size}), one scale a token; "
                         f"got {k_scale.dtype} {tuple(k_scale.shape)}")
    if weights.shape != (batch, s_q, heads) or weights.dtype != torch.float32:
        raise ValueError(f"weights must be fp32 (batch={batch}, s_q={s_q}, index_heads={heads}), got {weights.dtype} "
                         f"{tuple(weights.shape)}")
    for name, value in (("index_heads", heads), ("index_dim", dim)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 16 (DeepSeek-V3.2: 64 heads of 128), got {value}")
    if q_idx.dtype != k_cache.dtype or q_idx.dtype not in INDEX_DTYPES:
        raise ValueError(f"q_idx and k_cache must share one dtype of float8_e4m3fn, bfloat16, float16, float32; got "
                         f"{q_idx.dtype} and {k_cache.dtype}")
    if page_size not in PAGE_SIZES:
        raise ValueError(f"page_size {page_size} is not supported (supported: {', '.join(map(str, PAGE_SIZES))})")
    if block_table.dim() != 2 or block_table.shape[0] != batch or block_table.shape[1] == 0:
        raise ValueError(f"block_table must be (batch={batch}, max_pages >= 1), got {tuple(block_table.shape)}")
    if cache_seqlens.shape != (batch,) or block_table.dtype != torch.int32 or cache_seqlens.dtype != torch.int32:
        raise ValueError(f"block_table and cache_seqlens (batch={batch},) must be int32, got {block_table.dtype} "
                         f"{tuple(block_table.shape)} and {cache_seqlens.dtype} {tuple(cache_seqlens.shape)}")
    if q_idx.stride(3) != 1 or k_cache.stride(2) != 1 or k_scale.stride(1) != 1 or weights.stride(2) != 1:
        raise ValueError("q_idx, k_cache, k_scale and weights need a contiguous last dim")
    if block_table.stride(1) != 1 or cache_seqlens.stride(0) != 1:
        raise ValueError("block_table rows and cache_seqlens must be contiguous")
    devices = {t.device for t in (q_idx, weights, k_cache, k_scale, block_table, cache_seqlens)}
    if len(devices) != 1:
        raise ValueError(f"the inputs are on different devices: {sorted(map(str, devices))}")


def index_scores(q_idx: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor, k_scale: torch.Tensor,
                 block_table: torch.Tensor, cache_seqlens: torch.Tensor, *, causal: bool = False,
                 validate: bool = True, block_n: int = 64) -> torch.Tensor:
    """The lightning indexer's scores (batch, s_q, max_pages x page_size) fp32, -inf past each
    query token's limit, of q_idx (batch, s_q, index_heads, index_dim) and per-head weights
    (batch, s_q, index_heads) fp32 over the paged index keys k_cache (num_pages, page_size,
    index_dim) with per-token scales k_scale (num_pages, page_size) fp32 (module docstring)."""
    check_indexer_inputs(q_idx, weights, k_cache, k_scale, block_table, cache_seqlens)
    batch, s_q, heads, dim = q_idx.shape
    num_pages, page_size, _ = k_cache.shape
    if validate:
        check_mla_table_values(block_table, cache_seqlens, num_pages, page_size)
    max_pages = block_table.shape[1]
    max_tokens = max_pages * page_size
    scores = _empty((batch, s_q, max_tokens), torch.float32, q_idx.device)
    if batch == 0:
        return scores
    grid = (batch * s_q, triton.cdiv(max_tokens, block_n))
    indexer_kernel[grid](
        q_idx, weights, k_cache, k_scale, block_table, cache_seqlens, scores,
        q_idx.stride(0), q_idx.stride(1), q_idx.stride(2), weights.stride(0), weights.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_scale.stride(0), block_table.stride(0),
        scores.stride(0), scores.stride(1), s_q, max_pages, max_tokens,
        H_I=heads, D_I=dim, BLOCK_N=block_n, PAGE_SIZE=page_size, CAUSAL=bool(causal),
        DOT_PRECISION="ieee" if q_idx.dtype == torch.float32 else "tf32", num_warps=4)
    return scores


def select_topk(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """The top `topk` token indices (batch, s_q, topk) int32 of each row of `scores`, -1 where a
    row has fewer visible (finite) tokens. Ties: as torch.topk breaks them."""
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
    kept = min(topk, scores.shape[-1])
    values, indices = torch.topk(scores, kept, dim=-1)
    indices = torch.where(values == float("-inf"), -1, indices).int()
    if kept < topk:
        indices = torch.nn.functional.pad(indices, (0, topk - kept), value=-1)
    return indices


def index_scores_reference(q_idx, weights, k_cache, k_scale, block_table, cache_seqlens, *,
                           causal: bool = False) -> torch.Tensor:
    """The definition in float64, request by request: gather the request's keys in token order,
    score every visible token. Shaped as `index_scores`'s, -inf where not visible."""
    batch, s_q, _, dim = q_idx.shape
    page_size = k_cache.shape[1]
    max_tokens = block_table.shape[1] * page_size
    scores = torch.full((batch, s_q, max_tokens), float("-inf"), dtype=torch.float64, device=q_idx.device)
    for b in range(batch):
        n = int(cache_seqlens[b])
        if n == 0:
            continue
        pages = block_table[b, :math.ceil(n / page_size)].long()
        keys = k_cache[pages].reshape(-1, dim)[:n].double()
        scale = k_scale[pages].reshape(-1)[:n].double()
        logits = torch.einsum("shd,td->sht", q_idx[b].double(), keys).clamp_min(0)  # (s_q, heads, n)
        row = torch.einsum("sht,sh->st", logits, weights[b].double()) * scale
        for i in range(s_q):
            seen = max(0, n - s_q + i + 1) if causal else n
            scores[b, i, :seen] = row[i, :seen]
    return scores


# --- sparse MLA ---------------------------------------------------------------------------------------

def check_sparse_indices(indices: torch.Tensor, batch: int, s_q: int) -> int:
    """Raise ValueError unless indices is int32 (batch, s_q, topk >= 1) with contiguous rows; return topk."""
    if indices.dim() != 3 or indices.shape[:2] != (batch, s_q) or indices.shape[2] == 0:
        raise ValueError(f"indices must be (batch={batch}, s_q={s_q}, topk >= 1), got {tuple(indices.shape)}")
    if indices.dtype != torch.int32 or indices.stride(2) != 1:
        raise ValueError(f"indices must be int32 with contiguous rows, got {indices.dtype} strides {indices.stride()}")
    return indices.shape[2]


def sparse_mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                      cache_seqlens: torch.Tensor, indices: torch.Tensor, head_dim_v: int = 512, *,
                      softmax_scale: float | None = None, validate: bool = True,
                      config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (batch, s_q, h_q, head_dim_v) in q's dtype, lse (batch, h_q, s_q) fp32): MLA decode
    (`decode.mla_decode`'s inputs) over only the tokens `indices` (batch, s_q, topk) int32 lists
    for each query token; -1, and any index outside [0, cache_seqlens[b]), is skipped. A query
    token with no valid index gets out = 0 and lse = -inf. `config` fixes the tiling and the
    splits, as for `decode.plan_mla_decode`."""
    scale = check_mla_inputs(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale)
    batch, s_q, h_q, _ = q.shape
    check_sparse_indices(indices, batch, s_q)
    num_pages, page_size, _, _ = kv_cache.shape
    if indices.device != q.device:
        raise ValueError(f"indices are on {indices.device}, q on {q.device}")
    if validate:
        check_mla_table_values(block_table, cache_seqlens, num_pages, page_size)
    out = _empty((batch, s_q, h_q, head_dim_v), q.dtype, q.device)
    lse = _empty((batch, h_q, s_q), torch.float32, q.device)
    launch_sparse_mla(q, q.stride()[:3], kv_cache, kv_cache.stride()[:2], block_table, cache_seqlens, indices,
                      indices.stride()[:2], out, lse, requests=batch, s_q=s_q, max_pages=block_table.shape[1],
                      page_size=page_size, scale=scale, config=config, paged=True)
    return out, lse


def launch_sparse_mla(q, q_strides, kv, kv_strides, block_table, cache_seqlens, indices, index_strides, out, lse, *,
                      requests: int, s_q: int, max_pages: int, page_size: int, scale: float, config: dict | None,
                      paged: bool) -> None:
    """`sparse_decode_kernel` (and the combine, if the lists are split) on checked inputs, writing
    out (requests, s_q, h_q, head_dim_v) and lse (requests, h_q, s_q), both contiguous. The strides
    are q's (request, token, head), kv's (page, slot) and the index list's (request, token).
    `paged` False: kv is one contiguous run of max_pages rows (page_size 1) every request reads,
    and block_table and cache_seqlens are not read (`sparse_prefill.sparse_mla_prefill`)."""
    h_q, head_dim = q.shape[-2:]
    head_dim_v, topk = out.shape[-1], indices.shape[-1]
    if requests == 0:
        return
    num_sms = sm_count(q.device) if q.is_cuda else H100_SMS
    # dense decode's plan, with each query token's heads as the rows and its index list as the context
    plan = plan_mla_decode(requests * s_q, h_q, topk, num_sms, config, q.element_size())
    rows = s_q * h_q
    if plan.split:
        part_out = _empty((requests, rows, plan.num_splits, head_dim_v), torch.float32, q.device)
        part_lse = _empty((requests, rows, plan.num_splits), torch.float32, q.device)
    else:
        part_out = part_lse = out  # not touched without SPLIT
    grid = (requests * s_q * triton.cdiv(h_q, plan.block_m), plan.num_splits)
    sparse_decode_kernel[grid](
        q, kv, block_table, cache_seqlens, indices, out, lse, part_out, part_lse,
        *q_strides, *kv_strides, block_table.stride(0), *index_strides, h_q, s_q, max_pages, topk,
        plan.num_splits, plan.split_size, scale * LOG2E, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
        D_V=head_dim_v, D_ROPE=head_dim - head_dim_v, PAGE_SIZE=page_size, SPLIT=plan.split,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", PAGED=paged,
        num_warps=plan.num_warps, num_stages=plan.num_stages)
    if plan.split:
        # every split of the list was written: the list's length stands in for the context's
        written = torch.full((requests,), topk, dtype=torch.int32, device=q.device)
        mla_decode_combine_kernel[(requests * rows,)](
            part_out, part_lse, written, out, lse, h_q, s_q, topk, plan.num_splits, plan.split_size, written,
            D_V=head_dim_v, BLOCK_S=min(MAX_COMBINE_BLOCK, triton.next_power_of_2(plan.num_splits)), num_warps=4)


def sparse_mla_decode_reference(q, kv_cache, block_table, cache_seqlens, indices, head_dim_v: int = 512, *,
                                softmax_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition in float64: each query token's valid indices gathered from the pool, plain
    attention of its heads over those rows. Shaped as `sparse_mla_decode`'s."""
    batch, s_q, h_q, head_dim = q.shape
    page_size = kv_cache.shape[1]
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
    out = torch.zeros(batch, s_q, h_q, head_dim_v, dtype=torch.float64, device=q.device)
    lse = torch.full((batch, h_q, s_q), float("-inf"), dtype=torch.float64, device=q.device)
    for b in range(batch):
        n = int(cache_seqlens[b])
        for i in range(s_q):
            picked = indices[b, i].long()
            picked = picked[(picked >= 0) & (picked < n)]
            if len(picked) == 0:
                continue
            pages = block_table[b, picked // page_size].long()
            rows = kv_cache[pages, picked % page_size, 0].double()  # (selected, head_dim)
            scores = q[b, i].double() @ rows.T * scale  # (h_q, selected)
            lse[b, :, i] = torch.logsumexp(scores, -1)
            out[b, i] = torch.softmax(scores, -1) @ rows[:, :head_dim_v]
    return out.to(q.dtype), lse.float()


def sparse_mla_flops(indices: torch.Tensor, cache_seqlens: torch.Tensor, h_q: int, head_dim: int = 576,
                     head_dim_v: int = 512) -> int:
    """2 (head_dim + head_dim_v) FLOPs per (head, valid selected token)."""
    valid = (indices >= 0) & (indices < cache_seqlens.view(-1, 1, 1))
    return 2 * (head_dim + head_dim_v) * h_q * int(valid.sum())


def indexer_flops(cache_seqlens, s_q: int, index_heads: int = 64, index_dim: int = 128, causal: bool = False) -> int:
    """2 x index_dim FLOPs per (index head, visible token): the q.k products (the ReLU and the
    weighted sum are lower order)."""
    seen = sum(sum(max(0, min(n, n - s_q + i + 1)) for i in range(s_q)) if causal else s_q * n
               for n in cache_seqlens)
    return 2 * index_dim * index_heads * seen

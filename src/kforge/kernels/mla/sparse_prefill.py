"""DeepSeek Sparse Attention (DSA, DeepSeek-V3.2) at prefill: the lightning indexer over a whole
prompt, and sparse MLA over each prompt token's selected tokens, FlashMLA's sparse prefill
contract. `sparse.py` has the decode side and the definitions; this is the same math with the
query tokens of one sequence in place of a batch of requests.

Inputs: a prompt of s_q tokens appended after s_kv - s_q cached ones, so the keys are s_kv rows,
not paged: the latent kv (s_kv, 1, 576) and the index keys k (s_kv, D_I) with one fp32 scale
each. Query token i is token q_offset + i of the sequence (q_offset = s_kv - s_q by default), so
under the causal rule it sees the tokens below

    limit(i) = q_offset + i + 1,

and its index score of token t is `sparse.py`'s

    I[i, t] = k_scale[t] * sum_j w[i, j] * relu(q_idx[i, j] . k[t]),   t < limit(i),  else -inf.

`sparse.select_topk` keeps the top k of each row (k = 2048 in V3.2; -1 where fewer are visible),
and every head of query token i attends to that list S(i):

    out[i, h] = sum_{t in S(i)} softmax_t(scale * q[i, h] . K_t) V_t,   K_t = kv[t] (576), V_t = kv[t, :512],
    lse[i, h] = log sum_{t in S(i)} exp(scale * q[i, h] . K_t)      (natural log, fp32),

skipping -1 and any index outside [0, s_kv); a token with no valid index gets out = 0 and
lse = -inf. Shapes as FlashMLA's `flash_mla_sparse_fwd`: q (s_q, h_q, 576), indices
(s_q, 1, topk) int32 (one kv head), out (s_q, h_q, 512) in q's dtype, lse (s_q, h_q).

Work, for a prompt of s tokens with s_kv = s (no cache), V3.2's shapes (h_q 128, 64 index heads
of 128, k = 2048):
- the indexer: 2 x 128 x 64 FLOPs per visible (query, key) pair, s^2 / 2 pairs under the causal
  rule: 8192 s^2 FP8 FLOPs (8.8 TFLOP at 32k). It writes the whole s_q x s_kv fp32 score matrix
  (4.3 GB at 32k, the -inf half included: `select_topk` reads full rows): 0.9 ms at 4.8 TB/s
  (H200), a fifth of the 4.5 ms its FLOPs take at the FP8 peak (1979 TFLOP/s); an indexer that
  kept each row's top k as it went would not write it. `select_topk_prefill` bounds the matrix's
  memory instead (chunks of query tokens, 1 GiB of scores at a time; 69 GB whole at 128k).
- the attention: 2 x (576 + 512) FLOPs per (head, selected token), a constant 570 MFLOP a query
  token once k tokens are visible (18.7 TFLOP at 32k), on 1152 bytes a gathered row, gathered
  once per block of 64 heads; the whole latent of a 32k prompt (38 MB) fits in the H100's 50 MB
  of L2, so most gathers can be L2 hits.
- dense causal prefill, as DeepSeek-V3 runs it (unabsorbed: per-head keys of 192 and values of
  128 from the latent): 2 x (192 + 128) x 128 FLOPs per visible pair, 40960 s^2 (44 TFLOP at
  32k). Counting an FP8 FLOP as a bf16 one, DSA (8192 s^2 + 570M s) costs less from s ~ 17k on;
  what the kernels make of it is the GPU's to say (`scripts/dsa_sweep.py prefill`).

Kernels (Triton):
- `prefill_indexer_kernel`: one program per (tile of BLOCK_Q query tokens, split of the keys).
  The tile's BLOCK_Q x H_I index heads are the rows of one [BLOCK_Q H_I, D_I] x [D_I, BLOCK_N]
  tl.dot per key tile, so each key tile is read once per BLOCK_Q query tokens (not once per
  token, as the decode kernel reads it); ReLU, the weights, then the sum over each token's
  heads as a reshape to [BLOCK_Q, H_I, BLOCK_N] and a sum. Key tiles wholly past the tile's
  last limit are not scored, only written -inf. The longest (last) query tiles start first, so
  the short ones fill the tail. Splits of the keys bring a short prompt over a long cache to
  about two programs an SM.
- the attention is `sparse.sparse_decode_kernel` with PAGED off: each query token is a request
  of one token, every request reads the same contiguous kv (row t at t x its row stride), and
  the lengths and block table are not read; the split plan and the combine are dense decode's.

Tiles for the H100 (compiled offline for sm_90 by Triton 3.6, FP8 index, 64 heads of 128; see
`tests/kernels/test_mla_sparse_prefill.py`): BLOCK_Q = 4 (256 rows a dot), BLOCK_N = 64, 8
warps, 2 stages: 119 registers a thread, 52 KB of shared memory, no spills, QGMMA (FP8 wgmma);
4 warps take 211 registers, 8 query tokens 208 (88 KB). A bf16 index: 116 registers, 100 KB,
HGMMA. fp32 inputs (a check, not a speed) take ieee FMA dots that spill at any of these tiles.
The attention at 64 heads a block is the decode kernel's tiling, unpaged: HGMMA, no spills, 255
registers unsplit and 233 split. Its GPU tests pass on the H200; its speed against a dense
causal prefill is in benchmarks/results/nvidia-h200/dsa-sweep.txt.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kforge.device import sm_count
from kforge.kernels.mla.decode import DTYPES, H100_SMS, PROGRAMS_PER_SM, _empty
from kforge.kernels.mla.sparse import INDEX_DTYPES, launch_sparse_mla, select_topk


@triton.jit
def prefill_indexer_kernel(q_ptr, w_ptr, k_ptr, k_scale_ptr, scores_ptr,
                           stride_qs, stride_qh, stride_ws, stride_kt, stride_out,
                           s_q, s_kv, q_offset, split_size,
                           H_I: tl.constexpr, D_I: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
                           CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr):
    q_tile = tl.num_programs(0) - 1 - tl.program_id(0)  # the last tiles see the most keys: start them first
    key_start = tl.program_id(1) * split_size
    key_end = tl.minimum(key_start + split_size, s_kv)

    rows = tl.arange(0, BLOCK_Q * H_I)  # (query token, index head), token-major
    token_of_row = q_tile * BLOCK_Q + rows // H_I
    row_live = token_of_row < s_q
    offs_d = tl.arange(0, D_I)
    q_rows = q_ptr + token_of_row.to(tl.int64) * stride_qs + (rows % H_I) * stride_qh
    q = tl.load(q_rows[:, None] + offs_d[None, :], mask=row_live[:, None], other=0.0)  # [BLOCK_Q H_I, D_I]
    w = tl.load(w_ptr + token_of_row.to(tl.int64) * stride_ws + rows % H_I, mask=row_live, other=0.0)

    tokens = q_tile * BLOCK_Q + tl.arange(0, BLOCK_Q)
    if CAUSAL:
        limit = q_offset + tokens + 1
        scored_end = tl.minimum(key_end, q_offset + tl.minimum(q_tile * BLOCK_Q + BLOCK_Q, s_q))  # the widest limit
    else:
        limit = tl.zeros([BLOCK_Q], tl.int32) + s_kv
        scored_end = key_end
    out_rows = scores_ptr + tokens.to(tl.int64) * stride_out
    token_live = tokens < s_q
    for tile in range(key_start, scored_end, BLOCK_N):
        offs_n = tile + tl.arange(0, BLOCK_N)
        loaded = offs_n < scored_end
        k = tl.load(k_ptr + offs_n.to(tl.int64)[:, None] * stride_kt + offs_d[None, :], mask=loaded[:, None],
                    other=0.0)  # [BLOCK_N, D_I]
        logits = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_Q H_I, BLOCK_N], fp32
        weighted = tl.maximum(logits, 0.0) * w[:, None]
        score = tl.sum(tl.reshape(weighted, [BLOCK_Q, H_I, BLOCK_N]), 1)  # each token's heads summed
        score *= tl.load(k_scale_ptr + offs_n, mask=loaded, other=0.0)[None, :]
        visible = offs_n[None, :] < limit[:, None]
        tl.store(out_rows[:, None] + offs_n[None, :], tl.where(visible, score, float("-inf")),
                 mask=token_live[:, None] & (offs_n < key_end)[None, :])
    # the rest of the split is past every limit of the tile: written, not scored
    hidden_start = key_start + tl.cdiv(tl.maximum(scored_end - key_start, 0), BLOCK_N) * BLOCK_N
    for tile in range(hidden_start, key_end, BLOCK_N):
        offs_n = tile + tl.arange(0, BLOCK_N)
        tl.store(out_rows[:, None] + offs_n[None, :], tl.full([BLOCK_Q, BLOCK_N], float("-inf"), tl.float32),
                 mask=token_live[:, None] & (offs_n < key_end)[None, :])


# --- the indexer ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class PrefillIndexerPlan:
    """How `index_scores_prefill` tiles: BLOCK_Q query tokens and BLOCK_N keys a dot, the keys cut
    into `num_splits` splits of `split_size` (a multiple of block_n)."""

    block_q: int
    block_n: int
    split_size: int
    num_splits: int
    num_warps: int = 8
    num_stages: int = 2


def plan_prefill_indexer(s_q: int, s_kv: int, num_sms: int = H100_SMS,
                         config: dict | None = None) -> PrefillIndexerPlan:
    """Tiles (module docstring) and as many key splits as bring the grid to ~2 programs an SM.
    `config` (BLOCK_Q, BLOCK_N, split_size, num_warps, num_stages, each optional) overrides."""
    config = dict(config or {})
    block_q, block_n = config.pop("BLOCK_Q", 4), config.pop("BLOCK_N", 64)
    for name, value, least in (("BLOCK_Q", block_q, 1), ("BLOCK_N", block_n, 16)):
        if value < least or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= {least}, got {value}")
    if "split_size" in config:
        split_size = config.pop("split_size")
    else:
        key_tiles = max(1, math.ceil(s_kv / block_n))
        wanted = math.ceil(PROGRAMS_PER_SM * num_sms / max(1, math.ceil(s_q / block_q)))
        split_size = math.ceil(key_tiles / min(wanted, key_tiles)) * block_n
    num_warps, num_stages = config.pop("num_warps", 8), config.pop("num_stages", 2)
    if config:
        raise ValueError(f"unknown config keys {sorted(config)}: use BLOCK_Q, BLOCK_N, split_size, num_warps, "
                         f"num_stages")
    if split_size < block_n or split_size % block_n:
        raise ValueError(f"split_size must be a positive multiple of BLOCK_N ({block_n}), got {split_size}")
    num_splits = max(1, math.ceil(s_kv / split_size))
    if num_splits > 65535:
        raise ValueError(f"{num_splits} key splits exceed the grid's 65535: use larger splits")
    return PrefillIndexerPlan(block_q, block_n, split_size, num_splits, num_warps, num_stages)


def check_prefill_indexer_inputs(q_idx: torch.Tensor, weights: torch.Tensor, k: torch.Tensor,
                                 k_scale: torch.Tensor, causal: bool, q_offset: int | None) -> int:
    """Raise ValueError on what `index_scores_prefill` cannot take (shapes, dtypes, devices,
    strides, the offset); return the offset of the first query token (0 without `causal`)."""
    if q_idx.dim() != 3:
        raise ValueError(f"q_idx must be 3-D (s_q, index_heads, index_dim), got {tuple(q_idx.shape)}")
    s_q, heads, dim = q_idx.shape
    if k.dim() != 2 or k.shape[1] != dim:
        raise ValueError(f"k must be (s_kv, index_dim={dim}), got {tuple(k.shape)}")
    s_kv = k.shape[0]
    if k_scale.shape != (s_kv,) or k_scale.dtype != torch.float32:
        raise ValueError(f"k_scale must be fp32 (s_kv={s_kv},), one scale a key; got {k_scale.dtype} "
                         f"{tuple(k_scale.shape)}")
    if weights.shape != (s_q, heads) or weights.dtype != torch.float32:
        raise ValueError(f"weights must be fp32 (s_q={s_q}, index_heads={heads}), got {weights.dtype} "
                         f"{tuple(weights.shape)}")
    for name, value in (("index_heads", heads), ("index_dim", dim)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 16 (DeepSeek-V3.2: 64 heads of 128), got {value}")
    if q_idx.dtype != k.dtype or q_idx.dtype not in INDEX_DTYPES:
        raise ValueError(f"q_idx and k must share one dtype of float8_e4m3fn, bfloat16, float16, float32; got "
                         f"{q_idx.dtype} and {k.dtype}")
    if q_idx.stride(2) != 1 or k.stride(1) != 1 or weights.stride(1) != 1 or k_scale.stride(0) != 1:
        raise ValueError("q_idx, k and weights need a contiguous last dim, and k_scale must be contiguous")
    devices = {t.device for t in (q_idx, weights, k, k_scale)}
    if len(devices) != 1:
        raise ValueError(f"the inputs are on different devices: {sorted(map(str, devices))}")
    if not causal:
        if q_offset is not None:
            raise ValueError("q_offset places the query tokens for the causal rule: pass it with causal=True")
        return 0
    offset = s_kv - s_q if q_offset is None else q_offset
    if not 0 <= offset <= s_kv - s_q:
        raise ValueError(f"q_offset must be in [0, s_kv - s_q = {s_kv - s_q}] (query token i is token q_offset + i "
                         f"of k, and its own key must be there), got {offset}")
    return offset


def index_scores_prefill(q_idx: torch.Tensor, weights: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor, *,
                         causal: bool = True, q_offset: int | None = None,
                         config: dict | None = None) -> torch.Tensor:
    """The lightning indexer's scores (s_q, s_kv) fp32 of a prompt's q_idx (s_q, index_heads,
    index_dim) and weights (s_q, index_heads) fp32 over the keys k (s_kv, index_dim) with scales
    k_scale (s_kv,) fp32; -inf at and past limit(i) = q_offset + i + 1 under `causal` (q_offset:
    where the prompt starts in k, default s_kv - s_q). `sparse.select_topk` then picks the lists
    (module docstring); `config` fixes the tiling (`plan_prefill_indexer`)."""
    offset = check_prefill_indexer_inputs(q_idx, weights, k, k_scale, causal, q_offset)
    s_q, heads, dim = q_idx.shape
    s_kv = k.shape[0]
    scores = _empty((s_q, s_kv), torch.float32, q_idx.device)
    if scores.numel() == 0:
        return scores
    num_sms = sm_count(q_idx.device) if q_idx.is_cuda else H100_SMS
    plan = plan_prefill_indexer(s_q, s_kv, num_sms, config)
    grid = (triton.cdiv(s_q, plan.block_q), plan.num_splits)
    prefill_indexer_kernel[grid](
        q_idx, weights, k, k_scale, scores, q_idx.stride(0), q_idx.stride(1), weights.stride(0), k.stride(0),
        scores.stride(0), s_q, s_kv, offset, plan.split_size, H_I=heads, D_I=dim, BLOCK_Q=plan.block_q,
        BLOCK_N=plan.block_n, CAUSAL=bool(causal), DOT_PRECISION="ieee" if q_idx.dtype == torch.float32 else "tf32",
        num_warps=plan.num_warps, num_stages=plan.num_stages)
    return scores


SCORE_BUDGET_BYTES = 1 << 30  # the fp32 scores `select_topk_prefill` holds at once


def select_topk_prefill(q_idx: torch.Tensor, weights: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor,
                        topk: int, *, causal: bool = True, q_offset: int | None = None,
                        budget_bytes: int = SCORE_BUDGET_BYTES, config: dict | None = None) -> torch.Tensor:
    """Each prompt token's top `topk` keys (s_q, topk) int32, -1 where fewer are visible: what
    `sparse.select_topk(index_scores_prefill(...), topk)` gives, in chunks of query tokens whose
    scores fit `budget_bytes`, so a long prompt never holds its whole s_q x s_kv score matrix
    (64 GB at 128k). Under `causal` a chunk scores only the keys its last token sees (its rows'
    -inf tail is never written or read). Each row's scores are the same numbers either way."""
    offset = check_prefill_indexer_inputs(q_idx, weights, k, k_scale, causal, q_offset)
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
    s_q, s_kv = q_idx.shape[0], k.shape[0]
    rows = max(1, budget_bytes // (4 * max(1, s_kv)))
    indices = torch.empty((s_q, topk), dtype=torch.int32, device=q_idx.device)
    for first in range(0, s_q, rows):
        last = min(s_q, first + rows)
        keys = offset + last if causal else s_kv  # the chunk's last token sees keys below offset + last
        scores = index_scores_prefill(q_idx[first:last], weights[first:last], k[:keys], k_scale[:keys],
                                      causal=causal, q_offset=offset + first if causal else None, config=config)
        indices[first:last] = select_topk(scores, topk)
    return indices


def index_scores_prefill_reference(q_idx, weights, k, k_scale, *, causal: bool = True,
                                   q_offset: int | None = None) -> torch.Tensor:
    """The definition in float64, shaped as `index_scores_prefill`'s (no checks: pass what it takes)."""
    s_q, s_kv = q_idx.shape[0], k.shape[0]
    logits = torch.einsum("shd,td->sht", q_idx.double(), k.double()).clamp_min(0)  # (s_q, heads, s_kv)
    scores = torch.einsum("sht,sh->st", logits, weights.double()) * k_scale.double()
    if causal:
        offset = s_kv - s_q if q_offset is None else q_offset
        limit = offset + torch.arange(s_q, device=k.device) + 1
        scores = scores.masked_fill(torch.arange(s_kv, device=k.device)[None, :] >= limit[:, None], float("-inf"))
    return scores


# --- sparse MLA ----------------------------------------------------------------------------------------

def check_sparse_prefill_inputs(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, head_dim_v: int,
                                softmax_scale: float | None) -> float:
    """Raise ValueError on what `sparse_mla_prefill` cannot take (shapes, dtypes, devices,
    strides); return the softmax scale (default 1/sqrt(q's head dim), as `sparse_mla_decode`)."""
    if q.dim() != 3:
        raise ValueError(f"q must be 3-D (s_q, h_q, head_dim), got {tuple(q.shape)}")
    s_q, h_q, head_dim = q.shape
    if kv.dim() != 3 or kv.shape[1] != 1 or kv.shape[2] != head_dim:
        raise ValueError(f"kv must be (s_kv, 1, head_dim={head_dim}): one latent head, got {tuple(kv.shape)}")
    if kv.shape[0] == 0 or h_q == 0:
        raise ValueError(f"nothing to attend with: q {tuple(q.shape)}, kv {tuple(kv.shape)}")
    for name, value in (("head_dim_v", head_dim_v), ("head_dim - head_dim_v", head_dim - head_dim_v)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 16 (DeepSeek: 512 + 64 = 576), got {value}")
    if q.dtype != kv.dtype or q.dtype not in DTYPES:
        raise ValueError(f"q and kv must share one dtype of bfloat16, float16, float32; got {q.dtype} and {kv.dtype}")
    if indices.dim() != 3 or indices.shape[:2] != (s_q, 1) or indices.shape[2] == 0:
        raise ValueError(f"indices must be (s_q={s_q}, 1, topk >= 1): one kv head, got {tuple(indices.shape)}")
    if indices.dtype != torch.int32:
        raise ValueError(f"indices must be int32, got {indices.dtype}")
    if q.stride(2) != 1 or kv.stride(2) != 1 or indices.stride(2) != 1:
        raise ValueError(f"q, kv and indices need a contiguous last dim, got strides {q.stride()}, {kv.stride()} and "
                         f"{indices.stride()}")
    devices = {t.device for t in (q, kv, indices)}
    if len(devices) != 1:
        raise ValueError(f"the inputs are on different devices: {sorted(map(str, devices))}")
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    if not math.isfinite(scale):
        raise ValueError(f"softmax_scale must be finite, got {scale}")
    return scale


def sparse_mla_prefill(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, head_dim_v: int = 512, *,
                       softmax_scale: float | None = None,
                       config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (s_q, h_q, head_dim_v) in q's dtype, lse (s_q, h_q) fp32, natural log) of q (s_q, h_q,
    head_dim) over the rows of the latent kv (s_kv, 1, head_dim) that indices (s_q, 1, topk)
    int32 lists for each query token; -1, and any index outside [0, s_kv), is skipped, and a
    token with no valid index gets out = 0 and lse = -inf. No device read: there is no table to
    validate. `config` fixes the tiling and the splits of the lists (`decode.plan_mla_decode`)."""
    scale = check_sparse_prefill_inputs(q, kv, indices, head_dim_v, softmax_scale)
    s_q, h_q, _ = q.shape
    out = _empty((s_q, h_q, head_dim_v), q.dtype, q.device)
    lse = _empty((s_q, h_q), torch.float32, q.device)
    # each query token is a request of one token; all read the same rows (pages of one, unpaged)
    launch_sparse_mla(q, (q.stride(0), 0, q.stride(1)), kv, (0, kv.stride(0)), indices, indices, indices,
                      (indices.stride(0), 0), out, lse, requests=s_q, s_q=1, max_pages=kv.shape[0], page_size=1,
                      scale=scale, config=config, paged=False)
    return out, lse


def sparse_mla_prefill_reference(q, kv, indices, head_dim_v: int = 512, *,
                                 softmax_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition in float64, token by token: the valid indices' rows gathered, plain
    attention of the token's heads over them. (out in q's dtype, lse fp32), as `sparse_mla_prefill`."""
    s_q, h_q, head_dim = q.shape
    s_kv = kv.shape[0]
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
    out = torch.zeros(s_q, h_q, head_dim_v, dtype=torch.float64, device=q.device)
    lse = torch.full((s_q, h_q), float("-inf"), dtype=torch.float64, device=q.device)
    for i in range(s_q):
        picked = indices[i, 0].long()
        picked = picked[(picked >= 0) & (picked < s_kv)]
        if len(picked) == 0:
            continue
        rows = kv[picked, 0].double()  # (selected, head_dim)
        scores = q[i].double() @ rows.T * scale  # (h_q, selected)
        lse[i] = torch.logsumexp(scores, -1)
        out[i] = torch.softmax(scores, -1) @ rows[:, :head_dim_v]
    return out.to(q.dtype), lse.float()

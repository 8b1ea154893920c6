"""FlashAttention backward in Triton: dQ, dK, dV from the forward's log-sum-exp, no N x N matrix.

The forward (`flash_forward.py`) keeps O and, per query row i, the log-sum-exp
L_i = log sum_j exp(S_ij) in fp32. With S = Q K^T * scale, P = exp(S - L) and O = P V, an
upstream gradient dO (and dL, the gradient of the log-sum-exp output, when the caller used
it) gives, per head:

    dV = P^T dO                               (Nk x d)
    dP = dO V^T                               (Nq x Nk, never stored)
    dS = P o (dP - D),  D_i = rowsum(dO o O)_i - dL_i
    dQ = scale * dS K,  dK = scale * dS^T Q

(o is the elementwise product.) The softmax's Jacobian contributes the row term
sum_j P_ij dP_ij = dO_i . sum_j P_ij V_j = dO_i . O_i: a d-long dot per row instead of an
Nk-long one. dL enters because dL_i/dS_ij = P_ij: it adds P_ij dL_i to dS_ij, which is the
same as taking dL_i off the row term, so the kernels see only D and never dL.

Three kernels:
1. `flash_backward_delta_kernel`: D = rowsum(dO o O) - dL in fp32, one pass over O and dO.
2. `flash_backward_dkdv_kernel`: one program per (BLOCK_N keys, batch, key/value head). It
   keeps K_j and V_j on chip and accumulates dK_j and dV_j in fp32 over the query blocks,
   recomputing P from L instead of reading it: S^T = K_j Q_i^T, P^T = exp2(S^T * scale *
   log2(e) - L_i * log2(e)), then dV_j += P^T dO_i, dP^T = V_j dO_i^T,
   dS^T = P^T o (dP^T - D_i), dK_j += dS^T Q_i; dK_j is scaled once at the end.
3. dQ, one of two ways:
   (a) default: the dK/dV kernel skips dQ and `flash_backward_dq_kernel`, one program per
       (BLOCK_M queries, batch, head), walks the key blocks as the forward does, recomputing
       S, P and dP, and accumulates dQ_i = scale * sum_j dS_ij K_j in registers in a fixed
       order: bit-identical runs, for 7 matmuls a pair of blocks.
   (b) `atomic_dq=True`: the dK/dV kernel also forms scale * dS_ij K_j, the pair's share of
       dQ_i, and adds it into an fp32 buffer with atomics (5 matmuls a pair, the minimum); a
       cast to the input dtype follows. The order in which programs' adds land changes from
       run to run, so dQ's last bits do too. Head dim 256 always takes (a): with the atomic
       product no tile fits the registers (see the configs).
   (b) does the fewest FLOPs but sends Nk/BLOCK_N times dQ's fp32 size through L2 atomics
   (8.6 GB at the target shape below with 64-key blocks). Measured on an H200 (2026-11-28,
   B 8, H 16, N 4096, hd 128, `kforge bench attention --backward`): (a) 372 TFLOP/s full and
   340 causal, (b) 227 and 224: the atomics cost more than two matmuls, so (a) is the default.

Choices, each for the H100:
- The dK/dV loop works on the transposed tiles (S^T, P^T, dS^T: keys by queries), so
  P^T and dS^T are the left operands of dV += P^T dO and dK += dS^T Q straight from
  registers, which wgmma takes (its right operand, Q or dO, comes from shared memory as
  TMA left it). Only the atomic dQ product needs dS non-transposed: one trip through
  shared memory a step.
- Grouped-query attention: the query heads of a group all add into one dK/dV. One program
  takes the whole group, one flat loop over (query head, query block), so the sums stay in
  registers: no atomics and no (B, H, Nk, d) fp32 partials to reduce afterwards. The price
  is a grid Hkv/H as large (at GQA 8, B 4, Hkv 2, N 4096, 64-key blocks: 512 programs, ~4
  waves on 132 SMs) with each program H/Hkv times longer: the same work, coarser. (A loop
  over heads around the query-block loops, the obvious form, spilled on sm_90 at every
  tile tried: the pipeliner's state for two inner loops inside an outer one.)
- P is recomputed as exp2(S * scale * log2(e) - L * log2(e)): one FMA and one MUFU.EX2 a
  score, L read once per query block.
- Causal (top-left, as the forward): for one key block, query blocks above it see none of
  its keys and are skipped (half the work); query blocks from the block's last key on see
  all of it and run a loop with no masks; only the blocks across the diagonal mask. The
  key-block index is the grid's fastest axis, so one head's programs run side by side and
  share its Q, dO, L and D in L2; the first key blocks are the longest (they see every
  query), and they start first.
- Tails: the last key block masks keys past Nk in every query block. (Its zero-filled K
  rows give S = 0 and P = exp(-L), which overflows when a row's scores all lie below -88,
  and inf * 0 would reach dQ.) Query rows past Nq need no mask: TMA fills Q and dO with
  zeros there and L and D load as 0, so those rows have P = 1, dP = 0, dS = 0 and add
  nothing to dK or dV; their dQ rows are never stored.
- Q, K, V, dO and the outputs move through the forward's 4-D TMA descriptors: any strides
  with a contiguous last dimension, reads past the end zero-filled, writes clipped.
- P and dS are rounded to the input dtype before their products, as in the forward and in
  FlashAttention-2 (the tensor cores take bf16/fp16 operands); every sum is fp32.

Work and floor, per head with Nq = Nk = N: the 5 matmuls of a pair of blocks are
5 * 2 N^2 d = 10 N^2 d FLOPs, 2.5x the forward's 4 N^2 d (half of it causal). The
fewest HBM bytes: Q, K, V, O, dO read and dQ, dK, dV written once (8 N d elements, 2 bytes
in bf16), plus L and D (8 bytes a row). At the target shape (B 4, H 16, N 4096, d 128, bf16):
1.37 TFLOP against 0.54 GB, ~2,600 FLOP a byte, far past the H100's ridge (~300): the
floor is the tensor cores, 1.39 ms at the 989 TFLOP/s bf16 dense peak (1.76 ms at the
~780 TFLOP/s a bf16 GEMM reaches), against 0.16 ms of HBM traffic at 3.35 TB/s. 550
TFLOP/s is 2.5 ms. What the kernels move on top of that floor: each dK/dV program rereads
its head's Q, dO, L and D (Nk/BLOCK_N passes, from L2 while the head's programs run
together); the atomic dQ adds BLOCK_M x d fp32 per pair of blocks into L2 (above); the fp32
buffer's zeroing and final cast add ~0.3 GB of HBM traffic (~0.1 ms).

The configs below were chosen by compiling for sm_90 (registers, spills, shared memory), not
by timing, and the autotuner picks among them; measured on an H200 (docs/attention.md): the
dQ-kernel path at 372 TFLOP/s (full) and 340 (causal) at B 8, H 16, N 4096, hd 128.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kforge.kernels.attention.flash_forward import check_attention_inputs, key_range, tma_compatible


@triton.jit
def flash_backward_delta_kernel(o_desc, do_desc, grad_lse_ptr, delta_ptr, n_q, heads,
                                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, HAS_GRAD_LSE: tl.constexpr):
    """D_i = rowsum(dO_i o O_i) - dL_i in fp32, BLOCK_M rows of one head a program."""
    start_m = tl.program_id(0) * BLOCK_M
    batch_head = tl.program_id(1)
    batch, head = batch_head // heads, batch_head % heads
    offs_m = start_m + tl.arange(0, BLOCK_M)
    in_rows = offs_m < n_q
    o = o_desc.load([batch, head, start_m, 0]).reshape(BLOCK_M, HEAD_DIM).to(tl.float32)
    do = do_desc.load([batch, head, start_m, 0]).reshape(BLOCK_M, HEAD_DIM).to(tl.float32)
    delta = tl.sum(o * do, 1)
    if HAS_GRAD_LSE:
        delta -= tl.load(grad_lse_ptr + batch_head * n_q + offs_m, mask=in_rows, other=0.0)
    tl.store(delta_ptr + batch_head * n_q + offs_m, delta, mask=in_rows)


@triton.jit
def _dkdv_query_blocks(dk, dv, k, v, q_desc, do_desc, dq_ptr, lse_ptr, delta_ptr, batch, first_head, heads, kv_group,
                       offs_n, lo, hi, n_q, n_k, qk_scale, scale,
                       BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                       ATOMIC_DQ: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Add query blocks lo..hi of each query head of the group into this key block's dK, dV
    (transposed tiles: rows are keys, columns queries); with ATOMIC_DQ, add each pair's dQ
    share too. One flat loop over (head, block): a loop over heads around it made the
    pipelined sm_90 code spill."""
    blocks = tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_M)
    for step in tl.range(0, kv_group * blocks):
        head = first_head + step // blocks
        start_m = lo + step % blocks * BLOCK_M
        batch_head = batch * heads + head
        offs_m = start_m + tl.arange(0, BLOCK_M)
        in_rows = offs_m < n_q
        q = q_desc.load([batch, head, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
        do = do_desc.load([batch, head, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
        lse2 = tl.load(lse_ptr + batch_head * n_q + offs_m, mask=in_rows, other=0.0) * 1.4426950408889634  # log2
        delta = tl.load(delta_ptr + batch_head * n_q + offs_m, mask=in_rows, other=0.0)
        p_t = tl.math.exp2(tl.dot(k, q.T, input_precision=DOT_PRECISION) * qk_scale - lse2[None, :])
        if MASKED:  # key c is visible to query r if c < n_k (and, causal, c <= r): one compare an element
            if CAUSAL:
                p_t = tl.where(offs_n[:, None] <= tl.minimum(offs_m, n_k - 1)[None, :], p_t, 0.0)
            else:
                p_t = tl.where((offs_n < n_k)[:, None], p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dp_t = tl.dot(v, do.T, input_precision=DOT_PRECISION)
        ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
        dk = tl.dot(ds_t, q, dk, input_precision=DOT_PRECISION)
        if ATOMIC_DQ:
            dq = tl.dot(ds_t.T, k, input_precision=DOT_PRECISION) * scale
            head_dq = dq_ptr + batch_head.to(tl.int64) * n_q * HEAD_DIM  # the buffer passes 2^31 elements
            offs_d = tl.arange(0, HEAD_DIM)
            tl.atomic_add(head_dq + offs_m[:, None] * HEAD_DIM + offs_d[None, :], dq, mask=in_rows[:, None],
                          sem="relaxed")
    return dk, dv


@triton.jit
def flash_backward_dkdv_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_ptr, lse_ptr, delta_ptr,
                               n_q, n_k, heads, kv_group, scale,
                               HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                               CAUSAL: tl.constexpr, ATOMIC_DQ: tl.constexpr, DOT_PRECISION: tl.constexpr):
    start_n = tl.program_id(0) * BLOCK_N
    batch_kv = tl.program_id(1)
    kv_heads = heads // kv_group
    batch, kv_head = batch_kv // kv_heads, batch_kv % kv_heads
    offs_n = start_n + tl.arange(0, BLOCK_N)
    qk_scale = scale * 1.4426950408889634

    k = k_desc.load([batch, kv_head, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
    v = v_desc.load([batch, kv_head, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)

    # Query blocks lo..masked_hi mask, masked_hi..n_q do not.
    if CAUSAL:  # rows before start_n see none of these keys; rows from start_n + BLOCK_N - 1 on see all
        lo = start_n // BLOCK_M * BLOCK_M
        masked_hi = tl.cdiv(start_n + BLOCK_N - 1, BLOCK_M) * BLOCK_M
    else:
        lo = 0
        masked_hi = 0
    if start_n + BLOCK_N > n_k:  # the key tail: every query block masks the keys past n_k
        masked_hi = n_q
    masked_hi = tl.minimum(masked_hi, n_q)
    first_head = kv_head * kv_group
    dk, dv = _dkdv_query_blocks(dk, dv, k, v, q_desc, do_desc, dq_ptr, lse_ptr, delta_ptr, batch, first_head, heads,
                                kv_group, offs_n, lo, masked_hi, n_q, n_k, qk_scale, scale,
                                BLOCK_M, HEAD_DIM, True, CAUSAL, ATOMIC_DQ, DOT_PRECISION)
    dk, dv = _dkdv_query_blocks(dk, dv, k, v, q_desc, do_desc, dq_ptr, lse_ptr, delta_ptr, batch, first_head, heads,
                                kv_group, offs_n, masked_hi, n_q, n_q, n_k, qk_scale, scale,
                                BLOCK_M, HEAD_DIM, False, CAUSAL, ATOMIC_DQ, DOT_PRECISION)

    dk_desc.store([batch, kv_head, start_n, 0], (dk * scale).to(dk_desc.dtype).reshape(1, 1, BLOCK_N, HEAD_DIM))
    dv_desc.store([batch, kv_head, start_n, 0], dv.to(dv_desc.dtype).reshape(1, 1, BLOCK_N, HEAD_DIM))


@triton.jit
def _dq_key_blocks(dq, q, do, lse2, delta, k_desc, v_desc, batch, kv_head, offs_m, lo, hi, n_k, qk_scale,
                   BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    """Add key blocks lo..hi into one query block's dQ (unscaled): dQ += dS K."""
    for start_n in tl.range(lo, hi, BLOCK_N):
        k = k_desc.load([batch, kv_head, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        v = v_desc.load([batch, kv_head, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        p = tl.math.exp2(tl.dot(q, k.T, input_precision=DOT_PRECISION) * qk_scale - lse2[:, None])
        if MASKED:
            offs_n = start_n + tl.arange(0, BLOCK_N)
            keep = offs_n[None, :] < n_k
            if CAUSAL:
                keep = keep & (offs_m[:, None] >= offs_n[None, :])
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, v.T, input_precision=DOT_PRECISION)
        ds = (p * (dp - delta[:, None])).to(k.dtype)
        dq = tl.dot(ds, k, dq, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def flash_backward_dq_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, lse_ptr, delta_ptr, n_q, n_k, heads, kv_group,
                             scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr):
    block = tl.program_id(0)
    if CAUSAL:  # the last query blocks see the most keys: start them first, so the grid ends on short ones
        block = tl.num_programs(0) - 1 - block
    start_m = block * BLOCK_M
    batch_head = tl.program_id(1)
    batch, head = batch_head // heads, batch_head % heads
    kv_head = head // kv_group
    offs_m = start_m + tl.arange(0, BLOCK_M)
    in_rows = offs_m < n_q
    qk_scale = scale * 1.4426950408889634

    q = q_desc.load([batch, head, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
    do = do_desc.load([batch, head, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
    lse2 = tl.load(lse_ptr + batch_head * n_q + offs_m, mask=in_rows, other=0.0) * 1.4426950408889634
    delta = tl.load(delta_ptr + batch_head * n_q + offs_m, mask=in_rows, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    # The forward's split: key blocks every row sees in full run unmasked, the diagonal and tail masked.
    unmasked_hi, hi = key_range(start_m, n_k, BLOCK_M, BLOCK_N, CAUSAL)
    dq = _dq_key_blocks(dq, q, do, lse2, delta, k_desc, v_desc, batch, kv_head, offs_m, 0, unmasked_hi, n_k, qk_scale,
                        BLOCK_N, HEAD_DIM, False, CAUSAL, DOT_PRECISION)
    dq = _dq_key_blocks(dq, q, do, lse2, delta, k_desc, v_desc, batch, kv_head, offs_m, unmasked_hi, hi, n_k, qk_scale,
                        BLOCK_N, HEAD_DIM, True, CAUSAL, DOT_PRECISION)
    dq_desc.store([batch, head, start_m, 0], (dq * scale).to(dq_desc.dtype).reshape(1, 1, BLOCK_M, HEAD_DIM))


# --- launching ------------------------------------------------------------------------------------------


def _set_block_shapes(nargs):  # the autotuners' pre-hook: descriptor boxes follow the config
    d, bm, bn = nargs["HEAD_DIM"], nargs["BLOCK_M"], nargs["BLOCK_N"]
    for name in ("q_desc", "do_desc", "dq_desc"):
        if name in nargs:
            nargs[name].block_shape = [1, 1, bm, d]
    for name in ("k_desc", "v_desc", "dk_desc", "dv_desc"):
        if name in nargs:
            nargs[name].block_shape = [1, 1, bn, d]


def _config(block_m, block_n, warps, stages):
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=warps, num_stages=stages,
                         pre_hook=_set_block_shapes)


# Per head dim, the tiles the autotuners try on an H100, best guess first (not yet timed); each
# compiles for sm_90 without spills, causal or not (tests/kernels/test_flash_backward.py checks
# the first of each list). dK/dV kernel: BLOCK_N keys stay, with two BLOCK_N x d fp32
# accumulators (BLOCK_N * d / 128 registers a thread over 8 warps); BLOCK_M queries stream. The
# atomic dQ product adds a BLOCK_M x d fp32 tile and dS^T through shared memory, so at hd 128 it
# takes 64 x 64 where the kernel without it also fits 32 x 128. (FlashAttention-3's 64 x 128 at
# hd 128 spills: ~100 spill instructions with atomic dQ, 2 without, causal.) At hd 256 only 16 x 64 fits,
# and only without dQ, so dQ there always takes its own kernel (`atomic_dq_fits`). dQ kernel: the
# forward's shape, BLOCK_M queries stay, BLOCK_N keys stream. Head dims 16 and 32 take hd 64's lists.
DKDV_CONFIGS = {
    64: [_config(64, 128, 8, 2), _config(64, 128, 8, 3), _config(64, 64, 4, 3), _config(32, 128, 8, 3)],
    128: [_config(64, 64, 8, 2), _config(32, 128, 8, 3), _config(32, 64, 8, 3)],
    256: [_config(16, 64, 8, 2)],
}
DKDV_ATOMIC_DQ_CONFIGS = {
    64: [_config(64, 128, 8, 2), _config(64, 128, 8, 3), _config(64, 64, 4, 3), _config(32, 128, 8, 3)],
    128: [_config(64, 64, 8, 2), _config(64, 64, 8, 3), _config(32, 64, 8, 3), _config(16, 128, 8, 2)],
}
DQ_CONFIGS = {
    64: [_config(128, 64, 8, 3), _config(128, 128, 8, 3), _config(64, 64, 4, 4)],
    128: [_config(128, 64, 8, 2), _config(128, 64, 8, 3), _config(64, 64, 4, 3)],
    256: [_config(64, 64, 8, 2), _config(64, 32, 4, 2)],
}


def _pruner(table):
    def configs_for(configs, named_args, **kwargs):
        head_dim = kwargs.get("HEAD_DIM", named_args.get("HEAD_DIM"))
        mine = table[max(head_dim, 64)]
        return [c for c in configs if any(c is m for m in mine)]  # by identity: lists share equal configs

    return {"early_config_prune": configs_for}


_TUNING_KEY = ["n_q", "n_k", "HEAD_DIM", "CAUSAL", "DOT_PRECISION"]


def _autotuned(kernel, table, **kwargs):
    return triton.autotune([c for cs in table.values() for c in cs], key=_TUNING_KEY, prune_configs_by=_pruner(table),
                           **kwargs)(kernel)


# With atomic dQ every timed run must start from a zeroed buffer (and the tuner zeroes it again
# after tuning); the kernel without it has no buffer to zero.
dkdv_atomic_dq_autotuned = _autotuned(flash_backward_dkdv_kernel, DKDV_ATOMIC_DQ_CONFIGS, reset_to_zero=["dq_ptr"])
dkdv_autotuned = _autotuned(flash_backward_dkdv_kernel, DKDV_CONFIGS)
dq_autotuned = _autotuned(flash_backward_dq_kernel, DQ_CONFIGS)


def atomic_dq_fits(head_dim: int) -> bool:
    """Whether the dK/dV kernel can also add dQ at this head dim (else dQ takes its own kernel)."""
    return max(head_dim, 64) in DKDV_ATOMIC_DQ_CONFIGS


INTERPRETER_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 32}


def delta_rows(head_dim: int) -> int:
    """Rows a program of the D kernel reads: 8K elements of O and of dO, 64 a thread over 4 warps."""
    return min(128, 8192 // head_dim)


def check_backward_inputs(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          out: torch.Tensor, lse: torch.Tensor, grad_lse: torch.Tensor | None,
                          scale: float | None) -> float:
    """Raise ValueError on anything the kernels cannot take; return the softmax scale."""
    scale = check_attention_inputs(q, k, v, scale)
    for name, t in (("out", out), ("grad_out", grad_out)):
        if t.shape != q.shape or t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name} must match q: {tuple(q.shape)} {q.dtype} on {q.device}; got "
                             f"{tuple(t.shape)} {t.dtype} on {t.device}")
        if not tma_compatible(t):
            raise ValueError(f"{name} needs a contiguous last dimension, 16-byte aligned strides and start (TMA); "
                             f"got strides {t.stride()}")
    for name, t in (("lse", lse), ("grad_lse", grad_lse)):
        if t is not None and (t.shape != q.shape[:3] or t.dtype != torch.float32 or t.device != q.device
                              or not t.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous float32 {tuple(q.shape[:3])} tensor on {q.device}; got "
                             f"{tuple(t.shape)} {t.dtype} on {t.device}, strides {t.stride()}")
    return scale


def _empty_in_layout_of(t: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor shaped as t, in t's layout where TMA can take it (dense by default)."""
    empty = torch.empty_like(t)
    return empty if tma_compatible(empty) else torch.empty(t.shape, dtype=t.dtype, device=t.device)


def flash_attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, *, causal: bool = False,
                             scale: float | None = None, grad_lse: torch.Tensor | None = None,
                             atomic_dq: bool = False, config: dict | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV) of attention for the forward's inputs q (B, H, Nq, d), k and v (B, Hkv, Nk, d),
    its output `out` and fp32 log-sum-exp `lse` (B, H, Nq), given grad_out = dLoss/dout and,
    optionally, grad_lse = dLoss/dlse. Same causal and scale as the forward's call.

    Each gradient has its input's dtype, and its layout where TMA can take that layout.
    dQ comes from its own kernel, in a fixed order (bit-identical runs); `atomic_dq` adds it
    with fp32 atomics in the dK/dV kernel instead (fewer FLOPs, slower where measured, last
    bits vary run to run; head dim 256 ignores it). `config` (BLOCK_M,
    BLOCK_N, num_warps, num_stages) skips the autotuners and serves both main kernels: the
    CPU tests run one small config under the Triton interpreter.
    """
    scale = check_backward_inputs(grad_out, q, k, v, out, lse, grad_lse, scale)
    batch, heads, n_q, dim = q.shape
    kv_heads, n_k = k.shape[1], k.shape[2]
    dk, dv = _empty_in_layout_of(k), _empty_in_layout_of(v)
    if q.numel() == 0:  # no query: nothing reaches the keys
        return _empty_in_layout_of(q), dk.zero_(), dv.zero_()
    if config is None and not q.is_cuda:  # the Triton interpreter: one small tile, no autotuning
        config = INTERPRETER_CONFIG

    def descriptor(t):  # 4-D TMA box; its block shape is set per launch
        return TensorDescriptor.from_tensor(t, [1, 1, 16, dim])

    delta = torch.empty((batch, heads, n_q), dtype=torch.float32, device=q.device)
    rows = delta_rows(dim)
    flash_backward_delta_kernel[(triton.cdiv(n_q, rows), batch * heads)](
        TensorDescriptor.from_tensor(out, [1, 1, rows, dim]), TensorDescriptor.from_tensor(grad_out, [1, 1, rows, dim]),
        grad_lse, delta, n_q, heads, HEAD_DIM=dim, BLOCK_M=rows, HAS_GRAD_LSE=grad_lse is not None, num_warps=4)

    separate_dq = not (atomic_dq and atomic_dq_fits(dim))
    common = dict(n_q=n_q, n_k=n_k, heads=heads, kv_group=heads // kv_heads, scale=scale, HEAD_DIM=dim,
                  CAUSAL=bool(causal), DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    dq_accum = None if separate_dq else torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkdv_args = dict(q_desc=descriptor(q), k_desc=descriptor(k), v_desc=descriptor(v), do_desc=descriptor(grad_out),
                     dk_desc=descriptor(dk), dv_desc=descriptor(dv), dq_ptr=dq_accum, lse_ptr=lse, delta_ptr=delta,
                     ATOMIC_DQ=not separate_dq, **common)
    if separate_dq:
        dq = _empty_in_layout_of(q)
        dq_args = dict(q_desc=descriptor(q), k_desc=descriptor(k), v_desc=descriptor(v), do_desc=descriptor(grad_out),
                       dq_desc=descriptor(dq), lse_ptr=lse, delta_ptr=delta, **common)

    if config is None:
        tuned = dkdv_autotuned if separate_dq else dkdv_atomic_dq_autotuned
        tuned[lambda meta: (triton.cdiv(n_k, meta["BLOCK_N"]), batch * kv_heads)](**dkdv_args)
        if separate_dq:
            dq_autotuned[lambda meta: (triton.cdiv(n_q, meta["BLOCK_M"]), batch * heads)](**dq_args)
    else:
        blocks = {"BLOCK_M": config["BLOCK_M"], "BLOCK_N": config["BLOCK_N"]}
        launch = dict(num_warps=config.get("num_warps", 4), num_stages=config.get("num_stages", 2))
        _set_block_shapes({**dkdv_args, **blocks})
        flash_backward_dkdv_kernel[(triton.cdiv(n_k, blocks["BLOCK_N"]), batch * kv_heads)](
            **dkdv_args, **blocks, **launch)
        if separate_dq:
            _set_block_shapes({**dq_args, **blocks})
            flash_backward_dq_kernel[(triton.cdiv(n_q, blocks["BLOCK_M"]), batch * heads)](**dq_args, **blocks,
                                                                                          **launch)
    if not separate_dq:  # the cast pass (bf16/fp16), into q's layout
        dq = _empty_in_layout_of(q).copy_(dq_accum)
    return dq, dk, dv


def backward_flops(batch: int, heads: int, n_q: int, n_k: int, head_dim: int, causal: bool) -> int:
    """The backward's FLOPs by the FlashAttention papers' count: 2.5x the forward's 4 Nq Nk d a
    head (5 matmuls to the forward's 2), half of it causal."""
    full = 10 * batch * heads * n_q * n_k * head_dim
    return full // 2 if causal else full


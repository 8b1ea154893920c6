"""FlashAttention forward in Triton: O = softmax(Q K^T * scale) V without the N x N matrix.

One program owns BLOCK_M query rows of one head. It keeps its Q tile on chip and walks
the keys BLOCK_N at a time, carrying per row the running max m (log2 units), the running
denominator l and an unnormalised fp32 output tile; a new tile with a larger max rescales
what came before by 2^(m_old - m_new) (the online softmax, `kforge trace online-softmax`).
HBM sees Q, K, V read once per query block and O written once: for N keys the naive
version's N^2 scores never exist. Same FLOPs (4 N^2 d per head), far fewer bytes.

Choices, each for the H100:
- Scores go through exp2 with log2(e) folded into the scale: one FMA and one MUFU.EX2
  per score instead of a multiply, a subtract and exp's own range reduction.
- Blocks wholly below the causal diagonal (and inside the key length) run a loop with
  no masking at all; only the diagonal and tail blocks pay for the compare-and-select.
  Causal skips the blocks above the diagonal: half the work.
- Q, K, V, O move through 4-D TMA descriptors over (batch, head, seq, dim): any strides
  with a contiguous last dimension (the layout SDPA takes, and transposed views of
  (batch, seq, head, dim)); reads past the sequence end come back as zeros and writes
  past it are dropped, so tails need no pointer masks.
- Grouped-query attention indexes the K/V head as head // group: nothing is copied.
- Causal is top-left aligned, as SDPA's is_causal: query i sees keys 0..i, whatever
  the two lengths are.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

LOG2E = 1.4426950408889634


@triton.jit
def _key_blocks(acc, l_i, m_i, q, k_desc, v_desc, batch, kv_head, offs_m, lo, hi, n_k, qk_scale,
                BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                DOT_PRECISION: tl.constexpr):
    for start_n in tl.range(lo, hi, BLOCK_N):
        k = k_desc.load([batch, kv_head, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        s = tl.dot(q, k.T, input_precision=DOT_PRECISION)
        if MASKED:
            offs_n = start_n + tl.arange(0, BLOCK_N)
            keep = offs_n[None, :] < n_k
            if CAUSAL:
                keep = keep & (offs_m[:, None] >= offs_n[None, :])
            s = tl.where(keep, s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            s = s - m_new[:, None]
        else:  # scale > 0, so max(s) * scale is max(s * scale): one FMA per score below
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            s = s * qk_scale - m_new[:, None]
        p = tl.math.exp2(s)
        alpha = tl.math.exp2(m_i - m_new)  # 0 on the first block (m_i = -inf)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = v_desc.load([batch, kv_head, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def key_range(start_m, n_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """(unmasked_hi, hi) for the query block at start_m: key blocks below unmasked_hi are seen
    whole by every row (no mask), those up to hi need the mask (the diagonal, the tail); causal,
    keys past the block's last row are never seen. Shared by the forward, FP8 and dQ kernels."""
    if CAUSAL:
        hi = tl.minimum(start_m + BLOCK_M, n_k)
        unmasked_hi = tl.minimum(start_m + 1, n_k) // BLOCK_N * BLOCK_N
    else:
        hi = n_k
        unmasked_hi = n_k // BLOCK_N * BLOCK_N
    return unmasked_hi, hi


@triton.jit
def flash_forward_kernel(q_desc, k_desc, v_desc, o_desc, lse_ptr, n_q, n_k, heads, kv_group, qk_scale,
                         HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    batch_head = tl.program_id(1)
    batch, head = batch_head // heads, batch_head % heads
    kv_head = head // kv_group
    offs_m = start_m + tl.arange(0, BLOCK_M)

    q = q_desc.load([batch, head, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    unmasked_hi, hi = key_range(start_m, n_k, BLOCK_M, BLOCK_N, CAUSAL)
    acc, l_i, m_i = _key_blocks(acc, l_i, m_i, q, k_desc, v_desc, batch, kv_head, offs_m, 0, unmasked_hi, n_k,
                                qk_scale, BLOCK_N, HEAD_DIM, False, CAUSAL, DOT_PRECISION)
    acc, l_i, m_i = _key_blocks(acc, l_i, m_i, q, k_desc, v_desc, batch, kv_head, offs_m, unmasked_hi, hi, n_k,
                                qk_scale, BLOCK_N, HEAD_DIM, True, CAUSAL, DOT_PRECISION)

    # Every row saw key 0 (causal is top-left aligned), so l_i >= 1 and nothing divides by 0.
    acc = acc / l_i[:, None]
    o_desc.store([batch, head, start_m, 0], acc.to(o_desc.dtype).reshape(1, 1, BLOCK_M, HEAD_DIM))
    lse = (m_i + tl.math.log2(l_i)) / 1.4426950408889634  # back from log2 units to natural log
    tl.store(lse_ptr + batch_head * n_q + offs_m, lse, mask=offs_m < n_q)


def _set_block_shapes(nargs):  # the autotuner's pre-hook: descriptor boxes follow the config
    d, bm, bn = nargs["HEAD_DIM"], nargs["BLOCK_M"], nargs["BLOCK_N"]
    nargs["q_desc"].block_shape = nargs["o_desc"].block_shape = [1, 1, bm, d]
    nargs["k_desc"].block_shape = nargs["v_desc"].block_shape = [1, 1, bn, d]


def _config(block_m, block_n, warps, stages):
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=warps, num_stages=stages,
                         pre_hook=_set_block_shapes)


# Per head dim, the tiles worth trying on an H100 (228 KB of shared memory, 255 registers a
# thread): a 128 x d fp32 accumulator over 8 warps is d/2 registers a thread. First in
# each list is the one `kforge bench attention --sweep` found fastest (hd 128: 128 x 128,
# 8 warps, 3 stages: 497-504 TFLOP/s non-causal at N = 4096, the others 451-470). Head
# dims 16 and 32 take hd 64's list.
CONFIGS = {
    64: [_config(128, 128, 8, 3), _config(128, 64, 4, 4), _config(128, 128, 4, 3), _config(128, 64, 8, 4)],
    128: [_config(128, 128, 8, 3), _config(128, 64, 8, 3), _config(128, 128, 8, 2), _config(128, 64, 4, 3)],
    256: [_config(128, 64, 8, 2), _config(64, 64, 4, 2), _config(128, 32, 8, 2), _config(64, 32, 4, 3)],
}


def _configs_for(configs, named_args, **kwargs):
    head_dim = kwargs.get("HEAD_DIM", named_args.get("HEAD_DIM"))
    mine = CONFIGS[max(head_dim, 64)]
    return [c for c in configs if any(c is m for m in mine)]  # by identity: lists share equal configs


flash_forward_autotuned = triton.autotune(
    [c for configs in CONFIGS.values() for c in configs],
    key=["n_q", "n_k", "HEAD_DIM", "CAUSAL", "DOT_PRECISION"],
    prune_configs_by={"early_config_prune": _configs_for},
)(flash_forward_kernel)

INTERPRETER_CONFIG = {"BLOCK_M": 32, "BLOCK_N": 16}
HEAD_DIMS = (16, 32, 64, 128, 256)


def tma_compatible(t: torch.Tensor) -> bool:
    """Whether a 4-D TMA descriptor can cover t: a contiguous last dimension, the other strides
    and the start 16-byte aligned."""
    return t.stride(3) == 1 and not any(s * t.element_size() % 16 for s in t.stride()[:3]) and not t.data_ptr() % 16


def check_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> float:
    """Raise ValueError on anything the kernel cannot take; return the softmax scale."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D (batch, heads, seq, head_dim), got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if not q.dtype == k.dtype == v.dtype or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q, k, v must share one dtype of float16, bfloat16, float32; got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k, v are on different devices: {q.device}, {k.device}, {v.device}")
    batch, heads, _, dim = q.shape
    if k.shape != v.shape or k.shape[0] != batch or k.shape[3] != dim:
        raise ValueError(f"k and v must be (batch, kv_heads, seq_k, head_dim) matching q {tuple(q.shape)}; got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[1] == 0 or heads % k.shape[1]:
        raise ValueError(f"query heads ({heads}) must be a multiple of key/value heads ({k.shape[1]})")
    if dim not in HEAD_DIMS:
        raise ValueError(f"head_dim {dim} is not supported (supported: {', '.join(map(str, HEAD_DIMS))})")
    if k.shape[2] == 0:
        raise ValueError("no keys: seq_k is 0, so the softmax is empty")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not tma_compatible(t):
            raise ValueError(f"{name} needs a contiguous last dimension, 16-byte aligned strides and start "
                             f"(TMA); got strides {t.stride()}")
    scale = 1.0 / math.sqrt(dim) if scale is None else float(scale)
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"scale must be a positive finite number, got {scale}")
    return scale


def flash_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                            scale: float | None = None, config: dict | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, LSE) for q (B, H, Nq, d), k and v (B, Hkv, Nk, d), Hkv dividing H.

    O has q's dtype and strides; LSE is fp32 (B, H, Nq), natural log of each row's softmax
    denominator (what a backward pass or a split-KV merge needs). `config` (BLOCK_M,
    BLOCK_N, num_warps, num_stages) skips the autotuner: the CPU tests run one small
    config under the Triton interpreter.
    """
    scale = check_attention_inputs(q, k, v, scale)
    batch, heads, n_q, dim = q.shape
    n_k = k.shape[2]
    out = torch.empty_like(q)
    lse = torch.empty((batch, heads, n_q), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    if out.stride(3) != 1:  # empty_like keeps q's layout when it can; else start dense
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    descs = [TensorDescriptor.from_tensor(t, [1, 1, 16, dim]) for t in (q, k, v, out)]  # boxes set below
    args = dict(n_q=n_q, n_k=n_k, heads=heads, kv_group=heads // k.shape[1], qk_scale=scale * LOG2E,
                HEAD_DIM=dim, CAUSAL=bool(causal), DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    if config is None and not q.is_cuda:  # the Triton interpreter: one small tile, no autotuning
        config = INTERPRETER_CONFIG
    if config is None:
        def grid(meta):
            return triton.cdiv(n_q, meta["BLOCK_M"]), batch * heads

        flash_forward_autotuned[grid](*descs, lse, **args)
    else:
        blocks = {"BLOCK_M": config["BLOCK_M"], "BLOCK_N": config["BLOCK_N"]}
        _set_block_shapes({"q_desc": descs[0], "k_desc": descs[1], "v_desc": descs[2], "o_desc": descs[3],
                           "HEAD_DIM": dim, **blocks})
        grid = (triton.cdiv(n_q, blocks["BLOCK_M"]), batch * heads)
        flash_forward_kernel[grid](*descs, lse, **args, **blocks, num_warps=config.get("num_warps", 4),
                                   num_stages=config.get("num_stages", 2))
    return out, lse

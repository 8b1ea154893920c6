"""Naive attention: the whole N x N score matrix, as PyTorch eager writes it. The reference
the kernels are checked against (run in float64) and the "before" picture in the benchmark.

For one head with Nq queries, Nk keys and head dim d, three kernels run: S = Q K^T
(writes Nq*Nk scores), softmax (reads them, writes Nq*Nk probabilities), O = P V (reads
them). At 2 bytes an entry that is 8*Nq*Nk bytes of HBM traffic beyond Q, K, V and O:
at N = 4096 and d = 128, 128 MB of scores against 4 MB of Q, K, V, O per head.
"""

from __future__ import annotations

import math

import torch


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    scale: float | None = None, return_lse: bool = False, bottom_right: bool = False):
    """O (and with `return_lse` the log-sum-exp per query row) with the shapes and semantics
    of `flash_attention_forward`: q (B, H, Nq, d), k and v (B, Hkv, Nk, d) with Hkv
    dividing H, causal top-left aligned as in SDPA (`bottom_right`: query i sees keys up to
    i + Nk - Nq, as flash-attn aligns it).

    Everything runs in the inputs' dtype, as eager code does: on a GPU in bf16, the scores
    and probabilities are bf16 matrices (the softmax computes in fp32 inside and rounds its
    output). Tests call it on float64 inputs for a float64 reference.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    group = q.shape[1] // k.shape[1]
    if group > 1:  # grouped-query attention: query head h reads key/value head h // group
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-2, -1)
    scores.mul_(scale)
    if causal:
        shift = k.shape[-2] - q.shape[-2] if bottom_right else 0
        visible = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril(shift)
        scores.masked_fill_(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if causal and bottom_right and k.shape[-2] < q.shape[-2]:  # the first rows see no key: 0, as the kernel gives
        probs[..., :q.shape[-2] - k.shape[-2], :] = 0
    out = probs @ v
    if not return_lse:
        return out
    return out, torch.logsumexp(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1)

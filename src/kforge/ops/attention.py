"""`kforge.ops.flash_attention(q, k, v, causal=..., scale=...)`: attention on kforge's
FlashAttention forward kernel, laid out as `torch.nn.functional.scaled_dot_product_attention`.

q is (batch, heads, seq_q, head_dim); k and v are (batch, kv_heads, seq_k, head_dim) with
kv_heads dividing heads (grouped-query attention, as SDPA's enable_gqa=True); causal is
top-left aligned as SDPA's is_causal; scale defaults to 1/sqrt(head_dim). FLOPs: 4 *
batch * heads * seq_q * seq_k * head_dim (half that causal, seq_q = seq_k); minimum HBM
bytes: q, k, v read once and the output written once. Measured on the H100: see README
("FlashAttention") and `kforge bench attention`.

A `torch.library` custom op returning (out, lse): torch.compile sees one opaque node, and
autograd differentiates it by recomputing the probabilities from the saved log-sum-exp in
PyTorch (exact, but it builds the N x N matrix: a training-speed backward is not here).
The kernel runs for fp16/bf16/fp32 CUDA tensors on Hopper with head_dim in 16..256 and
TMA-friendly strides; anything else runs naive attention in PyTorch.
"""

from __future__ import annotations

import math

import torch

from kforge.kernels.attention.naive import naive_attention


def ours_can_run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> bool:
    """Whether our kernel takes these tensors (else the op computes naive attention)."""
    if not (q.is_cuda and torch.cuda.get_device_capability(q.device) >= (9, 0)):
        return False
    from kforge.kernels.attention.flash_forward import check_attention_inputs

    try:
        check_attention_inputs(q, k, v, scale)
    except ValueError:
        return False
    return True


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    torch._check(q.dim() == 4 and k.dim() == 4 and v.dim() == 4,
                 lambda: "kforge::flash_attention takes 4-D q, k, v (batch, heads, seq, head_dim)")
    torch._check(k.shape == v.shape, lambda: f"k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    torch._check(q.shape[0] == k.shape[0] and q.shape[3] == k.shape[3],
                 lambda: f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch or head_dim")
    torch._check(k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0,
                 lambda: f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")


@torch.library.custom_op("kforge::flash_attention", mutates_args=())
def _flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                     scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    _check_shapes(q, k, v)
    if ours_can_run(q, k, v, scale):
        from kforge.kernels.attention.flash_forward import flash_attention_forward

        return flash_attention_forward(q, k, v, causal=causal, scale=scale)
    out, lse = naive_attention(q, k, v, causal=causal, scale=scale, return_lse=True)
    return out.contiguous(), lse.float().contiguous()


@_flash_attention.register_fake
def _(q, k, v, causal, scale):
    _check_shapes(q, k, v)
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


def _setup(ctx, inputs, output):
    q, k, v, causal, scale = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.causal, ctx.scale = causal, scale


def _backward(ctx, grad_out: torch.Tensor, grad_lse: torch.Tensor | None):
    """dQ, dK, dV from P = exp(S - lse), recomputed in fp32:
    dV = P^T dO; dP = dO V^T; dS = P * (dP - rowsum(dO * O) + dlse); dQ = dS K s; dK = dS^T Q s."""
    q, k, v, out, lse = ctx.saved_tensors
    scale = 1.0 / math.sqrt(q.shape[-1]) if ctx.scale is None else ctx.scale
    group = q.shape[1] // k.shape[1]
    work = torch.promote_types(q.dtype, torch.float32)  # fp32, or float64 for float64 inputs
    qf, kf, vf = (t.to(work) for t in (q, k, v))
    kf, vf = kf.repeat_interleave(group, dim=1), vf.repeat_interleave(group, dim=1)
    scores = qf @ kf.transpose(-2, -1) * scale
    if ctx.causal:
        visible = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~visible, float("-inf"))
    p = torch.exp(scores - lse.to(work)[..., None])
    d_out = grad_out.to(work)
    row_term = (d_out * out.to(work)).sum(-1, keepdim=True)
    if grad_lse is not None:
        row_term = row_term - grad_lse[..., None]
    d_scores = p * (d_out @ vf.transpose(-2, -1) - row_term)
    d_q = d_scores @ kf * scale
    d_k = d_scores.transpose(-2, -1) @ qf * scale
    d_v = p.transpose(-2, -1) @ d_out

    def per_kv_head(t):  # the query heads of a group all read one key/value head: sum them
        b, h, n, d = t.shape
        return t.view(b, h // group, group, n, d).sum(2)

    return d_q.to(q.dtype), per_kv_head(d_k).to(k.dtype), per_kv_head(d_v).to(v.dtype), None, None


_flash_attention.register_autograd(_backward, setup_context=_setup)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    scale: float | None = None, return_lse: bool = False):
    """softmax(q k^T * scale) v, per head; with `return_lse`, also the fp32 log-sum-exp of
    each query row (batch, heads, seq_q)."""
    out, lse = _flash_attention(q, k, v, bool(causal), None if scale is None else float(scale))
    return (out, lse) if return_lse else out

"""`kforge.ops.flash_attention(q, k, v, causal=..., scale=...)`: attention on kforge's
FlashAttention kernels, forward and backward, laid out as
`torch.nn.functional.scaled_dot_product_attention`.

q is (batch, heads, seq_q, head_dim); k and v are (batch, kv_heads, seq_k, head_dim) with
kv_heads dividing heads (grouped-query attention, as SDPA's enable_gqa=True); causal is
top-left aligned as SDPA's is_causal; scale defaults to 1/sqrt(head_dim). FLOPs: 4 *
batch * heads * seq_q * seq_k * head_dim forward, 2.5x that backward (half of each causal,
seq_q = seq_k); minimum HBM bytes: q, k, v read once and the output written once (backward:
q, k, v, out, dout read and dq, dk, dv written once). Measured on the H100 (forward): see
README ("FlashAttention") and `kforge bench attention`.

Two `torch.library` custom ops: the forward returns (out, lse) and the backward
(`kforge::flash_attention_backward`) takes the saved out and lse, so torch.compile sees one
opaque node each way. The backward runs `kernels/attention/flash_backward.py` (dQ, dK, dV
recomputing the probabilities from the log-sum-exp, O(N) memory), its dQ bit-identical run
to run; `atomic_dq=True` adds dQ with fp32 atomics instead (slower where measured; not under
`torch.use_deterministic_algorithms(True)`). Both kernels run for fp16/bf16/fp32 CUDA tensors on
Hopper with head_dim in 16..256 and TMA-friendly strides (`ours_can_run`); the forward is the CUDA
kernel (`flash_hopper.cu`) for bf16/fp16 at head dim 128 on sm_90 (`cuda_forward_chosen`), the
Triton one otherwise. For anything else the forward runs naive attention
and the backward recomputes the N x N probabilities in PyTorch, exact but O(N^2) memory.
The backward is not differentiable again (no double backward).
"""

from __future__ import annotations

import math

import torch

from kforge.kernels.attention.naive import naive_attention


def ours_can_run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> bool:
    """Whether our kernels take these tensors (else the op runs naive attention forward and the
    PyTorch recompute backward)."""
    if not (q.is_cuda and torch.cuda.get_device_capability(q.device) >= (9, 0)):
        return False
    from kforge.kernels.attention.flash_forward import check_attention_inputs

    try:
        check_attention_inputs(q, k, v, scale)
    except ValueError:
        return False
    return True


def cuda_forward_chosen(dtype: torch.dtype, head_dim: int, capability: tuple[int, int]) -> bool:
    """Whether the forward runs the CUDA kernel (`flash_hopper.cu`) rather than the Triton one: bf16
    or fp16 at head dim 128 on sm_90, where it ran 1.33-1.40x the Triton forward (H200, bf16, N 2048
    to 16384, full and causal: 530-680 TFLOP/s against 382-505; docs/attention.md). At head dim 64
    the Triton forward is level or ahead (381 against 361 TFLOP/s at N 1024), so it keeps those."""
    return capability == (9, 0) and head_dim == 128 and dtype in (torch.bfloat16, torch.float16)


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    torch._check(q.dim() == 4 and k.dim() == 4 and v.dim() == 4,
                 lambda: "kforge::flash_attention takes 4-D q, k, v (batch, heads, seq, head_dim)")
    torch._check(k.shape == v.shape, lambda: f"k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    torch._check(q.shape[0] == k.shape[0] and q.shape[3] == k.shape[3],
                 lambda: f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch or head_dim")
    torch._check(k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0,
                 lambda: f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")


@torch.library.custom_op("kforge::flash_attention", mutates_args=())
def _flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None,
                     atomic_dq: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    _check_shapes(q, k, v)
    if ours_can_run(q, k, v, scale):
        if q.is_cuda and cuda_forward_chosen(q.dtype, q.shape[-1], torch.cuda.get_device_capability(q.device)):
            from kforge.kernels.attention.flash_hopper import flash_attention_hopper

            return flash_attention_hopper(q, k, v, causal=causal, scale=scale)  # the checks ours_can_run made
        from kforge.kernels.attention.flash_forward import flash_attention_forward

        return flash_attention_forward(q, k, v, causal=causal, scale=scale)
    out, lse = naive_attention(q, k, v, causal=causal, scale=scale, return_lse=True)
    return out.contiguous(), lse.float().contiguous()


@_flash_attention.register_fake
def _(q, k, v, causal, scale, atomic_dq=False):
    _check_shapes(q, k, v)
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


def _setup(ctx, inputs, output):
    q, k, v, causal, scale, atomic_dq = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.causal, ctx.scale, ctx.atomic_dq = causal, scale, atomic_dq


def _recompute_backward(grad_out, grad_lse, q, k, v, out, lse, causal, scale):
    """dQ, dK, dV from P = exp(S - lse), the whole N x N matrix in fp32 (float64 for float64 inputs):
    dV = P^T dO; dP = dO V^T; dS = P * (dP - rowsum(dO * O) + dlse); dQ = dS K s; dK = dS^T Q s."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    group = q.shape[1] // k.shape[1]
    work = torch.promote_types(q.dtype, torch.float32)
    qf, kf, vf = (t.to(work) for t in (q, k, v))
    kf, vf = kf.repeat_interleave(group, dim=1), vf.repeat_interleave(group, dim=1)
    scores = qf @ kf.transpose(-2, -1) * scale
    if causal:
        visible = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~visible, float("-inf"))
    p = torch.exp(scores - lse.to(work)[..., None])
    d_out = grad_out.to(work)
    row_term = (d_out * out.to(work)).sum(-1, keepdim=True) - grad_lse.to(work)[..., None]
    d_scores = p * (d_out @ vf.transpose(-2, -1) - row_term)
    d_q = d_scores @ kf * scale
    d_k = d_scores.transpose(-2, -1) @ qf * scale
    d_v = p.transpose(-2, -1) @ d_out

    def per_kv_head(t):  # the query heads of a group all read one key/value head: sum them
        b, h, n, d = t.shape
        return t.view(b, h // group, group, n, d).sum(2)

    return d_q.to(q.dtype), per_kv_head(d_k).to(k.dtype), per_kv_head(d_v).to(v.dtype)


@torch.library.custom_op("kforge::flash_attention_backward", mutates_args=())
def _flash_attention_backward(grad_out: torch.Tensor, grad_lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                              v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, causal: bool,
                              scale: float | None, atomic_dq: bool
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv): our Triton backward where the forward ran our kernel, else the recompute."""
    if not ours_can_run(q, k, v, scale):
        return _recompute_backward(grad_out, grad_lse, q, k, v, out, lse, causal, scale)
    from kforge.kernels.attention.flash_backward import flash_attention_backward
    from kforge.kernels.attention.flash_forward import tma_compatible

    # Autograd hands over what the loss made: `out.sum()` gives an expanded (stride 0) grad_out.
    grad_out, out = (t if tma_compatible(t) else t.contiguous() for t in (grad_out, out))
    return flash_attention_backward(grad_out, q, k, v, out, lse.contiguous(), causal=causal, scale=scale,
                                    grad_lse=grad_lse.float().contiguous(), atomic_dq=atomic_dq)


@_flash_attention_backward.register_fake
def _(grad_out, grad_lse, q, k, v, out, lse, causal, scale, atomic_dq):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _backward(ctx, grad_out: torch.Tensor, grad_lse: torch.Tensor):
    """Autograd materialises both gradients (zeros for an output the loss did not use)."""
    q, k, v, out, lse = ctx.saved_tensors
    atomic_dq = ctx.atomic_dq and not torch.are_deterministic_algorithms_enabled()
    d_q, d_k, d_v = _flash_attention_backward(grad_out, grad_lse, q, k, v, out, lse, ctx.causal, ctx.scale,
                                              atomic_dq)
    return d_q, d_k, d_v, None, None, None


_flash_attention.register_autograd(_backward, setup_context=_setup)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    scale: float | None = None, return_lse: bool = False, atomic_dq: bool = False):
    """softmax(q k^T * scale) v, per head; with `return_lse`, also the fp32 log-sum-exp of
    each query row (batch, heads, seq_q). The backward's dq is bit-identical run to run;
    `atomic_dq` adds it with fp32 atomics instead (ignored under
    `torch.use_deterministic_algorithms(True)`)."""
    out, lse = _flash_attention(q, k, v, bool(causal), None if scale is None else float(scale), bool(atomic_dq))
    return (out, lse) if return_lse else out

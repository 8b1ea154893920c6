"""`kforge.ops.mla_decode(q, kv_cache, block_table, cache_seqlens, head_dim_v=512, ...)`: DeepSeek's
multi-head latent attention at decode over a paged latent cache, FlashMLA's contract.

    out, lse = mla_decode(q, kv_cache, block_table, cache_seqlens, 512, softmax_scale=s, causal=True)
    # q (b, s_q, h_q, 576): absorbed latent query (512) + RoPE part (64)
    # kv_cache (num_pages, 64, 1, 576): one latent row per token, shared by every head
    # out (b, s_q, h_q, 512) in q's dtype; lse (b, h_q, s_q) fp32, natural log

`kforge.kernels.mla.decode` states the math, the causal rule over s_q, the split-KV design and
the FLOP and byte counts. A `torch.library` custom op (`kforge::mla_decode`) with a fake
implementation. On CUDA tensors it runs `mla_decode`'s default: the CUDA kernel for Hopper
(decode_hopper.py) where it takes the inputs, else the Triton kernels (bf16/fp16/fp32, sm_80 or
newer); elsewhere the op runs the float64 reference. Malformed inputs raise ValueError first; with
validate=True (the default) one device-to-host read refuses lengths past the block table and
page ids outside the pool; pass validate=False in a serving loop or a CUDA graph.
"""

from __future__ import annotations

import torch

from kforge.kernels.mla.decode import check_mla_inputs, check_mla_table_values, mla_decode_reference


def _kernels_can_run(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.get_device_capability(t.device) >= (8, 0)


@torch.library.custom_op("kforge::mla_decode", mutates_args=())
def _mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor,
                head_dim_v: int, softmax_scale: float | None, causal: bool, validate: bool
                ) -> tuple[torch.Tensor, torch.Tensor]:
    scale = check_mla_inputs(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale)
    if validate:
        check_mla_table_values(block_table, cache_seqlens, kv_cache.shape[0], kv_cache.shape[1])
    if _kernels_can_run(q):
        from kforge.kernels.mla.decode import mla_decode as kernel

        return kernel(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale=scale, causal=causal,
                      validate=False)
    return mla_decode_reference(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale=scale,
                                causal=causal)


@_mla_decode.register_fake
def _(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal, validate):
    torch._check(q.dim() == 4 and kv_cache.dim() == 4 and q.shape[3] == kv_cache.shape[3],
                 lambda: "kforge::mla_decode takes q (batch, s_q, h_q, head_dim) and kv_cache "
                         "(num_pages, page_size, 1, head_dim)")
    batch, s_q, h_q, _ = q.shape
    return q.new_empty((batch, s_q, h_q, head_dim_v)), q.new_empty((batch, h_q, s_q), dtype=torch.float32)


def mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor,
               head_dim_v: int = 512, *, softmax_scale: float | None = None, causal: bool = False,
               validate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (batch, s_q, h_q, head_dim_v), lse (batch, h_q, s_q) fp32): attention of every query
    head over the request's cache_seqlens[b] latent rows, V the first head_dim_v dims of each row;
    with `causal`, query i of s_q sees cache_seqlens[b] - s_q + i + 1 rows. softmax_scale defaults
    to 1/sqrt(head_dim)."""
    return _mla_decode(q, kv_cache, block_table, cache_seqlens, int(head_dim_v),
                       None if softmax_scale is None else float(softmax_scale), bool(causal), bool(validate))

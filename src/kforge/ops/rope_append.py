"""`kforge.ops.rope_paged_kv_append(q, k, v, positions, cos_sin, k_cache, v_cache, block_tables,
context_lens, *, interleaved=False, validate=True)`: RoPE on q and k followed by the paged
KV-cache append of k and v, as one PyTorch operator and one launch of kforge's Triton
kernel (`kforge.kernels.serving.rope_append`).

The effect is `rope_` / `apply_rope_` then `paged_kv_append`, bit for bit: q and k rotated
in place by their tokens' positions from the [cos | sin] table `cos_sin` (a
`cos_sin_table`, or any (max_position, rotary_dim) fp32 table such as the Llama-3 scaled
one the model builds), and request b's token j, rotated, written at cache position
context_lens[b] + j (the lengths before the append; the caller adds new_tokens after).
q (batch, [new_tokens,] q_heads, head_dim), k and v (batch, [new_tokens,] kv_heads,
head_dim), positions (batch, [new_tokens]); strided views of a fused QKV output are taken
as they lie.

A `torch.library` custom op (`kforge::rope_paged_kv_append`, mutating q, k and both
caches) with a fake implementation, so torch.compile sees one opaque node. The Triton
kernel runs for fp16/bf16/fp32 CUDA tensors on sm_80 or newer; elsewhere (a CPU) the op
runs `rope_reference_` then `paged_kv_append_reference`. Either way malformed inputs raise
ValueError first, and with validate=True (the default) one device-to-host read refuses
lengths past the block table and page ids outside the pool; pass validate=False inside a
serving loop or a CUDA graph.
"""

from __future__ import annotations

import torch

from kforge.kernels.serving.paged_kv import check_table_values, paged_kv_append_reference
from kforge.kernels.serving.rope import rope_reference_
from kforge.kernels.serving.rope_append import check_rope_append_inputs, rope_append_
from kforge.ops.paged_attention import kernels_can_run


@torch.library.custom_op("kforge::rope_paged_kv_append", mutates_args=("q", "k", "k_cache", "v_cache"))
def _rope_paged_kv_append(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                          cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, context_lens: torch.Tensor, interleaved: bool,
                          validate: bool) -> None:
    new_k, new_v = check_rope_append_inputs(q, k, v, positions, cos_sin, k_cache, v_cache, block_tables,
                                            context_lens)
    if validate:
        check_table_values(block_tables, context_lens, k_cache.shape[0], k_cache.shape[2],
                           new_tokens=new_k.shape[1])
    if kernels_can_run(q):
        rope_append_(q, k, v, positions, cos_sin, k_cache, v_cache, block_tables, context_lens,
                     interleaved=interleaved, validate=False)
    else:
        rope_reference_(q, k, positions, cos_sin, interleaved=interleaved)
        paged_kv_append_reference(k, v, k_cache, v_cache, block_tables, context_lens)


@_rope_paged_kv_append.register_fake
def _(q, k, v, positions, cos_sin, k_cache, v_cache, block_tables, context_lens, interleaved, validate):
    return None


def rope_paged_kv_append(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                         cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, context_lens: torch.Tensor, *, interleaved: bool = False,
                         validate: bool = True) -> None:
    """Rotate q and k in place by `positions`, then write k and v (batch, [new_tokens,] kv_heads,
    head_dim) into the caches, request b's token j at position context_lens[b] + j."""
    _rope_paged_kv_append(q, k, v, positions, cos_sin, k_cache, v_cache, block_tables, context_lens,
                          bool(interleaved), bool(validate))

"""DeepSeek's multi-head latent attention (MLA) at decode, in the absorbed form FlashMLA computes.

- `decode.py`: the Triton split-KV kernel and its combine over a paged latent cache, the
  split planner, the checks, a float64 reference (gather the cache, plain attention) and the
  FLOP and byte counts.
- `sparse.py`: DeepSeek Sparse Attention (V3.2): the lightning indexer's kernel, the top-k
  selection, and sparse MLA over each query token's selected tokens, with float64 references.
- `sparse_prefill.py`: DSA at prefill, FlashMLA's sparse prefill contract: the indexer tiled over
  a prompt's query tokens (causal), and sparse MLA over a contiguous kv (`sparse.py`'s kernel
  unpaged), with float64 references.
`kforge.ops.mla_decode` wraps it as a PyTorch operator; `kforge.bench.mla` times it against a
PyTorch composition.
"""

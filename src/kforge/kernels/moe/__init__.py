"""Mixture-of-experts feed-forward layers: every expert's tokens in one launch per projection.

- `gating.py`: the routers, logits to (top_k ids, weights): softmax (Mixtral) and
  DeepSeek-V3's sigmoid with its selection bias and group limit; shared experts. A
  PyTorch reference and a fused Triton kernel, a token a program.
- `routing.py`: the routed (token, slot) pairs sorted by expert into one matrix of rows,
  each expert's run padded to a multiple of the tile height, an optional capacity dropping
  the overflow (PyTorch, no host sync; the reference of `dispatch.py`).
- `dispatch.py`: that layout in Triton (histogram, scan, scatter) and the combine back to
  tokens (a gather per token, deterministic); the per-expert loads (padding, utilization).
- `grouped_gemm.py`: the Triton grouped GEMM over those rows, each row tile reading its
  expert's weight; SwiGLU fused into the gate/up projection, the routing weight and the
  scatter back to (token, slot) order fused into the down projection.
  The same file holds DeepGEMM's two layouts in one persistent kernel: contiguous (groups
  along M, m_indices per row) and masked (a block per expert, masked_m rows valid), in
  bf16 or block-scaled FP8, with or without SwiGLU in the epilogue.
- `deepseek.py`: DeepSeek-V3's MoE layer on those kernels (router, shared expert, dispatch,
  gate-up + SwiGLU, down, combine).
- `ffn.py`: the layer, `moe_ffn(x, topk_ids, topk_weights, w13, w2)`: route, gather,
  two grouped GEMMs, sum each token's top_k rows.
- `trace.py`: `kforge trace moe`, the per-expert table of a routing.
"""

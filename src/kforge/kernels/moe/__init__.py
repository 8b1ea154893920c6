"""Mixture-of-experts feed-forward layers: every expert's tokens in one launch per projection.

- `routing.py`: the routed (token, slot) pairs sorted by expert into one matrix of rows,
  each expert's run padded to a multiple of the tile height (PyTorch, no host sync).
- `grouped_gemm.py`: the Triton grouped GEMM over those rows, each row tile reading its
  expert's weight; SwiGLU fused into the gate/up projection, the routing weight and the
  scatter back to (token, slot) order fused into the down projection.
- `ffn.py`: the layer, `moe_ffn(x, topk_ids, topk_weights, w13, w2)`: route, gather,
  two grouped GEMMs, sum each token's top_k rows.
"""

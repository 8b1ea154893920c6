"""Serving kernels: what decoding a model spends its time in. Memory-bound ops judged by the
share of HBM bandwidth they reach (norms, SwiGLU, RoPE, the decode GEMV), a paged KV cache
with flash-decoding attention over it, and RMSNorm fused into the QKV projection."""

"""Batched GEMM in Triton: one launch for a whole batch of independent products."""

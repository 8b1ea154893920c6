"""Elementwise kernels: chains of pointwise ops that eager PyTorch runs as one kernel each,
fused into a single pass over memory."""

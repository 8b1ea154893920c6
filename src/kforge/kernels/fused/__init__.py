"""Fused kernels: work that eager PyTorch runs as several kernels, done in one pass over memory
(GEMMs with epilogues, norms with quantization, softmax with its scaling and mask, ...)."""

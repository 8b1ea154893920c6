"""kforge's kernels as PyTorch operators (`torch.library` custom ops, usable under torch.compile)."""

from kforge.ops.matmul import matmul

__all__ = ["matmul"]

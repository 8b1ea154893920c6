"""kforge's kernels as PyTorch operators (`torch.library` custom ops, usable under torch.compile)."""

from kforge.ops.attention import flash_attention
from kforge.ops.matmul import matmul

__all__ = ["flash_attention", "matmul"]

"""kforge's kernels as PyTorch operators (`torch.library` custom ops, usable under torch.compile)."""

from kforge.ops.attention import flash_attention
from kforge.ops.gemv import gemv
from kforge.ops.matmul import matmul
from kforge.ops.norm_qkv import rms_norm_qkv
from kforge.ops.norms import layer_norm, rms_norm
from kforge.ops.paged_attention import PagedKVCache, paged_decode_attention, paged_kv_append
from kforge.ops.rope import rope_
from kforge.ops.swiglu import swiglu
from kforge.ops.varlen_attention import flash_attention_varlen

__all__ = ["PagedKVCache", "flash_attention", "flash_attention_varlen", "gemv", "layer_norm", "matmul",
           "paged_decode_attention", "paged_kv_append", "rms_norm", "rms_norm_qkv", "rope_", "swiglu"]

"""kforge's kernels as PyTorch operators (`torch.library` custom ops, usable under torch.compile)."""

from kforge.ops.attention import flash_attention
from kforge.ops.fp8 import fp8_gemm, fp8_gemv, fp8_gemv_residual
from kforge.ops.gemv import gemv, gemv_residual, gemv_swiglu
from kforge.ops.matmul import matmul
from kforge.ops.mla import mla_decode
from kforge.ops.moe import grouped_gemm_contiguous, grouped_gemm_masked, moe_combine, moe_dispatch, moe_gate
from kforge.ops.norm_qkv import rms_norm_qkv
from kforge.ops.norms import layer_norm, rms_norm
from kforge.ops.nvfp4 import nvfp4_batched_gemv
from kforge.ops.paged_attention import PagedKVCache, paged_decode_attention, paged_kv_append
from kforge.ops.quant import (dequantize_fp8, dequantize_int4, dequantize_mxfp4, dequantize_nvfp4, quantize_fp8,
                              quantize_int4, quantize_mxfp4, quantize_nvfp4)
from kforge.ops.rope import rope_
from kforge.ops.rope_append import rope_paged_kv_append
from kforge.ops.speculative import chain_speculative_sampling, tree_verify
from kforge.ops.swiglu import swiglu
from kforge.ops.varlen_attention import flash_attention_varlen
from kforge.ops.w4a16 import w4a16_matmul, w4a16_matmul_residual

__all__ = ["PagedKVCache", "chain_speculative_sampling", "dequantize_fp8", "dequantize_int4", "dequantize_mxfp4",
           "dequantize_nvfp4", "flash_attention", "flash_attention_varlen", "fp8_gemm", "fp8_gemv", "fp8_gemv_residual",
           "gemv", "gemv_residual", "gemv_swiglu",
           "grouped_gemm_contiguous", "grouped_gemm_masked", "layer_norm", "matmul", "mla_decode", "moe_combine",
           "moe_dispatch", "moe_gate", "nvfp4_batched_gemv", "paged_decode_attention", "paged_kv_append",
           "quantize_fp8", "quantize_int4", "quantize_mxfp4", "quantize_nvfp4", "rms_norm", "rms_norm_qkv", "rope_",
           "rope_paged_kv_append", "swiglu", "tree_verify", "w4a16_matmul", "w4a16_matmul_residual"]

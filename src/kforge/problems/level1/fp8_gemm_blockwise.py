"""C = dequant(A) @ dequant(B)^T from fp8 e4m3, block-scaled as DeepGEMM does it, bf16 out.

A [M, K] activations with one fp32 scale per 1 x 128 tile (a_scale [M, K/128]); B [N, K]
a weight (out x in) with one per 128 x 128 block (b_scale [ceil(N/128), K/128]), both from
`formats.quantize_fp8_blockwise`. M=4096, N=7168, K=16384 is DeepGEMM's published shape
(1426 TFLOP/s on an H800); 2*M*N*K = 0.96 PFLOP over 184 MB of operands: compute-bound,
against the fp8 tensor-core rate (1979 TFLOP/s dense on an H100 SXM).

The reference: torch._scaled_mm scales per tensor or per row, not per block, so there is no
library call for this product. The reference dequantizes both operands per block in PyTorch
(fp32 product q * scale), rounds them to bf16 and multiplies in bf16 (cuBLAS, fp32
accumulation): a slow but plain statement of the math. A kernel that keeps the exact
products (fp8 x fp8 in the tensor cores, scales in fp32) differs from it by the reference's
own rounding of the operands to bf16: sigma 2.4e-3 at this K and an output RMS of 1
(measured on CPU: M=128, N=512, K=16384, float64 truth; max 0.010 over 65k outputs), plus
one bf16 step of the output each. Hence atol 3e-2 (~13 sigma: ~30M outputs here) and
rtol 1.6e-2 (a bf16 step with room). A missing or misplaced block scale errs by O(1).
"""

import torch
from torch import nn

from kforge.kernels.quant.formats import dequantize_fp8, quantize_fp8_blockwise

M, N, K = 4096, 7168, 16384  # tokens, out_features, in_features (a multiple of 128)
ACT_BLOCK, WEIGHT_BLOCK = (1, 128), (128, 128)

tags = ["gemm", "level1", "fp8", "quant", "deepgemm"]
precision = "as_drawn"  # quantized payloads and their scales keep their format: not exposed
compute_dtype = "fp8"
tiny_sizes = {"M": 67, "N": 200, "K": 256}  # row and column tails; two scale blocks along K and N
forbidden_ops = ["aten::mm", "aten::matmul", "aten::addmm", "aten::bmm", "aten::linear", "aten::_scaled_mm"]
tolerance = {"atol": 3e-2, "rtol": 1.6e-2}


def flops(inputs):
    a, b = inputs[0], inputs[1]
    return 2 * a.shape[0] * a.shape[1] * b.shape[0]


class Model(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor) -> torch.Tensor:
        a_bf16 = dequantize_fp8(a, a_scale, ACT_BLOCK).to(torch.bfloat16)
        b_bf16 = dequantize_fp8(b, b_scale, WEIGHT_BLOCK).to(torch.bfloat16)
        return a_bf16 @ b_bf16.T


def get_inputs():
    # Weights scaled as a trained layer's (1/sqrt(K)): outputs of RMS ~1, as the tolerance assumes.
    a, a_scale = quantize_fp8_blockwise(torch.randn(M, K), ACT_BLOCK)
    b, b_scale = quantize_fp8_blockwise(torch.randn(N, K) * K**-0.5, WEIGHT_BLOCK)
    return [a, b, a_scale, b_scale]


def get_init_inputs():
    return []

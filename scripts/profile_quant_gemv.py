"""The 4-bit GEMVs under Nsight Compute, one launch each, beside a read-only stream of the same bytes:

    ncu --clock-control none --profile-from-start off --set full -o quant-gemv \\
        env PYTHONPATH=src python scripts/profile_quant_gemv.py

The batched NVFP4 GEMV at (M, K, L) = (4096, 7168, 8) and (7168, 16384, 1); one token on a
28672 x 4096 weight: W4A16 as `w4a16_matmul` takes it (`one_token_kernel`: w4a16_mma.cu), on
w4a16_gemv.cu and on the bulk-copy-fed kernel (w4a16_gemv_bulk.cu), and FP8 (fp8_gemv.cu, its
default variant); then `read_stream.cu` over the NVFP4 (4096, 7168, 8) operands' bytes, over
W4A16's and over FP8's: what a pure reader of the same bytes does to DRAM and the SMs.
Compiled and warmed up first (device_timing.profile_once). Run by scripts/gpu_check.sh
(PARTS=profile-quant-gemv), which prints the key sections.
"""

import kforge  # noqa: F401  (before triton)
from pathlib import Path

import numpy as np
import torch

from device_timing import profile_once
from kforge.kernels.quant import fp8_gemv, nvfp4_gemv, w4a16
from kforge.kernels.quant.formats import quantize_fp8_blockwise, quantize_int4, quantize_nvfp4
from kforge.runtime.cuda import CudaKernel


def nvfp4_call(m, k, batches):
    a = quantize_nvfp4(torch.randn(batches, m, k, device="cuda"))
    b = quantize_nvfp4(torch.randn(batches, 1, k, device="cuda") / k**0.5)
    c = torch.empty(batches, m, 1, dtype=torch.float16, device="cuda")
    return lambda: nvfp4_gemv.launch_cuda_gemv(*a, *b, c)


def main():
    qweight, scales = quantize_int4(torch.randn(28672, 4096, device="cuda") / 64, 128)
    x = torch.randn(1, 4096, device="cuda").bfloat16()
    y = torch.empty(1, 28672, dtype=torch.bfloat16, device="cuda")
    q8, scale8 = quantize_fp8_blockwise(torch.randn(28672, 4096, device="cuda") / 64, (128, 128))
    fp8_bytes = q8.numel() + scale8.numel() * 4
    stream = CudaKernel.from_file(Path(__file__).with_name("read_stream.cu"), "read_stream")
    nbytes = nvfp4_gemv.nvfp4_gemv_min_bytes(4096, 7168, 8)
    w4a16_bytes = qweight.numel() + scales.numel() * 2
    buffer = torch.empty(max(nbytes, fp8_bytes) // 16 * 16, dtype=torch.uint8, device="cuda")
    sink = torch.zeros(1, dtype=torch.int32, device="cuda")
    blocks = 8 * torch.cuda.get_device_properties(0).multi_processor_count
    profile_once({
        "nvfp4 4096x7168 L=8": nvfp4_call(4096, 7168, 8),
        "nvfp4 7168x16384 L=1": nvfp4_call(7168, 16384, 1),
        "w4a16 28672x4096 (w4a16_matmul's kernel)": lambda: w4a16.launch_w4a16(x, qweight, scales, 128, None),
        "w4a16 w4a16_gemv.cu 28672x4096": lambda: w4a16.launch_cuda_gemv(x, qweight, scales, 128, y),
        "w4a16 bulk 28672x4096": lambda: w4a16.launch_bulk_gemv(x, qweight, scales, y),
        "fp8 28672x4096": lambda: fp8_gemv.launch_cuda_gemv(x, q8, scale8, y),
        "read stream 132 MB": lambda: stream.launch(blocks, 256, (buffer, np.int64(nbytes // 16), sink)),
        "read stream 61 MB": lambda: stream.launch(blocks, 256, (buffer, np.int64(w4a16_bytes // 16), sink)),
        "read stream 118 MB": lambda: stream.launch(blocks, 256, (buffer, np.int64(fp8_bytes // 16), sink)),
    })


if __name__ == "__main__":
    main()

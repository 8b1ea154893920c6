"""NVFP4 GEMM and batched GEMV on Blackwell (`nvfp4_gemm.cu`): block-scaled tcgen05 MMA on E2M1
codes with E4M3 scales per 16 values, for sm_100a. Not yet run on a GPU (docs/blackwell.md).

Operands as `quant.formats.quantize_nvfp4` makes them: codes packed two a byte along K, block
scales [..., K/16] float8_e4m3fn, one fp32 global scale per tensor.

- `nvfp4_gemm(a, sa, ga, b, sb, gb)`: a [M, K/2], b [N, K/2] -> bf16 [M, N] = dequant(a) @ dequant(b)^T.
- `nvfp4_batched_gemv(...)`: a [L, M, K/2], b [L, 1, K/2] -> fp16 [L, M, 1], the contract of
  `quant.nvfp4_gemv` (GPU MODE's problem), as the same kernel with a 16-column tile of which one
  column is kept.

The tensor core reads the scale factors from TMEM in 128-row x 4-scale chunks (the `.cu` header);
`pack_scale_factors` lays the scales out that way on the host, so the kernel copies them with one
bulk copy a K block and no shuffles. A weight's scales are packed once and can be kept
(`pack_scale_factors` is what a serving engine would store).
"""

from __future__ import annotations

from pathlib import Path

import torch

from kforge.kernels.blackwell import ARCH, require_sm100
from kforge.kernels.quant.formats import NV_BLOCK, dequantize_nvfp4
from kforge.runtime.cuda import CudaKernel, compile_cuda

SOURCE = Path(__file__).with_name("nvfp4_gemm.cu")
BLOCK_M, BLOCK_K = 128, 256  # rows of a tile; codes of a K block (128 bytes a row)
SF_ROWS, SF_PER_MMA = 128, 4  # a scale-factor chunk: 128 rows x 4 scales (one MMA's K = 64), 512 bytes
SF_TILE_BYTES = SF_ROWS * (BLOCK_K // NV_BLOCK)  # a K block's scales for 128 rows: 2048 bytes
GEMM = {"BN": 128, "STAGES": 4, "OUT_FP16": 0}
GEMV = {"BN": 16, "STAGES": 8, "OUT_FP16": 1}
KINDS = ("map", "map", "ptr", "ptr", "ptr", "ptr", "ptr", "i32", "i32", "i32")
THREADS = 128


def shared_bytes(block_n: int, stages: int) -> int:
    """SHARED_BYTES of the source: per slot A's 128 x 128-byte box, B's block_n x 128, and both scale
    tiles; two mbarriers a slot, `done`, the TMEM address, 1024 bytes of alignment slack."""
    return stages * ((BLOCK_M + block_n) * BLOCK_K // 2 + 2 * SF_TILE_BYTES) + (2 * stages + 1) * 8 + 8 + 1024


def pack_scale_factors(scales: torch.Tensor) -> torch.Tensor:
    """Block scales [L, R, K/16] (float8_e4m3fn) -> uint8 [L, ceil(R/128), ceil(K/256), 2048]: per
    128-row tile and K block, four 512-byte chunks (chunk c: scale columns 4c..4c+3 of the block)
    in which row r's 4 scales sit at byte 16 (r % 32) + 4 (r // 32 % 4). Zero-padded to whole
    tiles (zero codes there make the padding's products 0 whatever the scale)."""
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float8_e4m3fn or scales.dim() != 3:
        raise ValueError(f"scales must be a 3-D torch.float8_e4m3fn tensor [L, R, K/16], got "
                         f"{scales.dtype if isinstance(scales, torch.Tensor) else type(scales).__name__}")
    batches, rows, columns = scales.shape
    tiles, k_blocks = -(-rows // SF_ROWS), -(-columns // (BLOCK_K // NV_BLOCK))
    padded = torch.zeros((batches, tiles * SF_ROWS, k_blocks * BLOCK_K // NV_BLOCK), dtype=torch.uint8,
                         device=scales.device)
    padded[:, :rows, :columns] = scales.view(torch.uint8)
    # row = 128 tile + 32 quarter + line, column = 16 block + 4 chunk + byte
    split = padded.view(batches, tiles, 4, 32, k_blocks, 4, 4)
    return split.permute(0, 1, 4, 5, 3, 2, 6).contiguous().view(batches, tiles, k_blocks, SF_TILE_BYTES)


def nvfp4_reference(a, a_scales, a_gs, b, b_scales, b_gs) -> torch.Tensor:
    """float64 dequant(a) @ dequant(b)^T over the last two dims: what the kernels approach to fp32 sums."""
    av, bv = dequantize_nvfp4(a, a_scales, a_gs).double(), dequantize_nvfp4(b, b_scales, b_gs).double()
    return av @ bv.transpose(-1, -2)


def check_nvfp4_inputs(a, a_scales, a_gs, b, b_scales, b_gs, *, gemv: bool) -> None:
    """ValueError unless the operands are NVFP4 of matching shapes that TMA can read: codes uint8
    [L, M, K/2] and [L, N, K/2] (2-D for the GEMM; N = 1 for the GEMV) with K a multiple of 32,
    contiguous and 16-byte aligned; scales float8_e4m3fn [..., K/16]; global scales one fp32 value each."""
    dims = 3 if gemv else 2
    for name, t, dtype in (("a", a, torch.uint8), ("a_scales", a_scales, torch.float8_e4m3fn),
                           ("b", b, torch.uint8), ("b_scales", b_scales, torch.float8_e4m3fn)):
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != dims:
            raise ValueError(f"{name} must be a {dims}-D {dtype}, got "
                             f"{f'{t.dim()}-D {t.dtype}' if isinstance(t, torch.Tensor) else type(t).__name__}")
    for name, t in (("a_gs", a_gs), ("b_gs", b_gs)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.numel() != 1:
            raise ValueError(f"{name} must be a one-element float32 tensor")
        if t.device != a.device:
            raise ValueError(f"{name} must be on a's device ({a.device}): the kernel reads it there")
    k = 2 * a.shape[-1]
    if k % 32 or k == 0:
        raise ValueError(f"K = {k} must be a positive multiple of 32 (16-byte rows of codes)")
    batch = a.shape[:-2]
    if b.shape[:-2] != batch or b.shape[-1] != a.shape[-1] or (gemv and b.shape[-2] != 1):
        expected = ", ".join(str(d) for d in (*batch, 1 if gemv else "N", a.shape[-1]))
        raise ValueError(f"b must be ({expected}) for a {tuple(a.shape)}, got {tuple(b.shape)}")
    for name, codes, scales in (("a", a, a_scales), ("b", b, b_scales)):
        if scales.shape != (*codes.shape[:-1], k // NV_BLOCK):
            raise ValueError(f"{name}_scales must be {(*codes.shape[:-1], k // NV_BLOCK)}, got {tuple(scales.shape)}")
        if not codes.is_contiguous() or codes.data_ptr() % 16:
            raise ValueError(f"{name} must be contiguous and 16-byte aligned: TMA reads it")
    if not gemv and b.shape[0] % 8:
        raise ValueError(f"N = {b.shape[0]} must be a multiple of 8 (16-byte stores of C)")


_KERNELS: dict[tuple, CudaKernel] = {}


def _kernel(variant: dict) -> CudaKernel:
    key = tuple(sorted(variant.items()))
    if key not in _KERNELS:
        _KERNELS[key] = CudaKernel(compile_cuda(SOURCE, arch=ARCH, defines=variant), "nvfp4_gemm")
    return _KERNELS[key]


def _launch(variant: dict, a, a_sf, a_gs, b, b_sf, b_gs, c, batches: int, m: int, n: int, k: int, index: int):
    from kforge.runtime.driver import TensorMaps

    grid = (-(-m // BLOCK_M), -(-n // variant["BN"]), batches)
    with torch.cuda.device(index):
        launch = _kernel(variant).lean(grid, THREADS, index, kinds=KINDS,
                                       shared_bytes=shared_bytes(variant["BN"], variant["STAGES"]))
    # the batches' rows one after another: a tile past M reads the next batch's rows, never stored
    a_map = TensorMaps("uint8", batches * m, k // 2, k // 2, (BLOCK_M, BLOCK_K // 2))
    b_map = TensorMaps("uint8", batches * n, k // 2, k // 2, (variant["BN"], BLOCK_K // 2))
    launch(torch.cuda.current_stream(index).cuda_stream, a_map.address_of(a.data_ptr()),
           b_map.address_of(b.data_ptr()), a_sf.data_ptr(), b_sf.data_ptr(), a_gs.data_ptr(), b_gs.data_ptr(),
           c.data_ptr(), m, n, k)


def nvfp4_gemm(a, a_scales, a_gs, b, b_scales, b_gs) -> torch.Tensor:
    """C [M, N] bf16 = dequant(a) @ dequant(b)^T for NVFP4 a [M, K/2] and b [N, K/2], on an sm_100 GPU."""
    check_nvfp4_inputs(a, a_scales, a_gs, b, b_scales, b_gs, gemv=False)
    index = require_sm100(a, "nvfp4_gemm")
    (m, half_k), n = a.shape, b.shape[0]
    c = torch.empty((m, n), dtype=torch.bfloat16, device=a.device)
    if m and n:
        _launch(GEMM, a, pack_scale_factors(a_scales[None]), a_gs, b, pack_scale_factors(b_scales[None]),
                b_gs, c, 1, m, n, 2 * half_k, index)
    return c


def nvfp4_batched_gemv(a, a_scales, a_gs, b, b_scales, b_gs) -> torch.Tensor:
    """c [L, M, 1] fp16 = dequant(a[l]) @ dequant(b[l])^T for a [L, M, K/2], b [L, 1, K/2], on an sm_100 GPU."""
    check_nvfp4_inputs(a, a_scales, a_gs, b, b_scales, b_gs, gemv=True)
    index = require_sm100(a, "nvfp4_batched_gemv")
    batches, m, half_k = a.shape
    c = torch.empty((batches, m, 1), dtype=torch.float16, device=a.device)
    if batches and m:
        _launch(GEMV, a, pack_scale_factors(a_scales), a_gs, b, pack_scale_factors(b_scales), b_gs,
                c, batches, m, 1, 2 * half_k, index)
    return c

"""NVFP4 GEMM on Hopper in Triton: C = dequant(A) @ dequant(B)^T from 4-bit operands.

A [M, K] and B [N, K] in NVFP4 (`formats.quantize_nvfp4`): E2M1 codes packed two a byte
along K (k = 2j in byte j's low nibble, 2j + 1 in its high one), one E4M3 block scale per 16
consecutive k, one fp32 global scale per tensor. Hopper has no FP4 tensor cores, so each K
tile is decoded in registers and fed to wgmma.

Which operand type for wgmma? The dequantized value is e2m1 * block_scale * global_scale.
- E2M1 values (0, 0.5, 1, 1.5, 2, 3, 4, 6) are exact in e4m3, but the block scale cannot
  stay outside the dot: it changes every 16 k and fp8 wgmma is at least 32 deep, and both
  operands carry one. Splitting K into 16-wide dots is impossible for fp8 (k32 minimum).
- Folding the block scale into the value: e2m1 has 2 significant bits, an e4m3 scale 4,
  so the product has up to 6 (1.5 * 1.875 = 2.8125 = 10.1101b), in [2^-10, 2688]. E4M3
  holds 4 significant bits and nothing below 2^-9: rounding the folded value to fp8 would
  err by up to 2^-4 relative per element (and flush the smallest), on top of the format's
  own quantization. fp16 holds 11 bits and normal numbers from 2^-14 to 65504: the folded
  value is EXACT in fp16 (and in bf16).
So each tile is decoded to fp16 with its block scale multiplied in (exact), wgmma runs
fp16 x fp16 with fp32 accumulation (its products are exact too), and the two global
scales, one scalar, multiply the finished accumulator. Against the float64 product of
`formats.dequantize_nvfp4`'s values the only errors are fp32 summation, the fp32
roundings of the scale products and the final rounding to bf16. The price is the fp16
tensor-core rate, half of fp8's (989 vs 1979 TFLOP/s dense), and the decode on the CUDA
cores.

Decoding a code c: its low 3 bits are the magnitude index i = 2e + m (e the exponent
field, m the mantissa bit). Placed at fp16 bits 9-11 (`i << 9`) they read as an fp16 with
exponent field e and mantissa m: 2^(e - 15) * (1 + m / 2), or for e = 0 the subnormal
m * 2^-15; multiplied by 2^14 that is exactly the E2M1 value 2^(e - 1) * (1 + m / 2), or
m * 0.5. The sign bit goes to bit 15. A few integer ops and two fp16 multiplies (2^14 and
the block scale, both exact) an element, no table. The two nibbles of a byte are decoded
as separate K halves (even k, odd k), each with its own dot: sum_k is order-free, so A's
even columns meet B's even ones and no interleave is needed.

Predicted on the H100 (not measured): the decode is the bottleneck. The sm_90 code of the
128 x 128 tile (8 warps) issues ~1120 instructions a warp per 128-deep K step (each thread
decodes 128 values: ~5 integer ops and one HMUL2 a value, plus the loads), ~2250 issue
cycles an SM, while its 8 HGMMA a warpgroup need ~1024 tensor-core cycles: about 45% of
the fp16 peak at best, 300-450 TFLOP/s at M, N, K in the thousands. The 4-bit operands pay
where bytes dominate (decode-sized M), not at prefill, where an fp8 GEMM is 3-4x faster.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kforge.kernels.quant.formats import NV_BLOCK, dequantize_nvfp4
from kforge.runtime.interpreter import interpreter_active

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INTERPRETER_CONFIG = {"BM": 32, "BN": 32, "BK": 64, "GROUP_M": 4}  # the autotuner needs a GPU


@triton.jit
def _grouped_tile(pid, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    per_group = GROUP_M * tiles_n
    first = (pid // per_group) * GROUP_M
    rows = tl.minimum(tiles_m - first, GROUP_M)
    return first + (pid % per_group) % rows, (pid % per_group) // rows


@triton.jit
def _e2m1_to_fp16(codes):
    """uint8 codes 0..15 -> their E2M1 values in fp16 (see the module docstring)."""
    codes = codes.to(tl.uint16)
    bits = ((codes & 8) << 12) | ((codes & 7) << 9)
    return bits.to(tl.float16, bitcast=True) * 16384.0


@triton.jit
def _decode_tile(packed_ptr, scale_ptr, rows, n_rows, k0, K, BK: tl.constexpr):
    """Rows `rows`, k in [k0, k0 + BK) of a packed NVFP4 matrix as two fp16 tiles [rows, BK/2]
    (even k, odd k), each value times its block scale (exact in fp16). Past the edges: 0."""
    half = k0 // 2 + tl.arange(0, BK // 2)
    blocks = k0 // 16 + tl.arange(0, BK // 16)
    in_rows = (rows < n_rows)[:, None]
    row_offsets = rows.to(tl.int64)[:, None]
    packed = tl.load(packed_ptr + row_offsets * (K // 2) + half[None, :], mask=in_rows & (half < K // 2)[None, :],
                     other=0)
    scales = tl.load(scale_ptr + row_offsets * (K // 16) + blocks[None, :], mask=in_rows & (blocks < K // 16)[None, :],
                     other=0.0).to(tl.float16)
    # byte j of the tile belongs to block j // 8: each scale covers 8 consecutive bytes
    scales = tl.reshape(tl.broadcast_to(scales[:, :, None], (scales.shape[0], BK // 16, 8)),
                        (scales.shape[0], BK // 2))
    return _e2m1_to_fp16(packed & 0xF) * scales, _e2m1_to_fp16(packed >> 4) * scales


@triton.jit
def nvfp4_gemm_kernel(a_ptr, a_scale_ptr, a_global_ptr, b_ptr, b_scale_ptr, b_global_ptr, c_ptr, M, N, K, M_BUCKET,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    # One program per BM x BN output tile, grouped; M_BUCKET is only the autotuner's key.
    tm, tn = _grouped_tile(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP_M)
    rows = tm * BM + tl.arange(0, BM)
    cols = tn * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        a_even, a_odd = _decode_tile(a_ptr, a_scale_ptr, rows, M, k0, K, BK)
        b_even, b_odd = _decode_tile(b_ptr, b_scale_ptr, cols, N, k0, K, BK)
        acc = tl.dot(a_even, b_even.T, acc)
        acc = tl.dot(a_odd, b_odd.T, acc)
    acc = acc * (tl.load(a_global_ptr) * tl.load(b_global_ptr))
    keep = (rows < M)[:, None] & (cols < N)[None, :]
    tl.store(c_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :],
             acc.to(c_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=keep)


def _config(bm, bn, stages, warps):
    return triton.Config({"BM": bm, "BN": bn, "BK": 128, "GROUP_M": 8}, num_stages=stages, num_warps=warps)


# A's decoded tiles feed wgmma from registers, B's go through shared memory; the packed
# bytes and scales come in through the num_stages ring (cp.async). Each config compiles for
# sm_90 within 227 KB with a mainloop free of local memory (tests/kernels/test_fp8_gemm.py);
# 128 x 256 (8 warps) and 64 x 128 on 4 warps were dropped: they spill inside the mainloop.
CONFIGS = [_config(128, 128, 3, 8), _config(128, 128, 4, 8), _config(64, 128, 4, 8), _config(128, 64, 4, 8),
           _config(64, 64, 4, 4)]
nvfp4_gemm_autotuned = triton.autotune(CONFIGS, key=["M_BUCKET", "N", "K"])(nvfp4_gemm_kernel)


def _global_scale(scale, device: torch.device, name: str) -> torch.Tensor:
    scale = torch.as_tensor(scale, dtype=torch.float32, device=device)
    if scale.numel() != 1:
        raise ValueError(f"{name} must be one fp32 value (a 0-d tensor), got shape {tuple(scale.shape)}")
    return scale.reshape(())


def check_nvfp4_gemm_inputs(a: torch.Tensor, a_block_scales: torch.Tensor, b: torch.Tensor,
                            b_block_scales: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> None:
    """Raise ValueError, in one line, on anything nvfp4_gemm cannot take."""
    for name, packed, scales in (("a", a, a_block_scales), ("b", b, b_block_scales)):
        if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8 or packed.dim() != 2:
            raise ValueError(f"{name} must be packed NVFP4: a 2-D uint8 tensor [rows, K // 2], got "
                             f"{getattr(packed, 'dtype', type(packed).__name__)} {tuple(getattr(packed, 'shape', ()))}")
        if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{name}'s block scales must be a float8_e4m3fn tensor, got "
                             f"{getattr(scales, 'dtype', type(scales).__name__)}")
        k = 2 * packed.shape[1]
        if k == 0 or k % NV_BLOCK or tuple(scales.shape) != (packed.shape[0], k // NV_BLOCK):
            raise ValueError(f"{name}: K = {k} must be a positive multiple of {NV_BLOCK} and its block scales "
                             f"[rows, K // 16] = {[packed.shape[0], k // NV_BLOCK]}, got {list(scales.shape)}")
        if not (packed.is_contiguous() and scales.is_contiguous()):
            raise ValueError(f"{name} and its block scales must be contiguous (row-major)")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"inner dimensions differ: a packs K = {2 * a.shape[1]}, b packs K = {2 * b.shape[1]}")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    devices = {t.device for t in (a, a_block_scales, b, b_block_scales)}
    if len(devices) != 1:
        raise ValueError(f"the operands and their scales must be on one device, got {sorted(map(str, devices))}")
    if a.is_cuda and torch.cuda.get_device_capability(a.device) < (8, 0):
        raise ValueError("the NVFP4 kernel needs an Ampere or newer GPU (fp16 tensor cores via tl.dot)")
    if not (a.is_cuda or (a.device.type == "cpu" and interpreter_active())):
        raise ValueError(f"the kernel runs on a CUDA device, or on CPU under the Triton interpreter; a is on "
                         f"{a.device}")


def nvfp4_gemm(a: torch.Tensor, a_block_scales: torch.Tensor, a_global_scale, b: torch.Tensor,
               b_block_scales: torch.Tensor, b_global_scale, *, out_dtype: torch.dtype = torch.bfloat16,
               config: dict | None = None) -> torch.Tensor:
    """C [M, N] = dequantize_nvfp4(a, ...) @ dequantize_nvfp4(b, ...)^T, fp32 accumulation.

    a: packed uint8 [M, K // 2] with block scales float8_e4m3fn [M, K // 16] and a 0-d fp32
    global scale (as quantize_nvfp4 returns them); b likewise [N, K // 2] (a linear layer's
    weight, out x in). `config` (BM, BN, BK, GROUP_M, num_stages, num_warps) skips the
    autotuner: the CPU tests run small tiles under the Triton interpreter.
    """
    check_nvfp4_gemm_inputs(a, a_block_scales, b, b_block_scales, out_dtype)
    a_global = _global_scale(a_global_scale, a.device, "a_global_scale")
    b_global = _global_scale(b_global_scale, a.device, "b_global_scale")
    m, n, k = a.shape[0], b.shape[0], 2 * a.shape[1]
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return c
    args = (a, a_block_scales, a_global, b, b_block_scales, b_global, c, m, n, k, triton.next_power_of_2(m))
    if config is None and not a.is_cuda:
        config = INTERPRETER_CONFIG
    if config is None:
        grid = lambda meta: (triton.cdiv(m, meta["BM"]) * triton.cdiv(n, meta["BN"]),)  # noqa: E731
        nvfp4_gemm_autotuned[grid](*args)
        return c
    tiles = {name: config[name] for name in ("BM", "BN")}
    tiles.update(BK=config.get("BK", 128), GROUP_M=config.get("GROUP_M", 8))
    if tiles["BK"] < 32 or tiles["BK"] & (tiles["BK"] - 1):
        raise ValueError(f"BK must be a power of two >= 32 (each nibble half is a dot >= 16 deep), got {tiles['BK']}")
    grid = (triton.cdiv(m, tiles["BM"]) * triton.cdiv(n, tiles["BN"]),)
    nvfp4_gemm_kernel[grid](*args, **tiles, num_stages=config.get("num_stages", 3),
                            num_warps=config.get("num_warps", 4))
    return c


def nvfp4_gemm_reference(a: torch.Tensor, a_block_scales: torch.Tensor, a_global_scale, b: torch.Tensor,
                         b_block_scales: torch.Tensor, b_global_scale,
                         out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The same product in PyTorch: dequantize both (formats.dequantize_nvfp4), fp32 matmul, one rounding."""
    return (dequantize_nvfp4(a, a_block_scales, a_global_scale)
            @ dequantize_nvfp4(b, b_block_scales, b_global_scale).T).to(out_dtype)

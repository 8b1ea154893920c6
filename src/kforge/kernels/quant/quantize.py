"""Quantize and dequantize kernels in Triton, bit for bit the references of `formats.py`.

Same codes, same scales: every rounding the reference does with a PyTorch cast is done
here exactly, never approximately, because a kernel "close to" a quantizer is a different
quantizer. Three rules keep it exact:
- Divisions are IEEE (`div_rn`): Triton's `/` on fp32 is the approximate div.full.f32.
  Scaling by a power of two (MXFP4) is a multiply by 2^-e, equal to x / 2^e bit for bit:
  both are the correctly rounded value of the same real number.
- Rounding to a narrow float is integer arithmetic on the fp32 bits (`minifloat_code`):
  keep the top mantissa bits, add half an ulp minus one plus the kept lowest bit (ties to
  even), carry into the exponent; below the narrow type's normal range, shift the full
  significand right and round on the remainder. The interpreter's own float casts round
  half up and do not saturate, so they cannot be used. On a GPU, fp32 -> fp8 and fp32 ->
  bf16 take the hardware instead (HARDWARE_CVT: cvt.rn.satfinite.e4m3x2.f32, cvt.rn.bf16.f32,
  both RNE), which is cheaper than ~20 integer ops an element; the GPU tests run both paths.
- E2M1 rounding is seven comparisons against the midpoints of its eight magnitudes,
  `>` where the tie goes down to the even index and `>=` where it goes up; INT4 rounding
  is floor plus a comparison of the fraction with 1/2.

Tiles: a program holds 1024 values at once (4 warps, 8 values a thread, so each bf16 load
is one 16-byte vector), a [BLOCK_R, BLOCK_C] tile with BLOCK_C a multiple of the format's
block: the tile is viewed [BLOCK_R, BLOCK_C // B, B] and each block's amax is a reduction
inside the program. FP8 row scales walk the row twice (amax, then quantize; the second
read comes from L2), and so do tall FP8 blocks (128 x 128: one program per block, 8 rows
a step). The packed output pairs even/odd columns by splitting a [.., BLOCK_C // 2, 2] view.
Compiled for sm_90 (see the tests): 20-39 registers, no spills, so ~12 programs (48 warps,
~24 KB of loads) are resident per SM, about what Little's law asks at 3 TB/s.

Cost, for x in bf16 (2 bytes a value in): FP8 writes 1 byte and a scale per row or per
128 values, 3.0-3.03 bytes an element; INT4/MXFP4/NVFP4 write half a byte and a scale per
group, 2.52-2.56 bytes an element; dequantizing FP4 to fp32 moves 4.5. Streaming kernels,
judged by the share of HBM bandwidth they reach. The arithmetic is not free: div.rn.f32
is ~9 instructions on its fast path and E2M1's compares ~15, against the ~30 instructions
an element the SMs can issue at 1.2e12 elements/s (3 TB/s / 2.5 B). Expected (estimates,
not measured): ~85-90% of copy bandwidth for the FP8 quantizers and all dequantizers,
~75-85% for MXFP4 (a multiply, no divide), ~55-75% for NVFP4 and INT4 (a divide and the
compares on every element).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kforge.kernels.quant import formats

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TILE = 1024  # values a program holds at once: 8 a thread
NUM_WARPS = 4
MAX_BLOCK_COLS = 4096  # FP8 blockwise: the widest block (32 values a thread)

# (mantissa bits, exponent bias, largest finite magnitude code, exponent bits) of each fp8 dtype
FP8_LAYOUT = {torch.float8_e4m3fn: (3, 7, 0x7E, 4), torch.float8_e5m2: (2, 15, 0x7B, 5)}


# -- exact rounding helpers ---------------------------------------------------------------------

@triton.jit
def minifloat_code(x, MANT: tl.constexpr, BIAS: tl.constexpr, MAX_MAG: tl.constexpr, SIGN_BIT: tl.constexpr):
    """fp32 x (finite) -> int32 code of a float with MANT mantissa bits and exponent bias BIAS:
    round to nearest even, magnitude saturated at code MAX_MAG, sign at bit SIGN_BIT."""
    bits = x.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    field = mag >> 23  # fp32 biased exponent
    # Normal result: drop 23 - MANT mantissa bits with RNE (a carry moves into the exponent),
    # then rebias the exponent from 127 to BIAS.
    normal = (mag + ((1 << (22 - MANT)) - 1) + ((mag >> (23 - MANT)) & 1)) >> (23 - MANT)
    normal -= (127 - BIAS) << MANT
    # Subnormal result (x below 2^(1 - BIAS)): the code is x / 2^(1 - BIAS - MANT) rounded to
    # an integer: the 24-bit significand shifted right, ties to even on the bits shifted out.
    shift = tl.minimum(tl.maximum((23 - MANT) + (128 - BIAS) - field, 1), 25)
    significand = (mag & 0x7FFFFF) | 0x800000
    kept = significand >> shift
    rest = significand - (kept << shift)
    half = 1 << (shift - 1)
    kept += ((rest > half) | ((rest == half) & ((kept & 1) == 1))).to(tl.int32)
    code = tl.minimum(tl.where(field < 128 - BIAS, kept, normal), MAX_MAG)
    return code | (((bits >> 31) & 1) << SIGN_BIT)


@triton.jit
def minifloat_value(code, MANT: tl.constexpr, BIAS: tl.constexpr, EXP_BITS: tl.constexpr, SPECIALS: tl.constexpr):
    """int32 code of a float (EXP_BITS exponent bits, MANT mantissa, bias BIAS) -> fp32, exactly.
    SPECIALS: "ieee" (E5M2: the all-ones exponent is inf or NaN), "nan" (E4M3FN: only the
    all-ones magnitude is NaN) or "none" (E2M1: every code is a number)."""
    mag = code & ((1 << (EXP_BITS + MANT)) - 1)
    field = mag >> MANT
    mantissa = mag & ((1 << MANT) - 1)
    normal = ((field + (127 - BIAS)) << 23) | (mantissa << (23 - MANT))
    step = tl.full(mag.shape, (128 - BIAS - MANT) << 23, tl.int32).to(tl.float32, bitcast=True)  # 2^(1-BIAS-MANT)
    subnormal = mantissa.to(tl.float32) * step
    bits = tl.where(field == 0, subnormal.to(tl.int32, bitcast=True), normal)
    if SPECIALS == "ieee":
        bits = tl.where(field == (1 << EXP_BITS) - 1, tl.where(mantissa == 0, 0x7F800000, 0x7FC00000), bits)
    elif SPECIALS == "nan":
        bits = tl.where(mag == (1 << (EXP_BITS + MANT)) - 1, 0x7FC00000, bits)
    bits = bits | (((code >> (EXP_BITS + MANT)) & 1) << 31)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def fp8_code(y, FP8_MAX: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr, MAX_MAG: tl.constexpr,
             HARDWARE_CVT: tl.constexpr):
    """fp32 y -> uint8 fp8 bits, RNE, saturating at +-FP8_MAX."""
    if HARDWARE_CVT:
        y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
        if MANT == 3:
            code = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            code = y.to(tl.float8e5).to(tl.uint8, bitcast=True)
    else:
        code = minifloat_code(y, MANT, BIAS, MAX_MAG, 7).to(tl.uint8)
    return code


@triton.jit
def bf16_bits(y, HARDWARE_CVT: tl.constexpr):
    """fp32 y (finite) -> int16 bits of bf16(y), RNE: bf16 is fp32's top half, so round away the low 16 bits."""
    if HARDWARE_CVT:
        out = y.to(tl.bfloat16).to(tl.int16, bitcast=True)
    else:
        bits = y.to(tl.int32, bitcast=True)
        out = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.int16)
    return out


@triton.jit
def e2m1_code(y):
    """fp32 -> int32 E2M1 code (sign << 3 | index): the index counts the midpoints below |y|,
    `>` where a tie belongs to the lower (even) index, `>=` where to the upper."""
    a = tl.abs(y)
    index = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
             + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32))
    return index | (((y.to(tl.int32, bitcast=True) >> 31) & 1) << 3)


@triton.jit
def pack_pairs(codes, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """int32 codes 0..15 [BLOCK_R, BLOCK_C] -> uint8 [BLOCK_R, BLOCK_C // 2], even column in the low nibble."""
    even, odd = tl.split(tl.reshape(codes, (BLOCK_R, BLOCK_C // 2, 2)))
    return ((even & 0xF) | ((odd & 0xF) << 4)).to(tl.uint8)


@triton.jit
def unpack_pairs(packed, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """uint8 [BLOCK_R, BLOCK_C // 2] -> int32 codes 0..15 [BLOCK_R, BLOCK_C]."""
    packed = packed.to(tl.int32)
    return tl.reshape(tl.join(packed & 0xF, packed >> 4), (BLOCK_R, BLOCK_C))


@triton.jit
def tile_pointers(ptr, rows, cols, stride):
    return ptr + rows.to(tl.int64)[:, None] * stride + cols[None, :]


# -- FP8 ----------------------------------------------------------------------------------------

@triton.jit
def fp8_rowwise_kernel(x_ptr, q_ptr, scale_ptr, n_rows, n_cols, stride_x, stride_q,
                       FP8_MAX: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr, MAX_MAG: tl.constexpr,
                       HARDWARE_CVT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    amax = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C)
        mask = row_ok[:, None] & (cols < n_cols)[None, :]
        x = tl.load(tile_pointers(x_ptr, rows, cols, stride_x), mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
    scale = tl.math.div_rn(amax, tl.full(amax.shape, FP8_MAX, tl.float32))
    scale = tl.where(scale == 0, 1.0, scale)
    tl.store(scale_ptr + rows, scale, mask=row_ok)
    for start in range(0, n_cols, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C)
        mask = row_ok[:, None] & (cols < n_cols)[None, :]
        x = tl.load(tile_pointers(x_ptr, rows, cols, stride_x), mask=mask, other=0.0).to(tl.float32)
        y = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
        tl.store(tile_pointers(q_ptr, rows, cols, stride_q), fp8_code(y, FP8_MAX, MANT, BIAS, MAX_MAG, HARDWARE_CVT),
                 mask=mask)


@triton.jit
def fp8_blockwise_kernel(x_ptr, q_ptr, scale_ptr, n_rows, n_cols, stride_x, stride_q, stride_s,
                         FP8_MAX: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr, MAX_MAG: tl.constexpr,
                         HARDWARE_CVT: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Scale blocks BR x BC (partial at the edges). BLOCK_R >= BR: the [BLOCK_R, BLOCK_C] tile
    holds whole blocks, one pass. BLOCK_R < BR (tall blocks, 128 x 128): the program owns one
    block row and walks its BR rows BLOCK_R at a time, twice (amax, then quantize; L2 serves the second)."""
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = (cols < n_cols)[None, :]
    block_cols = tl.program_id(1) * (BLOCK_C // BC) + tl.arange(0, BLOCK_C // BC)
    if BLOCK_R >= BR:
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        mask = (rows < n_rows)[:, None] & col_ok
        x = tl.load(tile_pointers(x_ptr, rows, cols, stride_x), mask=mask, other=0.0).to(tl.float32)
        blocks = tl.reshape(x, (BLOCK_R // BR, BR, BLOCK_C // BC, BC))
        amax = tl.max(tl.max(tl.abs(blocks), axis=3), axis=1)  # [BLOCK_R // BR, BLOCK_C // BC]
        scale = tl.math.div_rn(amax, tl.full(amax.shape, FP8_MAX, tl.float32))
        scale = tl.where(scale == 0, 1.0, scale)
        y = tl.math.div_rn(blocks, tl.broadcast_to(scale[:, None, :, None], blocks.shape))
        code = fp8_code(tl.reshape(y, (BLOCK_R, BLOCK_C)), FP8_MAX, MANT, BIAS, MAX_MAG, HARDWARE_CVT)
        tl.store(tile_pointers(q_ptr, rows, cols, stride_q), code, mask=mask)
        block_rows = tl.program_id(0) * (BLOCK_R // BR) + tl.arange(0, BLOCK_R // BR)
        block_mask = (block_rows * BR < n_rows)[:, None] & (block_cols * BC < n_cols)[None, :]
        tl.store(tile_pointers(scale_ptr, block_rows, block_cols, stride_s), scale, mask=block_mask)
    else:
        first_row = tl.program_id(0) * BR
        amax = tl.zeros((BLOCK_C // BC,), dtype=tl.float32)
        for step in range(0, BR, BLOCK_R):
            rows = first_row + step + tl.arange(0, BLOCK_R)
            x = tl.load(tile_pointers(x_ptr, rows, cols, stride_x), mask=(rows < n_rows)[:, None] & col_ok,
                        other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.max(tl.reshape(tl.abs(x), (BLOCK_R, BLOCK_C // BC, BC)), axis=2), axis=0))
        scale = tl.math.div_rn(amax, tl.full(amax.shape, FP8_MAX, tl.float32))
        scale = tl.where(scale == 0, 1.0, scale)
        tl.store(scale_ptr + tl.program_id(0).to(tl.int64) * stride_s + block_cols, scale,
                 mask=block_cols * BC < n_cols)
        for step in range(0, BR, BLOCK_R):
            rows = first_row + step + tl.arange(0, BLOCK_R)
            mask = (rows < n_rows)[:, None] & col_ok
            x = tl.load(tile_pointers(x_ptr, rows, cols, stride_x), mask=mask, other=0.0).to(tl.float32)
            blocks = tl.reshape(x, (BLOCK_R, BLOCK_C // BC, BC))
            y = tl.math.div_rn(blocks, tl.broadcast_to(scale[None, :, None], blocks.shape))
            code = fp8_code(tl.reshape(y, (BLOCK_R, BLOCK_C)), FP8_MAX, MANT, BIAS, MAX_MAG, HARDWARE_CVT)
            tl.store(tile_pointers(q_ptr, rows, cols, stride_q), code, mask=mask)


@triton.jit
def fp8_scaled_kernel(src_ptr, dst_ptr, scale_ptr, n_rows, n_cols, stride_src, stride_dst, stride_sr, stride_sc,
                      rows_per_scale, cols_per_scale, QUANTIZE: tl.constexpr,
                      FP8_MAX: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr, MAX_MAG: tl.constexpr,
                      EXP_BITS: tl.constexpr, SPECIALS: tl.constexpr, HARDWARE_CVT: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Elementwise with a given scale per rows_per_scale x cols_per_scale block (a whole
    tensor, a row, a block): QUANTIZE fp8(x / scale), else dequantize fp8 * scale -> fp32."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    scale_ptrs = (scale_ptr + (rows // rows_per_scale).to(tl.int64)[:, None] * stride_sr
                  + (cols // cols_per_scale)[None, :] * stride_sc)
    scale = tl.load(scale_ptrs, mask=mask, other=1.0)
    src = tl.load(tile_pointers(src_ptr, rows, cols, stride_src), mask=mask, other=0)
    if QUANTIZE:
        out = fp8_code(tl.math.div_rn(src.to(tl.float32), scale), FP8_MAX, MANT, BIAS, MAX_MAG, HARDWARE_CVT)
    else:
        out = minifloat_value(src.to(tl.int32), MANT, BIAS, EXP_BITS, SPECIALS) * scale
    tl.store(tile_pointers(dst_ptr, rows, cols, stride_dst), out, mask=mask)


# -- INT4 ---------------------------------------------------------------------------------------

@triton.jit
def int4_quantize_kernel(w_ptr, q_ptr, s_ptr, n_rows, n_cols, stride_w, stride_q, stride_s,
                         GROUP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok = rows < n_rows
    w = tl.load(tile_pointers(w_ptr, rows, cols, stride_w), mask=row_ok[:, None] & (cols < n_cols)[None, :],
                other=0.0).to(tl.float32)
    groups = tl.reshape(w, (BLOCK_R, BLOCK_C // GROUP, GROUP))
    amax = tl.max(tl.abs(groups), axis=2)
    scale_bits = bf16_bits(tl.math.div_rn(amax, tl.full(amax.shape, 7.0, tl.float32)), False)
    scale_bits = tl.where(scale_bits == 0, 0x3F80, scale_bits)  # bf16 1.0 for an all-zero group
    scale = (scale_bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    y = tl.math.div_rn(groups, tl.broadcast_to(scale[:, :, None], groups.shape))
    # round half to even: floor, then up if the fraction (exact for |y| < 2^23) passes 1/2 or ties on an odd floor
    low = tl.floor(y)
    fraction = y - low
    q = low.to(tl.int32)
    q += ((fraction > 0.5) | ((fraction == 0.5) & ((q & 1) == 1))).to(tl.int32)
    q = tl.minimum(tl.maximum(q, -8), 7)
    packed = pack_pairs(tl.reshape(q, (BLOCK_R, BLOCK_C)), BLOCK_R, BLOCK_C)
    half_cols = tl.program_id(1) * (BLOCK_C // 2) + tl.arange(0, BLOCK_C // 2)
    tl.store(tile_pointers(q_ptr, rows, half_cols, stride_q), packed,
             mask=row_ok[:, None] & (half_cols * 2 < n_cols)[None, :])
    group_cols = tl.program_id(1) * (BLOCK_C // GROUP) + tl.arange(0, BLOCK_C // GROUP)
    tl.store(tile_pointers(s_ptr, rows, group_cols, stride_s), scale_bits,
             mask=row_ok[:, None] & (group_cols * GROUP < n_cols)[None, :])


@triton.jit
def int4_dequantize_kernel(q_ptr, s_ptr, out_ptr, n_rows, n_cols, stride_q, stride_s, stride_out,
                           HARDWARE_CVT: tl.constexpr, GROUP: tl.constexpr, BLOCK_R: tl.constexpr,
                           BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    half_cols = tl.program_id(1) * (BLOCK_C // 2) + tl.arange(0, BLOCK_C // 2)
    packed = tl.load(tile_pointers(q_ptr, rows, half_cols, stride_q),
                     mask=row_ok[:, None] & (half_cols * 2 < n_cols)[None, :], other=0)
    codes = unpack_pairs(packed, BLOCK_R, BLOCK_C)
    q = (codes ^ 8) - 8  # 4-bit two's complement -> -8..7
    group_cols = tl.program_id(1) * (BLOCK_C // GROUP) + tl.arange(0, BLOCK_C // GROUP)
    scale_bits = tl.load(tile_pointers(s_ptr, rows, group_cols, stride_s),
                         mask=row_ok[:, None] & (group_cols * GROUP < n_cols)[None, :], other=0)
    scale = (scale_bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    values = tl.reshape(q.to(tl.float32), (BLOCK_R, BLOCK_C // GROUP, GROUP)) * scale[:, :, None]
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    tl.store(tile_pointers(out_ptr, rows, cols, stride_out),
             bf16_bits(tl.reshape(values, (BLOCK_R, BLOCK_C)), HARDWARE_CVT),
             mask=row_ok[:, None] & (cols < n_cols)[None, :])


# -- MXFP4 and NVFP4 ----------------------------------------------------------------------------

@triton.jit
def fp4_quantize_kernel(x_ptr, packed_ptr, scale_ptr, global_scale_ptr, n_rows, n_cols, stride_x, stride_p,
                        stride_s, NVFP4: tl.constexpr, HARDWARE_CVT: tl.constexpr, BLOCK: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """MXFP4 (BLOCK 32, E8M0 scale byte) or NVFP4 (BLOCK 16, E4M3 scale and a global fp32 scale)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok = rows < n_rows
    x = tl.load(tile_pointers(x_ptr, rows, cols, stride_x), mask=row_ok[:, None] & (cols < n_cols)[None, :],
                other=0.0).to(tl.float32)
    blocks = tl.reshape(x, (BLOCK_R, BLOCK_C // BLOCK, BLOCK))
    amax = tl.max(tl.abs(blocks), axis=2)
    if NVFP4:
        global_scale = tl.load(global_scale_ptr)
        per_block = tl.math.div_rn(tl.math.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32)),
                                   tl.broadcast_to(global_scale, amax.shape))
        # The block scales round on the integer path even on a GPU: Triton's fp32 -> e4m3 conversion
        # gave 0x77 (240) for a block scale that rounds to the subnormal 0x07 (H100, 2026-11-21, the
        # edge-block test); one scale per 16 values, so the exact path costs next to nothing here.
        scale_code = fp8_code(per_block, 448.0, 3, 7, 0x7E, False)
        denominator = minifloat_value(scale_code.to(tl.int32), 3, 7, 4, "nan") * global_scale
        empty = denominator == 0  # an all-zero (or vanishing) block: codes 0, and no 0 / 0
        denominator = tl.where(empty, 1.0, denominator)
        y = tl.math.div_rn(blocks, tl.broadcast_to(denominator[:, :, None], blocks.shape))
        codes = tl.where(empty[:, :, None], 0, e2m1_code(y))
    else:
        # e = floor(log2(amax)) - 2 from amax's exponent field, clamped to [-127, 127];
        # x / 2^e as x * 2^-e, 2^-e built from its bits (127 - e is in 2..254).
        e = tl.minimum(tl.maximum((amax.to(tl.int32, bitcast=True) >> 23) - 129, -127), 127)
        scale_code = (e + 127).to(tl.uint8)
        inverse = ((127 - e) << 23).to(tl.float32, bitcast=True)
        codes = e2m1_code(blocks * inverse[:, :, None])
    packed = pack_pairs(tl.reshape(codes, (BLOCK_R, BLOCK_C)), BLOCK_R, BLOCK_C)
    half_cols = tl.program_id(1) * (BLOCK_C // 2) + tl.arange(0, BLOCK_C // 2)
    tl.store(tile_pointers(packed_ptr, rows, half_cols, stride_p), packed,
             mask=row_ok[:, None] & (half_cols * 2 < n_cols)[None, :])
    block_cols = tl.program_id(1) * (BLOCK_C // BLOCK) + tl.arange(0, BLOCK_C // BLOCK)
    tl.store(tile_pointers(scale_ptr, rows, block_cols, stride_s), scale_code,
             mask=row_ok[:, None] & (block_cols * BLOCK < n_cols)[None, :])


@triton.jit
def fp4_dequantize_kernel(packed_ptr, scale_ptr, global_scale_ptr, out_ptr, n_rows, n_cols, stride_p, stride_s,
                          stride_out, NVFP4: tl.constexpr, BLOCK: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    half_cols = tl.program_id(1) * (BLOCK_C // 2) + tl.arange(0, BLOCK_C // 2)
    packed = tl.load(tile_pointers(packed_ptr, rows, half_cols, stride_p),
                     mask=row_ok[:, None] & (half_cols * 2 < n_cols)[None, :], other=0)
    values = minifloat_value(unpack_pairs(packed, BLOCK_R, BLOCK_C), 1, 1, 2, "none")
    block_cols = tl.program_id(1) * (BLOCK_C // BLOCK) + tl.arange(0, BLOCK_C // BLOCK)
    scale_code = tl.load(tile_pointers(scale_ptr, rows, block_cols, stride_s),
                         mask=row_ok[:, None] & (block_cols * BLOCK < n_cols)[None, :], other=0).to(tl.int32)
    if NVFP4:
        scale = minifloat_value(scale_code, 3, 7, 4, "nan") * tl.load(global_scale_ptr)
    else:  # E8M0: 2^(s - 127) from its bits; s = 0 is the subnormal 2^-127
        scale = tl.where(scale_code == 0, 0x00400000, scale_code << 23)
        scale = tl.where(scale_code == 255, 0x7FC00000, scale).to(tl.float32, bitcast=True)
    values = tl.reshape(values, (BLOCK_R, BLOCK_C // BLOCK, BLOCK)) * scale[:, :, None]
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    tl.store(tile_pointers(out_ptr, rows, cols, stride_out), tl.reshape(values, (BLOCK_R, BLOCK_C)),
             mask=row_ok[:, None] & (cols < n_cols)[None, :])


# -- launchers ----------------------------------------------------------------------------------

def hardware_cvt(t: torch.Tensor) -> bool:
    """Use the GPU's RNE conversions (CUDA tensors); the interpreter takes the integer path."""
    from kforge.runtime.interpreter import interpreter_active

    return t.is_cuda and not interpreter_active()


def check_kernel_input(x: torch.Tensor, name: str = "x", min_dim: int = 1) -> None:
    formats.check_float_input(x, name, min_dim)
    if x.dtype not in KERNEL_DTYPES:
        raise ValueError(f"the quant kernels take float16, bfloat16 or float32 {name}, got {x.dtype}")


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x viewed [rows, last dim] with unit column stride (copied only if it has none)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(1) == 1 else rows.contiguous()


def tile_for(cols: int, multiple: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_C): BLOCK_C a power of two >= `multiple` covering up to TILE columns, rows to fill TILE."""
    block_c = max(multiple, min(triton.next_power_of_2(cols), TILE))
    return max(1, TILE // block_c), block_c


def rowwise_tile(cols: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_C) of the FP8 rowwise kernel: up to TILE columns a step, rows to fill TILE."""
    block_c = min(triton.next_power_of_2(cols), TILE)
    return max(1, TILE // block_c), block_c


def blockwise_tile(block: tuple[int, int], cols: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_C) of the FP8 blockwise kernel, ~TILE values a step. Short blocks (br
    rows fit the tile): whole blocks, BLOCK_C up to TILE columns. Tall blocks: BLOCK_C = bc
    and BLOCK_R = TILE // bc rows a step, so a 128 x 128 block is 16 steps of 8 rows and
    there are (R / 128) * (C / 128) programs to spread over the SMs."""
    br, bc = block
    block_c = max(bc, min(triton.next_power_of_2(cols), TILE))
    if TILE // block_c >= br:
        return TILE // block_c, block_c
    return max(1, TILE // bc), bc


def fp8_constants(dtype: torch.dtype) -> dict:
    mant, bias, max_mag, _ = FP8_LAYOUT[dtype]
    return dict(FP8_MAX=formats.fp8_max(dtype), MANT=mant, BIAS=bias, MAX_MAG=max_mag)


def quantize_fp8_rowwise_triton(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn):
    """formats.quantize_fp8_rowwise on the Triton kernel: (q [..., C] fp8, scale [..., 1] fp32)."""
    check_kernel_input(x)
    formats.check_fp8_dtype(dtype)
    rows = as_rows(x)
    n_rows, n_cols = rows.shape
    q = torch.empty((n_rows, n_cols), dtype=dtype, device=x.device)
    scale = torch.empty((n_rows, 1), dtype=torch.float32, device=x.device)
    block_r, block_c = rowwise_tile(n_cols)
    fp8_rowwise_kernel[(triton.cdiv(n_rows, block_r),)](
        rows, q.view(torch.uint8), scale, n_rows, n_cols, rows.stride(0), q.stride(0), **fp8_constants(dtype),
        HARDWARE_CVT=hardware_cvt(x), BLOCK_R=block_r, BLOCK_C=block_c, num_warps=NUM_WARPS)
    return q.view(x.shape), scale.view(*x.shape[:-1], 1)


def kernel_block(block) -> tuple[int, int]:
    br, bc = formats.check_block(block)
    if br & (br - 1) or bc & (bc - 1) or bc > MAX_BLOCK_COLS:
        raise ValueError(f"the blockwise kernel takes power-of-two blocks at most {MAX_BLOCK_COLS} wide, "
                         f"got {(br, bc)}")
    return br, bc


def quantize_fp8_blockwise_triton(x: torch.Tensor, block=(1, 128), dtype: torch.dtype = torch.float8_e4m3fn):
    """formats.quantize_fp8_blockwise on the Triton kernel, for power-of-two blocks (1 x 128, 128 x 128, ...)."""
    check_kernel_input(x, min_dim=2)
    if x.dim() != 2:
        raise ValueError(f"blockwise fp8 takes a 2-D x [R, C], got shape {tuple(x.shape)}")
    formats.check_fp8_dtype(dtype)
    br, bc = kernel_block(block)
    x = as_rows(x)
    n_rows, n_cols = x.shape
    block_r, block_c = blockwise_tile((br, bc), n_cols)
    q = torch.empty((n_rows, n_cols), dtype=dtype, device=x.device)
    scale = torch.empty((triton.cdiv(n_rows, br), triton.cdiv(n_cols, bc)), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n_rows, max(block_r, br)), triton.cdiv(n_cols, block_c))
    fp8_blockwise_kernel[grid](
        x, q.view(torch.uint8), scale, n_rows, n_cols, x.stride(0), q.stride(0), scale.stride(0),
        **fp8_constants(dtype), HARDWARE_CVT=hardware_cvt(x), BR=br, BC=bc, BLOCK_R=block_r, BLOCK_C=block_c,
        num_warps=NUM_WARPS)
    return q, scale


def launch_fp8_scaled(src: torch.Tensor, dst: torch.Tensor, scale: torch.Tensor, block, fp8_dtype: torch.dtype,
                      quantize: bool) -> None:
    """fp8_scaled_kernel over 2-D src/dst with a [R / br, C / bc] scale (0-d scale: one block)."""
    n_rows, n_cols = src.shape
    br, bc = block
    scale2d = scale.reshape(1, 1) if scale.dim() == 0 else scale
    mant, bias, max_mag, exp_bits = FP8_LAYOUT[fp8_dtype]
    block_r, block_c = tile_for(n_cols, 16)
    grid = (triton.cdiv(n_rows, block_r), triton.cdiv(n_cols, block_c))
    fp8_scaled_kernel[grid](
        src, dst, scale2d, n_rows, n_cols, src.stride(0), dst.stride(0), scale2d.stride(0), scale2d.stride(1),
        br, bc, QUANTIZE=quantize, FP8_MAX=formats.fp8_max(fp8_dtype), MANT=mant, BIAS=bias, MAX_MAG=max_mag,
        EXP_BITS=exp_bits, SPECIALS="ieee" if fp8_dtype == torch.float8_e5m2 else "nan", HARDWARE_CVT=hardware_cvt(src),
        BLOCK_R=block_r, BLOCK_C=block_c, num_warps=NUM_WARPS)


def quantize_fp8_tensorwise_triton(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn):
    """formats.quantize_fp8_tensorwise: amax by PyTorch (one reduction), then the elementwise kernel."""
    check_kernel_input(x)
    formats.check_fp8_dtype(dtype)
    scale = formats.scale_from_amax(x.abs().amax().float(), formats.fp8_max(dtype))
    rows = as_rows(x)
    q = torch.empty(rows.shape, dtype=dtype, device=x.device)
    launch_fp8_scaled(rows, q.view(torch.uint8), scale, rows.shape, dtype, quantize=True)
    return q.view(x.shape), scale


def dequantize_fp8_triton(q: torch.Tensor, scale: torch.Tensor, block=None) -> torch.Tensor:
    """formats.dequantize_fp8 on the Triton kernel: block=None takes a 0-d or [..., 1] (per row) scale."""
    if not isinstance(q, torch.Tensor) or q.dtype not in formats.FP8_DTYPES or q.dim() == 0:
        raise ValueError(f"q must be a float8_e4m3fn or float8_e5m2 tensor of at least 1 dimension, got "
                         f"{q.dtype if isinstance(q, torch.Tensor) else type(q).__name__}")
    formats.check_dtype(scale, torch.float32, "scale")
    rows = as_rows(q.view(torch.uint8))
    n_rows, n_cols = rows.shape
    if block is not None:
        br, bc = formats.check_block(block)
        if q.dim() != 2 or scale.shape != (triton.cdiv(n_rows, br), triton.cdiv(n_cols, bc)):
            raise ValueError(f"blockwise scale for q {tuple(q.shape)} and block {(br, bc)} must be "
                             f"[ceil(R/br), ceil(C/bc)], got {tuple(scale.shape)}")
        block = (br, bc)
    elif scale.numel() == 1:
        block = (n_rows, n_cols)
    elif scale.shape == (*q.shape[:-1], 1):
        scale, block = scale.reshape(n_rows, 1), (1, n_cols)
    else:
        raise ValueError(f"scale must be one value or one per row ({(*q.shape[:-1], 1)}) for q {tuple(q.shape)}; "
                         f"got {tuple(scale.shape)} (pass block= for a blockwise scale)")
    out = torch.empty((n_rows, n_cols), dtype=torch.float32, device=q.device)
    launch_fp8_scaled(rows, out, scale, block, q.dtype, quantize=False)
    return out.view(q.shape)


def quantize_int4_triton(w: torch.Tensor, group: int = 128):
    """formats.quantize_int4 on the Triton kernel (group a power of two): (qweight uint8 [N, K // 2], scales bf16)."""
    check_kernel_input(w, "w", min_dim=2)
    if w.dim() != 2:
        raise ValueError(f"w must be 2-D [N, K], got shape {tuple(w.shape)}")
    check_kernel_group(w.shape[1], group)
    w = as_rows(w)
    n_rows, n_cols = w.shape
    qweight = torch.empty((n_rows, n_cols // 2), dtype=torch.uint8, device=w.device)
    scales = torch.empty((n_rows, n_cols // group), dtype=torch.bfloat16, device=w.device)
    block_r, block_c = tile_for(n_cols, group)
    int4_quantize_kernel[(triton.cdiv(n_rows, block_r), triton.cdiv(n_cols, block_c))](
        w, qweight, scales.view(torch.int16), n_rows, n_cols, w.stride(0), qweight.stride(0), scales.stride(0),
        GROUP=group, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=NUM_WARPS)
    return qweight, scales


def check_kernel_group(k: int, group: int) -> None:
    formats.check_int4_group(k, group)
    if group < 2 or group & (group - 1) or group > TILE:
        raise ValueError(f"the INT4 kernels take a power-of-two group from 2 to {TILE}, got {group}")


def dequantize_int4_triton(qweight: torch.Tensor, scales: torch.Tensor, group: int = 128) -> torch.Tensor:
    """formats.dequantize_int4 on the Triton kernel: bf16 [N, K]."""
    formats.check_dtype(qweight, torch.uint8, "qweight")
    formats.check_dtype(scales, torch.bfloat16, "scales")
    if qweight.dim() != 2:
        raise ValueError(f"qweight must be 2-D [N, K // 2], got shape {tuple(qweight.shape)}")
    n_rows, n_cols = qweight.shape[0], 2 * qweight.shape[1]
    check_kernel_group(n_cols, group)
    if scales.shape != (n_rows, n_cols // group):
        raise ValueError(f"scales must be [N, K // group] = {(n_rows, n_cols // group)}, got {tuple(scales.shape)}")
    qweight, scales = as_rows(qweight), as_rows(scales)
    out = torch.empty((n_rows, n_cols), dtype=torch.bfloat16, device=qweight.device)
    block_r, block_c = tile_for(n_cols, group)
    int4_dequantize_kernel[(triton.cdiv(n_rows, block_r), triton.cdiv(n_cols, block_c))](
        qweight, scales.view(torch.int16), out.view(torch.int16), n_rows, n_cols, qweight.stride(0),
        scales.stride(0), out.stride(0), HARDWARE_CVT=hardware_cvt(qweight), GROUP=group, BLOCK_R=block_r,
        BLOCK_C=block_c, num_warps=NUM_WARPS)
    return out


def launch_fp4_quantize(x: torch.Tensor, block: int, global_scale: torch.Tensor | None, scale_dtype: torch.dtype):
    rows = as_rows(x)
    n_rows, n_cols = rows.shape
    packed = torch.empty((n_rows, n_cols // 2), dtype=torch.uint8, device=x.device)
    scales = torch.empty((n_rows, n_cols // block), dtype=scale_dtype, device=x.device)
    block_r, block_c = tile_for(n_cols, block)
    fp4_quantize_kernel[(triton.cdiv(n_rows, block_r), triton.cdiv(n_cols, block_c))](
        rows, packed, scales.view(torch.uint8), global_scale, n_rows, n_cols, rows.stride(0), packed.stride(0),
        scales.stride(0), NVFP4=global_scale is not None, HARDWARE_CVT=hardware_cvt(x), BLOCK=block,
        BLOCK_R=block_r, BLOCK_C=block_c, num_warps=NUM_WARPS)
    return packed.view(*x.shape[:-1], n_cols // 2), scales.view(*x.shape[:-1], n_cols // block)


def quantize_mxfp4_triton(x: torch.Tensor):
    """formats.quantize_mxfp4 on the Triton kernel: (packed uint8 [..., C // 2], E8M0 scales uint8 [..., C // 32])."""
    check_kernel_input(x)
    formats.check_last_dim(x, formats.MX_BLOCK, "MXFP4 blocks of 32")
    return launch_fp4_quantize(x, formats.MX_BLOCK, None, torch.uint8)


def quantize_nvfp4_triton(x: torch.Tensor, global_scale=None):
    """formats.quantize_nvfp4 on the Triton kernel; the global scale (amax / 2688) by PyTorch when not given."""
    check_kernel_input(x)
    formats.check_last_dim(x, formats.NV_BLOCK, "NVFP4 blocks of 16")
    if global_scale is None:
        global_scale = formats.nvfp4_global_scale(x)
    else:
        global_scale = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device)
        if global_scale.numel() != 1:
            raise ValueError(f"global_scale must be one value, got shape {tuple(global_scale.shape)}")
        global_scale = global_scale.reshape(())
    packed, scales = launch_fp4_quantize(x, formats.NV_BLOCK, global_scale, torch.float8_e4m3fn)
    return packed, scales, global_scale


def launch_fp4_dequantize(packed: torch.Tensor, scales: torch.Tensor, block: int,
                          global_scale: torch.Tensor | None) -> torch.Tensor:
    n_cols = 2 * packed.shape[-1]
    rows, scale_rows = as_rows(packed), as_rows(scales.view(torch.uint8))
    out = torch.empty((rows.shape[0], n_cols), dtype=torch.float32, device=packed.device)
    block_r, block_c = tile_for(n_cols, block)
    fp4_dequantize_kernel[(triton.cdiv(rows.shape[0], block_r), triton.cdiv(n_cols, block_c))](
        rows, scale_rows, global_scale, out, rows.shape[0], n_cols, rows.stride(0), scale_rows.stride(0),
        out.stride(0), NVFP4=global_scale is not None, BLOCK=block, BLOCK_R=block_r, BLOCK_C=block_c,
        num_warps=NUM_WARPS)
    return out.view(*packed.shape[:-1], n_cols)


def check_fp4_layout(packed: torch.Tensor, scales: torch.Tensor, block: int, scale_dtype: torch.dtype,
                     name: str) -> None:
    formats.check_dtype(packed, torch.uint8, "packed")
    formats.check_dtype(scales, scale_dtype, "scales")
    cols = 2 * packed.shape[-1] if packed.dim() else 0
    if packed.dim() == 0 or cols == 0 or cols % block or scales.shape != (*packed.shape[:-1], cols // block):
        raise ValueError(f"{name} scales must be [..., C // {block}] for packed [..., C // 2], C a multiple of "
                         f"{block}; got packed {tuple(packed.shape)}, scales {tuple(scales.shape)}")


def dequantize_mxfp4_triton(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """formats.dequantize_mxfp4 on the Triton kernel: float32 [..., C]."""
    check_fp4_layout(packed, scales, formats.MX_BLOCK, torch.uint8, "MXFP4")
    return launch_fp4_dequantize(packed, scales, formats.MX_BLOCK, None)


def dequantize_nvfp4_triton(packed: torch.Tensor, block_scales: torch.Tensor, global_scale) -> torch.Tensor:
    """formats.dequantize_nvfp4 on the Triton kernel: float32 [..., C]."""
    check_fp4_layout(packed, block_scales, formats.NV_BLOCK, torch.float8_e4m3fn, "NVFP4")
    global_scale = torch.as_tensor(global_scale, dtype=torch.float32, device=packed.device).reshape(())
    return launch_fp4_dequantize(packed, block_scales, formats.NV_BLOCK, global_scale)

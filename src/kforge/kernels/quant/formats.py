"""The quantized formats in plain PyTorch: the references every quant kernel matches bit for bit.

Each format stores a tensor as small codes plus scales; dequantization is code value x scale.
Rounding is always to nearest, ties to even, and saturates at the format's largest finite
value (never inf or NaN from a finite input). Inputs are taken as float32 (`x.float()`)
and must be finite; CPU or GPU tensors alike.

FP8 (torch.float8_e4m3fn: 4 exponent bits, 3 mantissa, max 448, no inf; torch.float8_e5m2:
5 and 2, max 57344). One fp32 scale per tensor, per row or per block, scale = amax / fp8_max
so the block's largest value lands on fp8_max; q = fp8(x / scale); x ~ q.float() * scale.
A block of zeros gets scale 1.0 (we never divide by zero).

INT4 group-wise, symmetric (W4A16 weights), W [N, K] as nn.Linear stores it: one bf16 scale
per `group` consecutive k of a row, s = bf16(amax / 7), q = clamp(rne(w / s), -8, 7). Packed
two per byte along k, k = 2j in the LOW nibble of byte j and k = 2j + 1 in the HIGH one,
each a 4-bit two's complement value. Bits per weight 4 + 16 / group (4.125 at group 128).

E2M1 (FP4): 1 sign, 2 exponent (bias 1), 1 mantissa bit. Magnitude index i = 0..7 is the bit
pattern itself, values 0, 0.5, 1, 1.5, 2, 3, 4, 6; code = sign << 3 | i. Ties go to the even
index: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4. The sign bit
is x's, so -0.0 and small negatives that round to zero give code 8 (-0), as IEEE rounding and
the hardware's cvt do. Packed two codes a byte along the last dim, even element in the LOW
nibble (the same order as INT4).

MXFP4 (OCP Microscaling v1.0): blocks of 32 along the last dim share one E8M0 scale, a bare
exponent byte s meaning 2^(s - 127). e = floor(log2(amax)) - 2 puts amax in [4, 8), the top
binade of E2M1 (emax 2; (6, 8) saturates to 6); e is clamped to [-127, 127], an all-zero
block gets -127. 4 + 8 / 32 = 4.25 bits a value.

NVFP4: blocks of 16 along the last dim, one FP8 E4M3 scale each, times one fp32 tensor scale
gs = amax(x) / (6 * 448) that brings the largest block scale to E4M3's max. Block scale
bs = e4m3(amax_block / 6 / gs); element = e2m1(x / (bs * gs)), 0 where bs is 0 (or where the
fp32 product bs * gs underflows to 0, for an absurdly small given gs); dequant = e2m1 value
* (bs * gs), the same fp32 product. 4 + 8 / 16 = 4.5 bits a value.
"""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
E4M3_MAX = 448.0
E2M1_MAX = 6.0
INT4_MAX = 7
MX_BLOCK = 32
NV_BLOCK = 16
E8M0_BIAS = 127
# E2M1 magnitudes by index (the code's low 3 bits).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


# -- checks -------------------------------------------------------------------------------------

def check_float_input(x: torch.Tensor, name: str = "x", min_dim: int = 1) -> None:
    """Raise ValueError unless x is a floating-point tensor of at least `min_dim` dims and not empty."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got "
                         f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.dim() < min_dim or x.numel() == 0:
        raise ValueError(f"{name} must have at least {min_dim} dimension(s) and elements, got shape {tuple(x.shape)}")


def check_last_dim(x: torch.Tensor, multiple: int, what: str, name: str = "x") -> None:
    if x.shape[-1] % multiple:
        raise ValueError(f"{name}'s last dimension must be a multiple of {multiple} ({what}), got shape "
                         f"{tuple(x.shape)}")


def check_fp8_dtype(dtype: torch.dtype) -> None:
    if dtype not in FP8_DTYPES:
        raise ValueError(f"fp8 dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")


def check_dtype(t: torch.Tensor, dtype: torch.dtype, name: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != dtype:
        raise ValueError(f"{name} must be a {dtype} tensor, got "
                         f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an fp8 dtype: 448 (E4M3), 57344 (E5M2)."""
    check_fp8_dtype(dtype)
    return float(torch.finfo(dtype).max)


# -- FP8 ----------------------------------------------------------------------------------------

def to_fp8(y: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """fp32 -> fp8, round to nearest even, saturating at +-fp8_max (the cast alone may give NaN or inf)."""
    limit = fp8_max(dtype)
    return y.clamp(-limit, limit).to(dtype)


def scale_from_amax(amax: torch.Tensor, top: float) -> torch.Tensor:
    """fp32 scale amax / top; 1.0 where that is 0 (an all-zero block), so nothing divides by zero.

    The divisor is a tensor on amax's device: CUDA PyTorch divides by a Python number as a
    multiply by its reciprocal, one ulp off the IEEE quotient at times, and one ulp in a
    scale moves every tie it touches (on the H100, 2026-11-21: 482 of 29.4 M fp8 codes of a
    tensorwise quantization against the CPU's)."""
    scale = amax.float() / torch.full_like(amax, top, dtype=torch.float32)
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def quantize_fp8_tensorwise(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn):
    """(q, scale): one fp32 scale (0-d) = amax(|x|) / fp8_max for the whole tensor."""
    check_float_input(x)
    check_fp8_dtype(dtype)
    xf = x.float()
    scale = scale_from_amax(xf.abs().amax(), fp8_max(dtype))
    return to_fp8(xf / scale, dtype), scale


def quantize_fp8_rowwise(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn):
    """(q, scale): one fp32 scale per row (last dim), scale [..., 1] ([rows, 1] for 2-D x)."""
    check_float_input(x)
    check_fp8_dtype(dtype)
    xf = x.float()
    scale = scale_from_amax(xf.abs().amax(dim=-1, keepdim=True), fp8_max(dtype))
    return to_fp8(xf / scale, dtype), scale


def check_block(block) -> tuple[int, int]:
    try:
        br, bc = (int(b) for b in block)
    except (TypeError, ValueError):
        raise ValueError(f"block must be two positive ints (rows, cols), got {block!r}") from None
    if br < 1 or bc < 1:
        raise ValueError(f"block must be two positive ints (rows, cols), got {block!r}")
    return br, bc


def expand_block_scale(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """A [ceil(R / br), ceil(C / bc)] block scale spread to one value per element of [R, C]."""
    (rows, cols), (br, bc) = shape, block
    return scale.repeat_interleave(br, dim=0)[:rows].repeat_interleave(bc, dim=1)[:, :cols]


def quantize_fp8_blockwise(x: torch.Tensor, block=(1, 128), dtype: torch.dtype = torch.float8_e4m3fn):
    """(q, scale) for 2-D x [R, C]: one fp32 scale per br x bc block, scale [ceil(R/br), ceil(C/bc)].

    Edge blocks are partial (R and C need not be multiples of the block). DeepGEMM scales its
    activations per (1, 128) and its weights per (128, 128)."""
    check_float_input(x, min_dim=2)
    if x.dim() != 2:
        raise ValueError(f"blockwise fp8 takes a 2-D x [R, C], got shape {tuple(x.shape)}")
    check_fp8_dtype(dtype)
    br, bc = check_block(block)
    rows, cols = x.shape
    xf = x.float()
    grid_r, grid_c = -(-rows // br), -(-cols // bc)
    padded = torch.nn.functional.pad(xf.abs(), (0, grid_c * bc - cols, 0, grid_r * br - rows))
    amax = padded.view(grid_r, br, grid_c, bc).amax(dim=(1, 3))
    scale = scale_from_amax(amax, fp8_max(dtype))
    return to_fp8(xf / expand_block_scale(scale, (rows, cols), (br, bc)), dtype), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, block=None) -> torch.Tensor:
    """float32 q * scale. block=None: scale broadcasts (0-d, or [..., 1] per row); else the
    [ceil(R/br), ceil(C/bc)] scale of quantize_fp8_blockwise for 2-D q."""
    if not isinstance(q, torch.Tensor) or q.dtype not in FP8_DTYPES:
        raise ValueError(f"q must be a float8_e4m3fn or float8_e5m2 tensor, got "
                         f"{q.dtype if isinstance(q, torch.Tensor) else type(q).__name__}")
    check_dtype(scale, torch.float32, "scale")
    if block is None:
        return q.float() * scale
    br, bc = check_block(block)
    if q.dim() != 2 or scale.shape != (-(-q.shape[0] // br), -(-q.shape[1] // bc)):
        raise ValueError(f"blockwise scale for q {tuple(q.shape)} and block {(br, bc)} must be "
                         f"[ceil(R/br), ceil(C/bc)], got {tuple(scale.shape)}")
    return q.float() * expand_block_scale(scale, tuple(q.shape), (br, bc))


# -- nibble packing and E2M1 --------------------------------------------------------------------

def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 [..., C] -> uint8 [..., C // 2]: element 2j in byte j's low nibble, 2j + 1 in its high."""
    check_last_dim(codes, 2, "two 4-bit codes per byte", "codes")
    codes = codes.to(torch.uint8)
    return (codes[..., 0::2] & 0xF) | ((codes[..., 1::2] & 0xF) << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., C // 2] -> uint8 codes [..., C], the inverse of pack_nibbles."""
    check_dtype(packed, torch.uint8, "packed")
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """float -> uint8 E2M1 codes (sign << 3 | magnitude index), nearest value, ties to the even
    index, saturating at +-6. Each threshold is a midpoint; `>` sends its tie down, `>=` up,
    whichever neighbour has the even index."""
    mag = x.float().abs()
    index = ((mag > 0.25).to(torch.uint8) + (mag >= 0.75) + (mag > 1.25) + (mag >= 1.75)
             + (mag > 2.5) + (mag >= 3.5) + (mag > 5.0))
    return index | (torch.signbit(x).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes -> float32 values (code 8 is -0.0)."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    mag = table[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -mag, mag)


# -- INT4 group-wise ----------------------------------------------------------------------------

def check_int4_group(k: int, group: int) -> None:
    if not isinstance(group, int) or group < 1:
        raise ValueError(f"group must be a positive int, got {group!r}")
    if k % group or k % 2:
        raise ValueError(f"INT4 needs K (={k}) even and a multiple of the group ({group})")


def quantize_int4(w: torch.Tensor, group: int = 128):
    """(qweight uint8 [N, K // 2], scales bf16 [N, K // group]) for W [N, K], symmetric per group.

    scales = bf16(amax_group / 7), 1.0 where that is 0 (an all-zero group);
    q = clamp(rne(w / scale), -8, 7) in 4-bit two's complement, k = 2j low nibble, 2j + 1 high."""
    check_float_input(w, "w", min_dim=2)
    if w.dim() != 2:
        raise ValueError(f"w must be 2-D [N, K], got shape {tuple(w.shape)}")
    n, k = w.shape
    check_int4_group(k, group)
    wf = w.float()
    amax = wf.abs().view(n, k // group, group).amax(dim=-1)
    scales = (amax / torch.full_like(amax, INT4_MAX)).to(torch.bfloat16)  # IEEE on GPU too: scale_from_amax
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)
    q = torch.round(wf / scales.float().repeat_interleave(group, dim=1)).clamp(-8, 7).to(torch.int8)
    return pack_nibbles((q & 0xF).to(torch.uint8)), scales


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K // 2] -> int8 values -8..7 [N, K] (sign-extending each nibble)."""
    codes = unpack_nibbles(qweight).to(torch.int8)
    return torch.where(codes >= 8, codes - 16, codes)


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, group: int = 128) -> torch.Tensor:
    """bf16 [N, K] = q * scale, the product in fp32 (exact) rounded once to bf16."""
    check_dtype(qweight, torch.uint8, "qweight")
    check_dtype(scales, torch.bfloat16, "scales")
    if qweight.dim() != 2:
        raise ValueError(f"qweight must be 2-D [N, K // 2], got shape {tuple(qweight.shape)}")
    n, k = qweight.shape[0], 2 * qweight.shape[1]
    check_int4_group(k, group)
    if scales.shape != (n, k // group):
        raise ValueError(f"scales must be [N, K // group] = {(n, k // group)}, got {tuple(scales.shape)}")
    values = unpack_int4(qweight).float() * scales.float().repeat_interleave(group, dim=1)
    return values.to(torch.bfloat16)


# -- MXFP4 --------------------------------------------------------------------------------------

def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 s -> float32 2^(s - 127), built from its bits (2^-127 is fp32's subnormal 0x00400000; 255 is NaN)."""
    s = scales.to(torch.int32)
    bits = torch.where(s == 0, torch.full_like(s, 0x00400000), s << 23)
    bits = torch.where(s == 255, torch.full_like(s, 0x7FC00000), bits)
    return bits.view(torch.float32)


def mx_shared_exponent(amax: torch.Tensor) -> torch.Tensor:
    """int32 e = floor(log2(amax)) - 2 clamped to [-127, 127]; -127 for amax 0.

    floor(log2) of a positive normal fp32 is its biased exponent field - 127; a subnormal or
    zero amax has field 0 and lands below -127, so the clamp gives -127, as it should."""
    field = amax.float().view(torch.int32) >> 23
    return (field - 127 - 2).clamp(-E8M0_BIAS, E8M0_BIAS)


def quantize_mxfp4(x: torch.Tensor):
    """(packed uint8 [..., C // 2], scales uint8 E8M0 [..., C // 32]); C a multiple of 32."""
    check_float_input(x)
    check_last_dim(x, MX_BLOCK, "MXFP4 blocks of 32")
    blocks = x.float().unflatten(-1, (-1, MX_BLOCK))
    scales = (mx_shared_exponent(blocks.abs().amax(dim=-1)) + E8M0_BIAS).to(torch.uint8)
    codes = e2m1_encode(blocks / e8m0_to_float(scales).unsqueeze(-1))
    return pack_nibbles(codes.flatten(-2)), scales


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [..., C] = e2m1 value * 2^(s - 127), from quantize_mxfp4's packed codes and scales."""
    check_dtype(packed, torch.uint8, "packed")
    check_dtype(scales, torch.uint8, "scales")
    cols = 2 * packed.shape[-1]
    if packed.dim() == 0 or scales.shape != (*packed.shape[:-1], cols // MX_BLOCK) or cols % MX_BLOCK:
        raise ValueError(f"MXFP4 scales must be [..., C // 32] for packed [..., C // 2] with C a multiple of 32; "
                         f"got packed {tuple(packed.shape)}, scales {tuple(scales.shape)}")
    values = e2m1_decode(unpack_nibbles(packed)).unflatten(-1, (-1, MX_BLOCK))
    return (values * e8m0_to_float(scales).unsqueeze(-1)).flatten(-2)


# -- NVFP4 --------------------------------------------------------------------------------------

def nvfp4_global_scale(x: torch.Tensor) -> torch.Tensor:
    """fp32 0-d amax(|x|) / (6 * 448): the largest block scale lands on E4M3's max; 1.0 for all zeros."""
    return scale_from_amax(x.float().abs().amax(), E2M1_MAX * E4M3_MAX)


def quantize_nvfp4(x: torch.Tensor, global_scale=None):
    """(packed uint8 [..., C // 2], block_scales float8_e4m3fn [..., C // 16], global_scale fp32 0-d)."""
    check_float_input(x)
    check_last_dim(x, NV_BLOCK, "NVFP4 blocks of 16")
    if global_scale is None:
        global_scale = nvfp4_global_scale(x)
    else:
        global_scale = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device)
        if global_scale.numel() != 1:
            raise ValueError(f"global_scale must be one value, got shape {tuple(global_scale.shape)}")
        global_scale = global_scale.reshape(())
    blocks = x.float().unflatten(-1, (-1, NV_BLOCK))
    amax = blocks.abs().amax(dim=-1)
    block_scales = to_fp8(amax / torch.full_like(amax, E2M1_MAX) / global_scale, torch.float8_e4m3fn)
    denominator = (block_scales.float() * global_scale).unsqueeze(-1)
    codes = e2m1_encode(blocks / denominator)
    codes = torch.where(denominator == 0, torch.zeros_like(codes), codes)
    return pack_nibbles(codes.flatten(-2)), block_scales, global_scale


def dequantize_nvfp4(packed: torch.Tensor, block_scales: torch.Tensor, global_scale) -> torch.Tensor:
    """float32 [..., C] = e2m1 value * (block_scale * global_scale), that product in fp32."""
    check_dtype(packed, torch.uint8, "packed")
    check_dtype(block_scales, torch.float8_e4m3fn, "block_scales")
    cols = 2 * packed.shape[-1]
    if packed.dim() == 0 or block_scales.shape != (*packed.shape[:-1], cols // NV_BLOCK) or cols % NV_BLOCK:
        raise ValueError(f"NVFP4 block_scales must be [..., C // 16] for packed [..., C // 2] with C a multiple of "
                         f"16; got packed {tuple(packed.shape)}, block_scales {tuple(block_scales.shape)}")
    global_scale = torch.as_tensor(global_scale, dtype=torch.float32, device=packed.device).reshape(())
    values = e2m1_decode(unpack_nibbles(packed)).unflatten(-1, (-1, NV_BLOCK))
    return (values * (block_scales.float() * global_scale).unsqueeze(-1)).flatten(-2)

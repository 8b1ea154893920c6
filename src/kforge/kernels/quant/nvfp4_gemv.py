"""Batched NVFP4 GEMV in Triton: c[l] = dequant(a[l]) @ dequant(b[l])^T, fp16 [L, M, 1].

Operands as `formats.quantize_nvfp4` makes them (GPU MODE's problem): a [L, M, K/2] uint8
holds E2M1 codes two a byte along K (k = 2j low nibble, 2j + 1 high), a_scales [L, M, K/16]
float8_e4m3fn one per 16 k, a_gs an fp32 scalar; b the same with one row per batch. Each
value is e2m1 * block_scale * global_scale; sums in fp32, c rounded once to fp16.

Bytes: a's codes and scales, M*K*(1/2 + 1/16) per batch, dwarf everything else; the
problem set (M, K, L) = (7168, 16384, 1), (4096, 7168, 8), (7168, 2048, 4) moves 66.1,
132.2 and 33.1 MB: 22.0, 44.1 and 11.0 us at 3.0 TB/s. Hopper has no FP4 arithmetic, so
the kernel decodes on the CUDA cores and is judged by bandwidth.

The budget: at 3 TB/s an SM must consume 20-23 values a clock (0.5625 bytes each, 132
SMs, 1.75-2 GHz) and issues 128 thread-instructions a clock: 5.6-6.3 instructions a value.

Decoding an E2M1 code s|e1 e0 m with no table and no conversion: its 3 magnitude bits
placed at fp32 bits 22-24 (m the top mantissa bit, e1 e0 the low exponent bits) read as
2^(e - 127) * (1 + m/2), or for e = 0 the subnormal m * 2^-127: exactly the E2M1 value
times 2^-126 in both cases; the sign goes to bit 31. One shift and one AND with
0x81C00000 would do it if each nibble's sign sat 9 bits above its magnitude (31 - 22),
not 1. So per 32-bit word (8 codes) two helper words are built first: r1 = bit-select
(0x00770077 ? w : w << 6) has the magnitudes of codes 0, 1, 4, 5 in place and each of
their signs moved to 9 bits above its magnitude's low bit; r2 does the same for codes 2,
3, 6, 7 from w >> 8 and w >> 2. Then code i is `(r << shift_i) & 0x81C00000` as fp32:
two integer instructions, and one FFMA with b's decoded value.

b (one row per batch) is decoded the same way, once per program and chunk for all its
rows, and multiplied by its block scale and 2^(126 - 14): a products are then
a * b * sb * 2^-14, normal and far from overflow for every E2M1 value and E4M3 scale.
A lane owns 4 words (32 k, two scale blocks) of each of BLOCK_M rows; the partial sum of
each 16-value block is multiplied by its a scale; at the end c = acc * 2^14 * a_gs * b_gs.

The sm_90 loop (ptxas) is 5.1 instructions a value with BLOCK_M = 8 (2 to decode each a
code, 1 FFMA, ~0.9 for the per-word helpers, ~0.6 for b's decode shared by 8 rows, loads
and scales), 4.7 with BLOCK_M = 16 (255 registers, 2 programs an SM): 80-90% of the issue
budget, so the kernel is close to ALU-bound as well as memory-bound.

On a GPU a CUDA kernel takes over where it fits (`nvfp4_gemv.cu`, K a multiple of 32): it
decodes two codes per instruction pair into fp16 pairs and multiplies them with HFMA2 (exact,
see its header), about 4.6 instructions a code at 2 rows a warp, and keeps two steps of loads
in flight. Measured on the H100 (scripts/quant_gemv_sweep.py and `kforge bench
quant`): 29.5, 52.4 and 17.4 us on the three shapes,
73.9%, 83.3% and 62.8% of the copy bandwidth (this Triton kernel: 63%, 61%, 53%), 84-88% of a
read-only stream of the same bytes in one launch (86%, 94%, 73% of copy).
"""

from __future__ import annotations

from pathlib import Path

import torch
import triton
import triton.language as tl

SIGN_AND_MAGNITUDE = tl.constexpr(0x81C00000)  # fp32 bit 31 and bits 22-24
IN_PLACE = tl.constexpr(0x00770077)  # magnitude bits of codes 0, 1, 4, 5 (of w), or 2, 3, 6, 7 (of w >> 8)
MOVED = tl.constexpr(0xFF88FF88)  # the other bits: where the signs land
UNIT = tl.constexpr(2.0**126)  # a decoded code * UNIT = its E2M1 value
B_UNIT = tl.constexpr(2.0**112)  # b's values times their scales times 2^112, a's codes times 2^-126 ...
C_UNIT = tl.constexpr(2.0**14)  # ... so products carry 2^-14, which the end takes back


@triton.jit
def _e2m1_sources(word):
    """(r1, r2): codes 0, 1, 4, 5 (r1) and 2, 3, 6, 7 (r2) with magnitude bits at 4p..4p+2 and
    the sign at 4p+9, p = 0, 1, 4, 5 (other bits are ignored)."""
    w = word.to(tl.uint32, bitcast=True)
    r1 = (w & IN_PLACE) | ((w << 6) & MOVED)
    r2 = ((w >> 8) & IN_PLACE) | ((w >> 2) & MOVED)
    return r1, r2


@triton.jit
def _e2m1(r, SHIFT: tl.constexpr):
    """The code whose magnitude sits at bits 22 - SHIFT.. of r, as fp32 = E2M1 value * 2^-126."""
    return ((r << SHIFT) & SIGN_AND_MAGNITUDE).to(tl.float32, bitcast=True)


@triton.jit
def _word_dot(part, a_word, b_word, b_scale):
    """part + sum over the 8 codes of each word of (a * 2^-126) * (b * b_scale)."""
    a1, a2 = _e2m1_sources(a_word)
    b1, b2 = _e2m1_sources(b_word)
    part += _e2m1(a1, 22) * (_e2m1(b1, 22) * UNIT * b_scale)
    part += _e2m1(a1, 18) * (_e2m1(b1, 18) * UNIT * b_scale)
    part += _e2m1(a2, 22) * (_e2m1(b2, 22) * UNIT * b_scale)
    part += _e2m1(a2, 18) * (_e2m1(b2, 18) * UNIT * b_scale)
    part += _e2m1(a1, 6) * (_e2m1(b1, 6) * UNIT * b_scale)
    part += _e2m1(a1, 2) * (_e2m1(b1, 2) * UNIT * b_scale)
    part += _e2m1(a2, 6) * (_e2m1(b2, 6) * UNIT * b_scale)
    part += _e2m1(a2, 2) * (_e2m1(b2, 2) * UNIT * b_scale)
    return part


@triton.jit
def _gemv_step(acc, a_ptrs, b_ptrs, sa_ptrs, sb_ptrs, chunk, kw0, k_words, MASKED: tl.constexpr):
    """acc[chunk, row] += the chunk's 4 words (32 k, 2 scale blocks) of a times b, scaled."""
    if MASKED:  # words past K read as code 0 (+0), their blocks' scales as 0
        word = kw0 + 4 * chunk[:, None, None] + tl.arange(0, 4)[None, None, :]
        block = kw0 // 2 + 2 * chunk[:, None, None] + tl.arange(0, 2)[None, None, :]
        a = tl.load(a_ptrs + kw0, mask=word < k_words, other=0)
        b = tl.load(b_ptrs + kw0, mask=word < k_words, other=0)
        sa = tl.load(sa_ptrs + kw0 // 2, mask=block < k_words // 2, other=0.0)
        sb = tl.load(sb_ptrs + kw0 // 2, mask=block < k_words // 2, other=0.0)
    else:
        a = tl.load(a_ptrs + kw0)
        b = tl.load(b_ptrs + kw0)
        sa = tl.load(sa_ptrs + kw0 // 2)
        sb = tl.load(sb_ptrs + kw0 // 2)
    a0, a1, a2, a3 = _split4(a)
    b0, b1, b2, b3 = _split4(b)
    sa0, sa1 = tl.split(sa.to(tl.float32))
    sb0, sb1 = tl.split(sb.to(tl.float32) * B_UNIT)
    first = _word_dot(_word_dot(tl.zeros_like(sa0), a0, b0, sb0), a1, b1, sb0)
    second = _word_dot(_word_dot(tl.zeros_like(sa1), a2, b2, sb1), a3, b3, sb1)
    return acc + first * sa0 + second * sa1


@triton.jit
def _split4(t):
    """t [..., 4] -> t[..., 0], t[..., 1], t[..., 2], t[..., 3] (register moves only)."""
    t = tl.reshape(t, t.shape[:-1] + [2, 2])
    even, odd = tl.split(t)
    t0, t2 = tl.split(even)
    t1, t3 = tl.split(odd)
    return t0, t1, t2, t3


@triton.jit
def nvfp4_gemv_kernel(a_ptr, sa_ptr, a_gs_ptr, b_ptr, sb_ptr, b_gs_ptr, c_ptr, m_rows, k_words,
                      stride_al, stride_am, stride_sal, stride_sam, stride_bl, stride_sbl, stride_cl, stride_cm,
                      BLOCK_M: tl.constexpr, BLOCK_KW: tl.constexpr):
    # program (i, l): rows i * BLOCK_M.. of batch l; a lane owns chunks of 4 words (32 k): tensors
    # are [chunk, row, ...] so that all share its layout
    BLOCK_CHUNKS: tl.constexpr = BLOCK_KW // 4
    batch = tl.program_id(1).to(tl.int64)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.minimum(offs_m, m_rows - 1)  # past the end: re-read the last row, never store it
    chunk = tl.arange(0, BLOCK_CHUNKS)
    a_ptrs = (a_ptr + batch * stride_al + rows[None, :, None] * stride_am + 4 * chunk[:, None, None]
              + tl.arange(0, 4)[None, None, :])  # [chunk, row, word]
    sa_ptrs = (sa_ptr + batch * stride_sal + rows[None, :, None] * stride_sam + 2 * chunk[:, None, None]
               + tl.arange(0, 2)[None, None, :])  # [chunk, row, block]
    b_ptrs = b_ptr + batch * stride_bl + 4 * chunk[:, None, None] + tl.arange(0, 4)[None, None, :]  # [chunk, 1, word]
    sb_ptrs = sb_ptr + batch * stride_sbl + 2 * chunk[:, None, None] + tl.arange(0, 2)[None, None, :]
    acc = tl.zeros((BLOCK_CHUNKS, BLOCK_M), tl.float32)
    k_full = k_words // BLOCK_KW * BLOCK_KW
    for kw0 in range(0, k_full, BLOCK_KW):
        acc = _gemv_step(acc, a_ptrs, b_ptrs, sa_ptrs, sb_ptrs, chunk, kw0, k_words, False)
    if k_full < k_words:
        acc = _gemv_step(acc, a_ptrs, b_ptrs, sa_ptrs, sb_ptrs, chunk, k_full, k_words, True)
    c = tl.sum(acc, 0) * (tl.load(a_gs_ptr) * tl.load(b_gs_ptr) * C_UNIT)
    tl.store(c_ptr + batch * stride_cl + offs_m * stride_cm, c.to(c_ptr.dtype.element_ty), mask=offs_m < m_rows)


def _config(block_m, block_kw, warps):
    return triton.Config({"BLOCK_M": block_m, "BLOCK_KW": block_kw}, num_warps=warps, num_stages=1)


# BLOCK_KW = 4 words x 32 lanes x warps (one chunk a lane per step) or twice that. K = 2048 is
# 256 words a row: (8, 256, 2) covers it in one unmasked step; the long rows take the others.
CONFIGS = [
    _config(8, 512, 4), _config(16, 512, 4), _config(8, 1024, 4), _config(8, 256, 2), _config(16, 256, 2),
]
nvfp4_gemv_autotuned = triton.autotune(CONFIGS, key=["m_rows", "k_words"])(nvfp4_gemv_kernel)
INTERPRETER_CONFIG = {"BLOCK_M": 4, "BLOCK_KW": 16, "num_warps": 1}  # its autotuner needs a GPU


def _check_global_scale(gs, name: str, device: torch.device) -> None:
    if not isinstance(gs, torch.Tensor) or gs.dtype != torch.float32 or gs.numel() != 1:
        raise ValueError(f"{name} must be a one-element float32 tensor, got "
                         f"{gs.dtype if isinstance(gs, torch.Tensor) else type(gs).__name__}"
                         f"{tuple(gs.shape) if isinstance(gs, torch.Tensor) else ''}")
    if gs.device != device:
        raise ValueError(f"{name} is on {gs.device}, the operands on {device}")


def check_nvfp4_gemv_inputs(a: torch.Tensor, a_scales: torch.Tensor, a_gs: torch.Tensor, b: torch.Tensor,
                            b_scales: torch.Tensor, b_gs: torch.Tensor) -> None:
    """Raise ValueError on anything the kernel cannot take."""
    for t, name, dtype in ((a, "a", torch.uint8), (b, "b", torch.uint8), (a_scales, "a_scales", torch.float8_e4m3fn),
                           (b_scales, "b_scales", torch.float8_e4m3fn)):
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != 3:
            raise ValueError(f"{name} must be a 3-D {dtype} tensor, got "
                             f"{(t.dtype, tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__}")
    batches, m, half_k = a.shape
    k = 2 * half_k
    if k % 16:
        raise ValueError(f"K = {k} (a is {tuple(a.shape)}) must be a multiple of the NVFP4 block, 16")
    expected = {"a_scales": (batches, m, k // 16), "b": (batches, 1, half_k), "b_scales": (batches, 1, k // 16)}
    for t, name in ((a_scales, "a_scales"), (b, "b"), (b_scales, "b_scales")):
        if tuple(t.shape) != expected[name]:
            raise ValueError(f"{name} must be {expected[name]} for a {tuple(a.shape)}, got {tuple(t.shape)}")
    for t in (a_scales, b, b_scales):
        if t.device != a.device:
            raise ValueError(f"all operands must be on one device: a on {a.device}, another on {t.device}")
    _check_global_scale(a_gs, "a_gs", a.device)
    _check_global_scale(b_gs, "b_gs", a.device)
    if any(t.stride(-1) != 1 for t in (a, a_scales, b, b_scales)):
        raise ValueError("a, b and their scales need contiguous rows (stride 1 along K)")
    if any(t.stride(0) % 4 or t.stride(1) % 4 or t.storage_offset() % 4 for t in (a, b)):
        raise ValueError("a and b are read as int32 words: their rows must start at multiples of 4 bytes")
    if m * half_k >= 2**31:
        raise ValueError(f"a batch of {m} x {half_k} bytes: the kernel's offsets within a batch are 32-bit")


CUDA_SOURCE = Path(__file__).with_name("nvfp4_gemv.cu")
CUDA_KINDS = ("ptr",) * 7 + ("i32",) * 10
_CUDA_LAUNCHES: dict[tuple, object] = {}
_FP8_CONVERSIONS: dict[int, bool] = {}


def _converts_fp8(index: int) -> bool:
    if index not in _FP8_CONVERSIONS:
        _FP8_CONVERSIONS[index] = torch.cuda.get_device_capability(index) >= (8, 9)
    return _FP8_CONVERSIONS[index]


def cuda_variant(k: int) -> tuple[int, int]:
    """(ROWS, WARPS) of `nvfp4_gemv.cu` for rows of K values: the fastest measured on the H100
    (scripts/quant_gemv_sweep.py, 2026-11-25): 4 rows a warp for short rows (K <= 4096), where a
    lane has few steps to stream and more rows keep more bytes in flight; 2 for long ones."""
    return (4 if k <= 4096 else 2), 4


def cuda_kernel_fits(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor) -> bool:
    """Whether `nvfp4_gemv.cu` takes these (checked) operands: on a GPU with FP8 conversions
    (sm_89+), K a multiple of 32 and a's and b's rows 16-byte aligned (its loads are 16 bytes),
    the scales' 2-byte aligned, at most 65535 batches (the grid's y)."""
    if not a.is_cuda or not _converts_fp8(a.device.index):
        return False
    batches, _, half_k = a.shape
    return (half_k % 16 == 0 and batches <= 65535
            and all(t.data_ptr() % 16 == 0 and t.stride(0) % 16 == 0 for t in (a, b)) and a.stride(1) % 16 == 0
            and all(t.data_ptr() % 2 == 0 and t.stride(0) % 2 == 0 for t in (a_scales, b_scales))
            and a_scales.stride(1) % 2 == 0)


def launch_cuda_gemv(a: torch.Tensor, a_scales: torch.Tensor, a_gs: torch.Tensor, b: torch.Tensor,
                     b_scales: torch.Tensor, b_gs: torch.Tensor, c: torch.Tensor, *, rows: int | None = None,
                     warps: int | None = None) -> None:
    """c = the batched GEMV on `nvfp4_gemv.cu` (operands that `cuda_kernel_fits`), through a kept
    lean launch per shape; `rows` and `warps` pick the kernel's ROWS and WARPS (default:
    `cuda_variant`)."""
    batches, m, half_k = a.shape
    default_rows, default_warps = cuda_variant(2 * half_k)
    rows, warps = rows or default_rows, warps or default_warps
    index = a.device.index
    key = (rows, warps, m, batches, index)
    launch = _CUDA_LAUNCHES.get(key)
    if launch is None:
        from kforge.runtime.cuda import CudaKernel

        kernel = _CUDA_LAUNCHES.get((rows, warps))
        if kernel is None:
            kernel = _CUDA_LAUNCHES[(rows, warps)] = CudaKernel.from_file(
                CUDA_SOURCE, "nvfp4_gemv", defines={"ROWS": rows, "WARPS": warps})
        launch = _CUDA_LAUNCHES[key] = kernel.lean((triton.cdiv(m, rows * warps), batches), 32 * warps, index,
                                                   kinds=CUDA_KINDS)
    launch(torch._C._cuda_getCurrentRawStream(index), a.data_ptr(), a_scales.data_ptr(), b.data_ptr(),
           b_scales.data_ptr(), a_gs.data_ptr(), b_gs.data_ptr(), c.data_ptr(), m, half_k // 16, a.stride(0) // 16,
           a.stride(1) // 16, a_scales.stride(0) // 2, a_scales.stride(1) // 2, b.stride(0) // 16,
           b_scales.stride(0) // 2, c.stride(0), c.stride(1))


def launch_nvfp4_gemv(a: torch.Tensor, a_scales: torch.Tensor, a_gs: torch.Tensor, b: torch.Tensor,
                      b_scales: torch.Tensor, b_gs: torch.Tensor, config: dict | None) -> torch.Tensor:
    """c [L, M, 1] fp16 for checked inputs; `config` None: the CUDA kernel where it fits
    (`cuda_kernel_fits`), else the Triton autotuner's tile (the interpreter's on CPU)."""
    batches, m, half_k = a.shape
    c = torch.empty((batches, m, 1), dtype=torch.float16, device=a.device)
    if c.numel() == 0:
        return c
    if half_k == 0:
        return c.zero_()
    if config is None and cuda_kernel_fits(a, a_scales, b, b_scales):
        launch_cuda_gemv(a, a_scales, a_gs, b, b_scales, b_gs, c)
        return c
    a_words, b_words = a.view(torch.int32), b.view(torch.int32)
    args = (a_words, a_scales, a_gs, b_words, b_scales, b_gs, c, m, half_k // 4, a_words.stride(0), a_words.stride(1),
            a_scales.stride(0), a_scales.stride(1), b_words.stride(0), b_scales.stride(0), c.stride(0), c.stride(1))
    from kforge.runtime.interpreter import interpreter_active

    if config is None and interpreter_active():
        config = INTERPRETER_CONFIG
    if config is None:
        def grid(meta):
            return (triton.cdiv(m, meta["BLOCK_M"]), batches)

        nvfp4_gemv_autotuned[grid](*args)
    else:
        nvfp4_gemv_kernel[(triton.cdiv(m, config["BLOCK_M"]), batches)](
            *args, BLOCK_M=config["BLOCK_M"], BLOCK_KW=config["BLOCK_KW"], num_warps=config.get("num_warps", 4),
            num_stages=1)
    return c


def nvfp4_batched_gemv(a: torch.Tensor, a_scales: torch.Tensor, a_gs: torch.Tensor, b: torch.Tensor,
                       b_scales: torch.Tensor, b_gs: torch.Tensor, *, config: dict | None = None) -> torch.Tensor:
    """c [L, M, 1] fp16 = dequant(a) @ dequant(b)^T per batch, fp32 sums.

    a [L, M, K/2] uint8, a_scales [L, M, K/16] float8_e4m3fn, a_gs one-element fp32 (as
    `formats.quantize_nvfp4` returns them), b the same with M = 1. On a GPU the CUDA kernel
    (`nvfp4_gemv.cu`) runs where it fits, else the Triton one; `config` (BLOCK_M, BLOCK_KW,
    num_warps) runs the Triton kernel with that tile.
    """
    check_nvfp4_gemv_inputs(a, a_scales, a_gs, b, b_scales, b_gs)
    return launch_nvfp4_gemv(a, a_scales, a_gs, b, b_scales, b_gs, config)


def nvfp4_gemv_reference(a: torch.Tensor, a_scales: torch.Tensor, a_gs: torch.Tensor, b: torch.Tensor,
                         b_scales: torch.Tensor, b_gs: torch.Tensor) -> torch.Tensor:
    """Eager PyTorch: dequantize both operands to fp32, batched matmul, round to fp16."""
    from kforge.kernels.quant.formats import dequantize_nvfp4

    return (dequantize_nvfp4(a, a_scales, a_gs) @ dequantize_nvfp4(b, b_scales, b_gs).transpose(1, 2)).half()


def nvfp4_gemv_min_bytes(m: int, k: int, batches: int) -> int:
    """HBM bytes the batched GEMV must move: a and b (codes and E4M3 scales) read once, the fp16 c
    written once, the two fp32 global scales."""
    operand = k // 2 + k // 16
    return batches * (m + 1) * operand + batches * m * 2 + 2 * 4

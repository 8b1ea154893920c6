"""W4A16 in Triton: y = x @ dequantize_int4(qweight, scales).T for 1 to 32 token rows.

The weight W [N, K] is stored as `formats.quantize_int4` makes it: qweight [N, K/2] uint8,
k = 2j in byte j's low nibble and 2j + 1 in its high one, each a 4-bit two's complement
q in [-8, 7]; scales [N, K/group] bf16. x [M, K] is bf16, y [M, N] bf16, sums in fp32.
Per call the bytes are the packed weight (N*K/2), the scales (N*K/group*2: 6% more at
group 128), x and y (kilobytes): 4.1 bits a weight instead of bf16's 16, so at decode
sizes the kernel is judged, like the bf16 GEMV, by bytes over time against HBM bandwidth.
At N = K = 4096 that is 8.39 MB + 0.26 MB, 2.9 us at 3.0 TB/s.

What is computed: sum_k x[m, k] * q[n, k] * s[n, g(k)] with q * s exact in fp32. The eager
reference (`dequantize_int4` then `x @ W.T`) rounds each q * s to bf16 first, so the two
differ by at most 2^-9 relative per weight, randomly signed, below the bf16 rounding of y.

The problem is the ALU, not the bytes: at 3 TB/s an SM must turn 23-26 packed weights a
clock into products (0.5 byte each, 132 SMs, 1.75-2 GHz) and issues 128 thread-instructions
a clock: ~5 instructions a weight, unpacking, loads and address arithmetic included, and an
int -> float conversion alone (I2F, 16 a clock an SM) would be over budget. Two paths:

1. `w4a16_gemv_kernel`, CUDA cores, M <= GEMV_MAX_BATCH. The packed weight is read as int32
   words: word w of a row holds k = 8w + i in bits 4i..4i+3 (i = 0..7, little-endian bytes).
   XOR-ing the word with 0x88888888 turns each nibble into u = q + 8 in [0, 15]. Then
   `word & (0xF << 4p)` read as an fp32 bit pattern IS a number, u * 2^(4p - 149): bits
   below 23 are a subnormal (2^-149 per unit), and bit 23 (p = 5 at most) continues the
   scale exactly into the first normal binade. So a nibble costs one LOP3, no conversion,
   and the product is one FFMA with x pre-multiplied by 2^(149 - E0 - 4p): u * x * 2^-E0.
   The nibbles 4..7 are taken from `word >> 16` (p = 0..3 again). sum (u - 8) x = sum u x -
   8 sum x: the `- 8 sum x` term is shared by all rows of a program and starts each
   partial sum. The partial over one lane's 32 k (one group) is multiplied by its scale
   once, and y = acc * 2^E0 at the end. The sm_90 loop (ptxas) is 3.1 instructions a
   weight at batch 1 with BLOCK_N = 8, 2.8 with 16: ~60% of the issue budget.
   Range (E0 = 72): x is multiplied by up to 2^77, so |x| must stay below 2^51 (2.3e15, else
   inf; bf16 activations of a working model are many orders below); products are exact
   down to |x| ~ 2^-54 (6e-17) and lose relative precision gradually below (an error of at
   most 2^-77 * scale each, in y's units).
   Layout: a lane owns 4 consecutive words (one 16-byte load) of each of the BLOCK_N rows
   and the matching 32 x values (four 16-byte loads, split into 8 planes in registers), so
   no value crosses lanes until the final sum over K; every tensor is indexed
   [lane-chunk, row, batch, ...] so that Triton gives all of them the same lane layout
   (no shared memory in the loop). N / BLOCK_N programs: 512 at N = 4096 with BLOCK_N = 8,
   4 an SM (116 registers), one wave. At batch 2 the loop is 4.7 instructions a weight
   (an FFMA per batch row), at 4 ~9: the tensor cores take over above 2 rows.

2. `w4a16_mma_kernel`, tensor cores (mma.sync at batch <= 8, wgmma above), 3 <= M <= 32.
   The scale cannot be applied after a dot spanning groups, so each dot spans part of one
   group: per 16 words (128 k) a program makes the 8 nibble planes q * 16^p (exact
   integers in bf16) from the 2^23 magic (`(bits | 0x4B000000) & (0x4B000000 | 0xF << 4p)`
   is 2^23 + u * 16^p as fp32, one FADD removes the offset), and 8 dots with the matching
   planes of x * 16^-p (exact unless x underflows), K = 16 each; the group's scale
   multiplies the [BLOCK_N, BLOCK_B] result. Triton moves the int32 words, not the bf16
   values, into the dot layout (cp.async into shared memory, then LDS): the sm_90 loop of
   the default tile (BLOCK_N = 128, 4 warps) is 3.9, 4.5, 5.2 instructions a weight at
   batch 8, 16, 32. With 32 rows a warp, N = 4096 is only 32 programs: the K loop is cut
   (`split_k`) until about 4 programs an SM exist (16 slices of 256 k at N = K = 4096, 5
   at N = 14336, 3 at 28672). The slices write fp32 partial sums [S, M, N] (4 MB at M = 16,
   N = 4096, S = 16: it should stay in the 50 MB L2) that `split_sum_kernel` adds in a
   fixed order (deterministic) and rounds to bf16: a second launch. Under Triton's
   interpreter (whose bf16 dot is wrong) the dots run in fp32 on the same exact values.

For one token on a GPU a CUDA kernel takes over (`w4a16_gemv.cu`: the same nibble trick, one
warp per 2 or 4 rows, two steps of loads in flight, launched without Triton's per-call host
work). Measured on the H100 at batch 1 (scripts/quant_gemv_sweep.py and `kforge
bench quant`), device time and % of copy on the packed
bytes: N x K = 4096 x 4096 8.4 us (34%), 14336 x 4096 17.3 us (58%), 4096 x 14336 17.1 us (59%),
28672 x 4096 28.5 us (70%), 80-83% of a read-only stream of the same bytes (40, 71, 71, 85% of
copy: the launch and the ramp weigh on a 3-10 MB read); 2.2x, 2.6x, 2.7x, 3.0x cuBLAS's bf16
GEMV on the same weights. This Triton kernel: 33, 56, 56, 69% of copy. Batches 3-32 (the
tensor-core path): 11-30% of copy, paying the split-K partials and a second launch.
Where K <= 4096 and N >= 12288 a second CUDA kernel takes the token (`w4a16_gemv_bulk.cu`: W
streamed into shared memory by the bulk-copy engine, the same sums bit for bit):
14336 x 4096 16.3 us (60%), 28672 x 4096 25.6 us (77%, 90% of the read stream).
On the H200 the tensor-core kernel below took one token faster at 4096 and 28672 rows, so it
takes them there (`one_token_kernel`).

For 2 to 32 tokens on a GPU `w4a16_mma.cu` takes over from the Triton paths above where the
group is 128 k times a power of two: bf16 mma.sync on q decoded by one LOP3 and one bf16x2 FMA a
pair (the nibbles' bf16 bits with 128 as the exponent, minus 136), the warps of a block splitting
K and adding their sums in shared memory: one launch, no partials in HBM. 16 tokens
at 14336 x 4096: 21.1 us against the Triton tensor-core path's 34 and cuBLAS's 45; 32 at 4096 x
4096: 14.7 us against 28.5 and 17.0; 2 tokens at the four widths 9.2-28.3 us against the Triton
CUDA-core path's 10.1-35.9, whose autotuned launch also cost 122 us of host time a call against
`launch_cuda_mma`'s 15 (history: docs/worklogs/quant.md).
"""

from __future__ import annotations

from pathlib import Path

import torch
import triton
import triton.language as tl

from kforge.device import sm_count

MAX_BATCH = 32
GEMV_MAX_BATCH = 2  # CUDA-core path up to here, tensor cores above (see the module docstring)
GROUP_MULTIPLE = 32  # a lane's 32 k lie in one group
MMA_GROUP_MULTIPLE = 128  # a dot's K = 16 words
FLIP = tl.constexpr(-0x77777778)  # 0x88888888: XOR turns each two's complement nibble q into u = q + 8
E0 = 72  # the CUDA-core path accumulates y * 2^-E0 (see the docstring)
X_SHIFT = tl.constexpr(149 - E0)  # x * 2^(149 - E0 - 4p) meets the nibble's u * 2^(4p - 149)
ACC_UNIT = tl.constexpr(2.0**-E0)
Y_UNIT = tl.constexpr(2.0**E0)


@triton.jit
def _split4(t):
    """t [..., 4] -> t[..., 0], t[..., 1], t[..., 2], t[..., 3] (register moves only)."""
    t = tl.reshape(t, t.shape[:-1] + [2, 2])
    even, odd = tl.split(t)
    t0, t2 = tl.split(even)
    t1, t3 = tl.split(odd)
    return t0, t1, t2, t3


@triton.jit
def _planes(x):
    """x [..., 8] -> the 8 tensors x[..., i], i = 0..7 (register moves only)."""
    x = tl.reshape(x, x.shape[:-1] + [2, 2, 2])
    even, odd = tl.split(x)
    x04, x26 = tl.split(even)
    x15, x37 = tl.split(odd)
    x0, x4 = tl.split(x04)
    x2, x6 = tl.split(x26)
    x1, x5 = tl.split(x15)
    x3, x7 = tl.split(x37)
    return x0, x1, x2, x3, x4, x5, x6, x7


# --- path 1: CUDA cores --------------------------------------------------------------------------

@triton.jit
def _nibble(word, MASK: tl.constexpr):
    """u * 2^(4p - 149) for the nibble under MASK = 0xF << 4p of an offset-binary word: its bits as an fp32."""
    return (word & MASK).to(tl.float32, bitcast=True)


@triton.jit
def _word_dot(part, word, x8):
    """part + sum_i u_i * x8[..., i] over the 8 nibbles of each word (x8 pre-scaled by 2^(149 - E0 - 4p))."""
    x0, x1, x2, x3, x4, x5, x6, x7 = _planes(x8)
    high = word >> 16
    part += _nibble(word, 0xF) * x0
    part += _nibble(word, 0xF0) * x1
    part += _nibble(word, 0xF00) * x2
    part += _nibble(word, 0xF000) * x3
    part += _nibble(high, 0xF) * x4
    part += _nibble(high, 0xF0) * x5
    part += _nibble(high, 0xF00) * x6
    part += _nibble(high, 0xF000) * x7
    return part


@triton.jit
def _gemv_step(acc, w_ptrs, x_ptrs, s_rows, chunk, kw0, k_words, GROUP_WORDS: tl.constexpr, MASKED: tl.constexpr):
    """acc[chunk, row, b] += s * sum over the chunk's 4 words (32 k) of q * x, for words kw0 + 4 * chunk.."""
    scale_ptrs = s_rows + ((kw0 + 4 * chunk) // GROUP_WORDS)[:, None, None]
    x_step = x_ptrs + 8 * kw0
    if MASKED:  # whole chunks past K: words 0 (q = 0 after the flip), x 0, scale 0
        live = kw0 + 4 * chunk < k_words
        live4 = live[:, None, None, None]
        words = tl.load(w_ptrs + kw0, mask=live4, other=0)
        x0 = tl.load(x_step, mask=live4, other=0.0).to(tl.float32)
        x1 = tl.load(x_step + 8, mask=live4, other=0.0).to(tl.float32)
        x2 = tl.load(x_step + 16, mask=live4, other=0.0).to(tl.float32)
        x3 = tl.load(x_step + 24, mask=live4, other=0.0).to(tl.float32)
        s = tl.load(scale_ptrs, mask=live[:, None, None], other=0.0).to(tl.float32)
    else:
        words = tl.load(w_ptrs + kw0)
        x0 = tl.load(x_step).to(tl.float32)
        x1 = tl.load(x_step + 8).to(tl.float32)
        x2 = tl.load(x_step + 16).to(tl.float32)
        x3 = tl.load(x_step + 24).to(tl.float32)
        s = tl.load(scale_ptrs).to(tl.float32)
    w0, w1, w2, w3 = _split4(words ^ FLIP)
    # sum (u - 8) x = sum u x - 8 sum x: the second term, in the accumulator's units 2^-E0, starts the sum
    part = tl.sum(x0 + x1 + x2 + x3, 3) * (-8.0 * ACC_UNIT)
    # x * 2^(149 - E0 - 4p), p = i % 4 the nibble's place in its half word: u * 2^(4p - 149) * that = u * x * 2^-E0
    shift = tl.exp2((tl.arange(0, 8) % 4).to(tl.float32) * -4.0 + X_SHIFT)
    part = _word_dot(part, w0, x0 * shift)
    part = _word_dot(part, w1, x1 * shift)
    part = _word_dot(part, w2, x2 * shift)
    part = _word_dot(part, w3, x3 * shift)
    return acc + part * s


@triton.jit
def w4a16_gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr, batch, n_out, k_words, stride_xb, stride_wn, stride_sn, stride_yb,
                      GROUP_WORDS: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_KW: tl.constexpr):
    # a lane owns chunks of 4 words (32 k): tensors are [chunk, row, batch, ...] so that all share its layout
    BLOCK_CHUNKS: tl.constexpr = BLOCK_KW // 4
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_b = tl.arange(0, BLOCK_B)
    chunk = tl.arange(0, BLOCK_CHUNKS)
    rows = tl.minimum(offs_n, n_out - 1)  # past the end: re-read the last row, never store it
    x_rows = tl.minimum(offs_b, batch - 1)
    w_ptrs = (w_ptr + rows[None, :, None, None] * stride_wn + 4 * chunk[:, None, None, None]
              + tl.arange(0, 4)[None, None, None, :])  # [chunk, row, 1, word]
    x_ptrs = (x_ptr + x_rows[None, None, :, None] * stride_xb + 32 * chunk[:, None, None, None]
              + tl.arange(0, 8)[None, None, None, :])  # [chunk, 1, b, i]; + 8 * (kw0 + r) for word r
    s_rows = s_ptr + rows[None, :, None] * stride_sn
    acc = tl.zeros((BLOCK_CHUNKS, BLOCK_N, BLOCK_B), tl.float32)
    k_full = k_words // BLOCK_KW * BLOCK_KW
    for kw0 in range(0, k_full, BLOCK_KW):
        acc = _gemv_step(acc, w_ptrs, x_ptrs, s_rows, chunk, kw0, k_words, GROUP_WORDS, False)
    if k_full < k_words:
        acc = _gemv_step(acc, w_ptrs, x_ptrs, s_rows, chunk, k_full, k_words, GROUP_WORDS, True)
    y = tl.sum(acc, 0) * Y_UNIT  # [row, b]
    keep = (offs_n[:, None] < n_out) & (offs_b[None, :] < batch)
    tl.store(y_ptr + offs_b[None, :] * stride_yb + offs_n[:, None], y.to(y_ptr.dtype.element_ty), mask=keep)


# --- path 2: tensor cores ------------------------------------------------------------------------

@triton.jit
def _plane(words, P: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """q * 16^(P % 4), exact, for nibble P (0..7) of offset-binary words: 2^23 + u * 16^p from the
    bits, minus 2^23 + 8 * 16^p (p = P % 4 within the low or high half word)."""
    if P < 4:
        base = (words & 0xFFFF) | 0x4B000000
    else:
        base = ((words >> 16) & 0xFFFF) | 0x4B000000
    p: tl.constexpr = P % 4
    magic = (base & (0x4B000000 | (0xF << (4 * p)))).to(tl.float32, bitcast=True)
    return (magic - (8388608.0 + 8.0 * 16**p)).to(DOT_DTYPE)


@triton.jit
def _block_dot(words, x8, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """[rows, b] = sum over 16 words (128 k) of q * x: one dot per nibble plane, K = 16."""
    x0, x1, x2, x3, x4, x5, x6, x7 = _planes(x8)
    part = tl.dot(_plane(words, 0, DOT_DTYPE), tl.trans(x0), input_precision=PRECISION)
    part = tl.dot(_plane(words, 1, DOT_DTYPE), tl.trans(x1), part, input_precision=PRECISION)
    part = tl.dot(_plane(words, 2, DOT_DTYPE), tl.trans(x2), part, input_precision=PRECISION)
    part = tl.dot(_plane(words, 3, DOT_DTYPE), tl.trans(x3), part, input_precision=PRECISION)
    part = tl.dot(_plane(words, 4, DOT_DTYPE), tl.trans(x4), part, input_precision=PRECISION)
    part = tl.dot(_plane(words, 5, DOT_DTYPE), tl.trans(x5), part, input_precision=PRECISION)
    part = tl.dot(_plane(words, 6, DOT_DTYPE), tl.trans(x6), part, input_precision=PRECISION)
    return tl.dot(_plane(words, 7, DOT_DTYPE), tl.trans(x7), part, input_precision=PRECISION)


@triton.jit
def w4a16_mma_kernel(x_ptr, w_ptr, s_ptr, out_ptr, batch, n_out, k_words, stride_xb, stride_wn, stride_sn,
                     stride_os, stride_ob, GROUP_WORDS: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr,
                     DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    # program (i, j): rows i * BLOCK_N.., the j-th of num_programs(1) slices of the K blocks (16 words
    # each); it writes out[j] (fp32 partial sums, or y itself when there is one slice)
    blocks = k_words // 16
    per_split = tl.cdiv(blocks, tl.num_programs(1))
    first = tl.program_id(1) * per_split
    last = tl.minimum(first + per_split, blocks)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_b = tl.arange(0, BLOCK_B)
    rows = tl.minimum(offs_n, n_out - 1)
    x_rows = tl.minimum(offs_b, batch - 1)
    word = tl.arange(0, 16)
    plane = tl.arange(0, 8)
    w_ptrs = w_ptr + rows[:, None] * stride_wn + word[None, :]
    x_ptrs = x_ptr + x_rows[:, None, None] * stride_xb + 8 * word[None, :, None] + plane[None, None, :]
    s_rows = s_ptr + rows * stride_sn
    unshift = tl.exp2((-4 * (plane % 4)).to(tl.float32))  # x * 16^-p meets q * 16^p: exact
    acc = tl.zeros((BLOCK_N, BLOCK_B), tl.float32)
    for block in range(first, last):
        kw0 = block * 16
        words = tl.load(w_ptrs + kw0) ^ FLIP
        x8 = (tl.load(x_ptrs + 8 * kw0).to(tl.float32) * unshift).to(DOT_DTYPE)
        part = _block_dot(words, x8, DOT_DTYPE, PRECISION)
        acc += part * tl.load(s_rows + kw0 // GROUP_WORDS).to(tl.float32)[:, None]
    keep = (offs_b[:, None] < batch) & (offs_n[None, :] < n_out)
    out_ptrs = out_ptr + tl.program_id(1) * stride_os + offs_b[:, None] * stride_ob + offs_n[None, :]
    tl.store(out_ptrs, tl.trans(acc).to(out_ptr.dtype.element_ty), mask=keep)


@triton.jit
def split_sum_kernel(part_ptr, y_ptr, splits, numel, BLOCK: tl.constexpr):
    """y = sum over s of part[s] (contiguous [splits, numel] fp32), in order, rounded once to y's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < numel
    total = tl.zeros((BLOCK,), tl.float32)
    for s in range(splits):
        total += tl.load(part_ptr + s * numel + offs, mask=inside, other=0.0)
    tl.store(y_ptr + offs, total.to(y_ptr.dtype.element_ty), mask=inside)


# --- configurations ------------------------------------------------------------------------------

def _gemv_config(block_n, block_kw, warps):
    return triton.Config({"BLOCK_N": block_n, "BLOCK_KW": block_kw}, num_warps=warps, num_stages=1)


def gemv_lane_work(block_b: int, block_n: int, block_kw: int, warps: int) -> int:
    """Accumulators a lane holds per 32 k (BLOCK_B * BLOCK_N) times its chunks per step: the
    loaded words, x planes and partial sums grow with it. sm_90, ptxas: 8 -> 116 registers,
    16 -> 168-179, 32 -> spills."""
    return block_b * block_n * block_kw // (4 * 32 * warps)


# BLOCK_KW = 4 words x 32 lanes x warps (one chunk a lane) or twice that (two chunks, more bytes
# in flight). sm_90 loop, instructions a weight at batch 1 / 2 (registers at batch 1): (8, 512, 4)
# 3.09 / 4.66 (116), (16, 512, 4) 2.82 / - (168), (8, 1024, 4) 3.09 / - (179), (8, 256, 2)
# 3.09 / 4.66 (116), (16, 1024, 8) 2.83 / - (169).
GEMV_CONFIGS = [
    _gemv_config(8, 512, 4), _gemv_config(16, 512, 4), _gemv_config(8, 1024, 4), _gemv_config(8, 256, 2),
    _gemv_config(16, 1024, 8),
]
GEMV_LANE_WORK_LIMIT = 16


def _gemv_configs_for(configs, named_args, **kwargs):
    block_b = kwargs.get("BLOCK_B", named_args.get("BLOCK_B"))
    return [c for c in configs
            if gemv_lane_work(block_b, c.kwargs["BLOCK_N"], c.kwargs["BLOCK_KW"], c.num_warps) <= GEMV_LANE_WORK_LIMIT]


w4a16_gemv_autotuned = triton.autotune(GEMV_CONFIGS, key=["n_out", "k_words", "BLOCK_B", "GROUP_WORDS"],
                                       prune_configs_by={"early_config_prune": _gemv_configs_for})(w4a16_gemv_kernel)

# Tensor-core tiles: at least 16 rows a warp (mma.sync m16, wgmma m64 a warpgroup), cp.async stages
# of 16 words a row. sm_90 loop, instructions a weight at batch 8 / 16 / 32 (mma.sync at 8, wgmma
# above): (128, 4 warps) 3.91 / 4.50 / 5.17, (64, 4) 4.56 / 5.81 / 7.11, (128, 8) 5.17 / 5.27 / 5.95.
# The first is the default (a fixed choice: the split depends on BLOCK_N, which an autotuner would
# change between the kernel and the split sum); the GPU tests check every one.
MMA_CONFIGS = [
    {"BLOCK_N": 128, "num_warps": 4, "num_stages": 3},
    {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
    {"BLOCK_N": 128, "num_warps": 4, "num_stages": 4},
    {"BLOCK_N": 128, "num_warps": 8, "num_stages": 3},
]
PROGRAMS_PER_SM = 4  # split K until the grid has about this many programs per SM
H100_SMS = 132  # for the interpreter, which has no SM count

# under the interpreter: small tiles, one config (its autotuner needs a GPU)
INTERPRETER_GEMV_CONFIG = {"path": "gemv", "BLOCK_N": 4, "BLOCK_KW": 16, "num_warps": 1}
INTERPRETER_MMA_CONFIG = {"path": "mma", "BLOCK_N": 16, "num_warps": 1, "num_stages": 1}


def split_k(n: int, k: int, block_n: int, sms: int) -> int:
    """How many K slices the tensor-core path cuts the work into: enough programs to give each
    of `sms` SMs about PROGRAMS_PER_SM, no slice empty."""
    blocks = k // 128
    if blocks == 0:
        return 1
    wanted = min(blocks, max(1, triton.cdiv(PROGRAMS_PER_SM * sms, triton.cdiv(n, block_n))))
    per_split = triton.cdiv(blocks, wanted)
    return triton.cdiv(blocks, per_split)


# --- the Python API ------------------------------------------------------------------------------

def check_w4a16_inputs(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group: int) -> None:
    """Raise ValueError on anything the kernels cannot take."""
    if not isinstance(group, int) or group < GROUP_MULTIPLE or group % GROUP_MULTIPLE:
        raise ValueError(f"group must be a positive multiple of {GROUP_MULTIPLE}, got {group!r}")
    if x.dim() not in (1, 2) or qweight.dim() != 2 or scales.dim() != 2:
        raise ValueError(f"x must be (K,) or (M, K), qweight (N, K // 2), scales (N, K // group); got "
                         f"{tuple(x.shape)}, {tuple(qweight.shape)}, {tuple(scales.shape)}")
    if x.dtype != torch.bfloat16 or qweight.dtype != torch.uint8 or scales.dtype != torch.bfloat16:
        raise ValueError(f"x must be bfloat16, qweight uint8, scales bfloat16; got {x.dtype}, {qweight.dtype}, "
                         f"{scales.dtype}")
    if not x.device == qweight.device == scales.device:
        raise ValueError(f"x, qweight and scales must be on one device, got {x.device}, {qweight.device}, "
                         f"{scales.device}")
    n, k = qweight.shape[0], 2 * qweight.shape[1]
    if x.shape[-1] != k:
        raise ValueError(f"x has K = {x.shape[-1]} but qweight {tuple(qweight.shape)} holds K = {k}")
    if k % group:
        raise ValueError(f"K = {k} is not a multiple of the group ({group})")
    if tuple(scales.shape) != (n, k // group):
        raise ValueError(f"scales must be (N, K // group) = {(n, k // group)}, got {tuple(scales.shape)}")
    batch = 1 if x.dim() == 1 else x.shape[0]
    if batch > MAX_BATCH:
        raise ValueError(f"w4a16_matmul takes at most {MAX_BATCH} rows, got {batch}: dequantize and use a GEMM "
                         f"for more")
    if x.stride(-1) != 1 or qweight.stride(1) != 1 or scales.stride(1) != 1:
        raise ValueError(f"x, qweight and scales need contiguous rows; got strides {x.stride()}, "
                         f"{qweight.stride()}, {scales.stride()}")
    if qweight.shape[0] > 1 and qweight.stride(0) % 4 or qweight.storage_offset() % 4:
        raise ValueError("qweight is read as int32 words: its rows must start at multiples of 4 bytes")
    if qweight.numel() >= 2**31:
        raise ValueError(f"qweight has {qweight.numel()} bytes: the kernels' offsets are 32-bit")


def _choose_config(batch: int, group: int, on_gpu: bool) -> dict | None:
    """None: the autotuned CUDA-core kernel; else a fixed path and tile (the interpreter's small ones
    off the GPU)."""
    if batch <= GEMV_MAX_BATCH or group % MMA_GROUP_MULTIPLE:
        return None if on_gpu else INTERPRETER_GEMV_CONFIG
    return {"path": "mma", **MMA_CONFIGS[0]} if on_gpu else INTERPRETER_MMA_CONFIG


CUDA_SOURCE = Path(__file__).with_name("w4a16_gemv.cu")
CUDA_KINDS = ("ptr",) * 5 + ("i32",) * 4
_CUDA_LAUNCHES: dict[tuple, object] = {}


def cuda_variant(n: int) -> tuple[int, int]:
    """(ROWS, WARPS) of `w4a16_gemv.cu` for N rows: the fastest measured on the H100
    (scripts/quant_gemv_sweep.py, 2026-11-25): 2 rows a warp up to N = 4096, where 4 would leave
    too few warps to spread over the SMs, 4 above."""
    return (2 if n <= 4096 else 4), 4


def cuda_kernel_fits(x: torch.Tensor, qweight: torch.Tensor, group: int) -> bool:
    """Whether `w4a16_gemv.cu` takes (checked) 2-D x and qweight: one token on a GPU, rows of
    16-byte multiples at 16-byte addresses (its loads of W and x are 16 bytes)."""
    return (x.is_cuda and x.shape[0] == 1 and x.shape[1] % 32 == 0 and group % 32 == 0
            and x.data_ptr() % 16 == 0 and qweight.data_ptr() % 16 == 0 and qweight.stride(0) % 16 == 0)


def launch_cuda_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group: int, y: torch.Tensor, *,
                     rows: int | None = None, warps: int | None = None, residual: torch.Tensor | None = None) -> None:
    """y (1, N) on `w4a16_gemv.cu` for operands that `cuda_kernel_fits`, through a kept lean launch
    per shape; `rows` and `warps` pick the kernel's ROWS and WARPS (default: `cuda_variant`);
    `residual` (1, N) bf16 with a contiguous row is added in the store (the RESIDUAL build)."""
    n, k = qweight.shape[0], x.shape[1]
    default_rows, default_warps = cuda_variant(n)
    rows, warps = rows or default_rows, warps or default_warps
    index, fused = x.device.index, residual is not None
    key = (rows, warps, group, n, index, fused)
    launch = _CUDA_LAUNCHES.get(key)
    if launch is None:
        from kforge.runtime.cuda import CudaKernel

        variant = (rows, warps, group, fused)
        kernel = _CUDA_LAUNCHES.get(variant)
        if kernel is None:
            kernel = _CUDA_LAUNCHES[variant] = CudaKernel.from_file(
                CUDA_SOURCE, "w4a16_gemv",
                defines={"ROWS": rows, "WARPS": warps, "GROUP_UNITS": group // 32, "RESIDUAL": int(fused)})
        launch = _CUDA_LAUNCHES[key] = kernel.lean(triton.cdiv(n, rows * warps), 32 * warps, index, kinds=CUDA_KINDS)
    launch(torch._C._cuda_getCurrentRawStream(index), qweight.data_ptr(), scales.data_ptr(), x.data_ptr(),
           y.data_ptr(), residual.data_ptr() if fused else 0, n, k // 32, qweight.stride(0) // 16, scales.stride(0))


BULK_SOURCE = Path(__file__).with_name("w4a16_gemv_bulk.cu")
BULK_KINDS = ("ptr",) * 4 + ("i32",) * 2
BULK_SHARED_LIMIT = 227 * 1024


def bulk_shared_bytes(k: int, rows: int, consumers: int, stages: int) -> int:
    """`w4a16_gemv_bulk.cu`'s shared memory: the ring (rows * consumers rows of a 2048-byte chunk
    and its 64 bytes of scales, a stage), x prescaled in fp32 with one offset a 32 values, and
    two mbarriers a stage."""
    return stages * rows * consumers * (2048 + 64) + k * 4 + k // 32 * 4 + 2 * stages * 8


def bulk_kernel_fits(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group: int, *,
                     rows: int = 2, consumers: int = 4, stages: int = 2) -> bool:
    """Whether `w4a16_gemv_bulk.cu` takes these operands: what `cuda_kernel_fits` asks, plus
    `_bulk_operands_fit`'s conditions."""
    return cuda_kernel_fits(x, qweight, group) and _bulk_operands_fit(x, qweight, scales, group, rows, consumers,
                                                                      stages)


_CAPABILITY: dict[int, tuple[int, int]] = {}  # by device index (a query costs microseconds a call)


def _capability(index: int) -> tuple[int, int]:
    if index not in _CAPABILITY:
        _CAPABILITY[index] = torch.cuda.get_device_capability(index)
    return _CAPABILITY[index]


def _bulk_operands_fit(x, qweight, scales, group, rows=2, consumers=4, stages=2) -> bool:
    """A Hopper GPU (bulk copies), a K of whole 1024s (a chunk's scales are whole 16-byte copies),
    group 128, W and its scales contiguous (the scales 16-byte aligned), and a ring of `stages`
    beside x in shared memory."""
    k = x.shape[1]
    return (_capability(x.device.index) >= (9, 0) and group == 128 and k % 1024 == 0 and qweight.is_contiguous()
            and scales.is_contiguous() and scales.data_ptr() % 16 == 0
            and bulk_shared_bytes(k, rows, consumers, stages) <= BULK_SHARED_LIMIT)


def bulk_is_faster(n: int, k: int) -> bool:
    """Where `w4a16_gemv_bulk.cu` beat `w4a16_gemv.cu` on the H100 (2026-11-26, the .cu's header):
    rows of one chunk (K <= 4096, x's prescaled copy small enough for two blocks an SM) and many of
    them (N = 14336 and 28672 faster, 4096 and 6144 slower)."""
    return k <= 4096 and n >= 12288


def launch_bulk_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, y: torch.Tensor, *,
                     rows: int = 2, consumers: int = 4, stages: int | None = None) -> None:
    """y (1, N) on `w4a16_gemv_bulk.cu` for operands that `bulk_kernel_fits`: a persistent grid
    (as many blocks as fit at once, at most one a tile), `consumers` warps of `rows` rows each,
    `stages` ring slots (default: as many as fit, at most 4). The defaults were the fastest
    measured (the .cu's header)."""
    n, k = qweight.shape[0], x.shape[1]
    index = x.device.index
    key = ("bulk", rows, consumers, stages, n, k, index)
    launch = _CUDA_LAUNCHES.get(key)
    if launch is None:
        from kforge.runtime.cuda import CudaKernel

        if stages is None:
            stages = max((d for d in range(2, 5) if bulk_shared_bytes(k, rows, consumers, d) <= BULK_SHARED_LIMIT),
                         default=2)
        variant = ("bulk", rows, consumers, stages)
        kernel = _CUDA_LAUNCHES.get(variant)
        if kernel is None:
            kernel = _CUDA_LAUNCHES[variant] = CudaKernel.from_file(
                BULK_SOURCE, "w4a16_gemv_bulk", defines={"ROWS": rows, "CONSUMERS": consumers, "STAGES": stages})
        threads, smem = 32 * (consumers + 1), bulk_shared_bytes(k, rows, consumers, stages)
        with torch.cuda.device(index):
            resident = kernel.max_active_clusters(threads, 1, smem, index)
        grid = min(triton.cdiv(n, rows * consumers), resident)
        launch = _CUDA_LAUNCHES[key] = kernel.lean(grid, threads, index, kinds=BULK_KINDS, shared_bytes=smem)
    launch(torch._C._cuda_getCurrentRawStream(index), qweight.data_ptr(), scales.data_ptr(), x.data_ptr(),
           y.data_ptr(), n, k)


MMA_SOURCE = Path(__file__).with_name("w4a16_mma.cu")
MMA_KINDS = ("ptr",) * 5 + ("i32",) * 9
MMA_SHARED_LIMIT = 48 * 1024  # the kernel's cross-warp sums are static shared memory


def mma_shared_bytes(m_tiles: int, n_tiles: int, k_warps: int) -> int:
    """`w4a16_mma.cu`'s shared memory: every warp but the first hands warp 0 its fp32 sums."""
    return max(k_warps - 1, 1) * m_tiles * n_tiles * 4 * 32 * 4


def mma_variant(n: int, batch: int) -> tuple[int, int, bool, int]:
    """(MT, KW, XPF, DEPTH) of `w4a16_mma.cu`: 16-row m-tiles a warp, warps a block (splitting K),
    whether x is loaded a chunk ahead with W, and the chunks a warp holds in registers.

    One token (H200, eight calls in a CUDA graph; nvidia-h200/gemv-one-token.txt):
    one m-tile over 8 warps, x ahead, three chunks held: 4096 x 4096 6.1-6.3 us, 4096 x 14336
    13.4-13.8 (three runs); from 16384 rows two m-tiles over 4 warps, two chunks: 28672 x 4096
    21.4-22.3 us.
    2 to 32 tokens: the fastest measured on the H100 at N x K = 4096 x 4096, 14336 x 4096, 4096 x
    14336, 28672 x 4096 and batches 2, 3, 8, 16, 32 (scripts/quant_gemv_sweep.py w4a16-batch; at
    batch 2 within 5% of the best): few rows want more warps on K; x ahead pays where its registers
    fit (it did not at 14336 and 28672 rows beyond 8 tokens). At 17-32 tokens and over 16384 rows,
    4 m-tiles spill a little at 32 tokens and still measured fastest."""
    if batch == 1:
        return (2, 4, True, 2) if n >= 16384 else (1, 8, True, 3)
    n_tiles = triton.cdiv(batch, 8)
    if n_tiles == 1:
        return (1, 8, True, 2) if n <= 8192 else (2, 4, True, 2)
    if n_tiles == 2:
        return (2, 8, True, 2) if n <= 8192 else (2, 4, False, 2) if n <= 16384 else (2, 2, False, 2)
    return (2, 8, n_tiles == 3, 2) if n <= 8192 else (3, 2, False, 2) if n <= 16384 else (4, 2, False, 2)


def one_token_kernel(n: int, k: int) -> str:
    """Which CUDA kernel takes one token of an N x K weight: "mma" (`w4a16_mma.cu`), "bulk"
    (`w4a16_gemv_bulk.cu`) or "gemv" (`w4a16_gemv.cu`), by the H200's measurements (eight calls in
    a CUDA graph, `mma_variant`'s figures): the mma kernel up to 4096 rows (measured at 4096: 6.1-6.3
    us against 6.5 at K 4096, 13.4-13.8 against 14.7-14.8 at K 14336) and from 16384 (28672 x 4096:
    21.4-22.3 against the bulk kernel's 23.5); at 6144 and 14336 rows the one-token kernels were as
    fast (7.6 against the mma kernel's 7.6-7.8, 13.3 against 13.4) and keep them, the bulk-fed kernel
    where `bulk_is_faster`. Not re-measured on the H100, where the bulk kernel had been chosen at
    28672 x 4096 (25.6 us) and the mma kernel never timed at one token. The caller checks that the
    kernel takes the operands."""
    if n <= 4096 or n >= 16384:
        return "mma"
    return "bulk" if bulk_is_faster(n, k) else "gemv"


def cuda_mma_fits(x: torch.Tensor, qweight: torch.Tensor, group: int) -> bool:
    """Whether `w4a16_mma.cu` takes (checked) 2-D x: 1 to 32 tokens on a GPU with bf16 mma.sync
    (sm_80 on), K of whole 128-k chunks, a group of a power-of-two number of chunks (the scale's
    index is a shift), 16-byte loads of W and x (rows and addresses 16-byte aligned)."""
    batch, k = x.shape
    chunks_a_group = group // 128
    return (x.is_cuda and 0 < batch <= MAX_BATCH and k % 128 == 0 and group % 128 == 0
            and chunks_a_group & (chunks_a_group - 1) == 0 and _capability(x.device.index) >= (8, 0)
            and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0 and qweight.data_ptr() % 16 == 0
            and qweight.stride(0) % 16 == 0)


def launch_cuda_mma(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group: int, y: torch.Tensor, *,
                    m_tiles: int | None = None, k_warps: int | None = None, x_ahead: bool | None = None,
                    depth: int | None = None, residual: torch.Tensor | None = None) -> None:
    """y (M, N) on `w4a16_mma.cu` for operands that `cuda_mma_fits`; `m_tiles`, `k_warps`, `x_ahead`
    and `depth` pick its MT, KW, XPF and DEPTH (default: `mma_variant`), NT follows M; `residual`
    (M, N) bf16 with contiguous rows is added in the store (the RESIDUAL build). A plan per shape and
    strides keeps the lean launch with its scalar arguments: a call passes the five pointers."""
    r_row = None if residual is None else residual.stride(0)
    key = (x.shape, qweight.shape[0], group, x.stride(0), qweight.stride(0), scales.stride(0), y.stride(0), r_row,
           x.device.index, m_tiles, k_warps, x_ahead, depth)
    plan = _MMA_PLANS.get(key)
    if plan is None:
        plan = _MMA_PLANS[key] = _mma_plan(x, qweight, scales, group, y, m_tiles, k_warps, x_ahead, depth, r_row)
    launch, index, scalars = plan
    launch(torch._C._cuda_getCurrentRawStream(index), qweight.data_ptr(), scales.data_ptr(), x.data_ptr(),
           y.data_ptr(), 0 if residual is None else residual.data_ptr(), *scalars)


_MMA_PLANS: dict[tuple, tuple] = {}


def _mma_plan(x, qweight, scales, group, y, m_tiles, k_warps, x_ahead, depth, r_row) -> tuple:
    """(lean launch, device index, the scalar arguments) of `w4a16_mma.cu` for one shape."""
    batch, k = x.shape
    n = qweight.shape[0]
    default_mt, default_kw, default_xpf, default_depth = mma_variant(n, batch)
    m_tiles, k_warps, depth = m_tiles or default_mt, k_warps or default_kw, depth or default_depth
    x_ahead = default_xpf if x_ahead is None else x_ahead
    n_tiles = triton.cdiv(batch, 8)
    shared = mma_shared_bytes(m_tiles, n_tiles, k_warps)
    if shared > MMA_SHARED_LIMIT:
        raise ValueError(f"w4a16_mma.cu with MT={m_tiles}, NT={n_tiles}, KW={k_warps} needs {shared} bytes of "
                         f"shared memory, over {MMA_SHARED_LIMIT}")
    variant = ("mma", m_tiles, n_tiles, k_warps, x_ahead, depth, r_row is not None)
    kernel = _CUDA_LAUNCHES.get(variant)
    if kernel is None:
        from kforge.runtime.cuda import CudaKernel

        kernel = _CUDA_LAUNCHES[variant] = CudaKernel.from_file(
            MMA_SOURCE, "w4a16_mma", defines={"MT": m_tiles, "NT": n_tiles, "KW": k_warps, "XPF": int(x_ahead),
                                              "DEPTH": depth, "RESIDUAL": int(r_row is not None)})
    index = x.device.index
    launch = kernel.lean(triton.cdiv(n, 16 * m_tiles), 32 * k_warps, index, kinds=MMA_KINDS)
    scalars = (n, batch, k // 128, (group // 128).bit_length() - 1, qweight.stride(0) // 16, scales.stride(0),
               x.stride(0) // 8, y.stride(0), r_row or 0)
    return launch, index, scalars


def launch_w4a16(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group: int,
                 config: dict | None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """y (M, N) bf16 for checked 2-D x; `config` None picks the path and tile (see _choose_config).
    With `residual` (M, N) bf16, contiguous: residual + y, in the store where a one-token call runs
    `w4a16_gemv.cu` or `w4a16_mma.cu`, after the others; the same bits either way."""
    batch, k = x.shape
    n = qweight.shape[0]
    one_token = None
    if config is None and n and k and cuda_kernel_fits(x, qweight, group):
        one_token = one_token_kernel(n, k)
        if one_token == "mma" and not cuda_mma_fits(x, qweight, group):
            one_token = "gemv"
        if one_token == "bulk" and not _bulk_operands_fit(x, qweight, scales, group):
            one_token = "gemv"
    if residual is not None and one_token not in ("gemv", "mma"):
        return residual + launch_w4a16(x, qweight, scales, group, config)
    y = torch.empty((batch, n), dtype=torch.bfloat16, device=x.device)
    if y.numel() == 0:
        return y
    if k == 0:
        return y.zero_()
    if one_token == "bulk":
        launch_bulk_gemv(x, qweight, scales, y)
        return y
    if one_token == "gemv":
        launch_cuda_gemv(x, qweight, scales, group, y, residual=None if residual is None else residual.contiguous())
        return y
    if one_token == "mma":
        launch_cuda_mma(x, qweight, scales, group, y, residual=None if residual is None else residual.contiguous())
        return y
    if config is None and cuda_mma_fits(x, qweight, group):
        launch_cuda_mma(x, qweight, scales, group, y)
        return y
    from kforge.runtime.interpreter import interpreter_active

    interpreted = interpreter_active()
    if config is None:
        config = _choose_config(batch, group, not interpreted)
    if (config is None or config["path"] == "gemv") and batch > GEMV_MAX_BATCH:
        # the CUDA-core kernel holds 32 x values a row per lane: two rows at a time (a group the
        # tensor cores cannot take, or a test asking for this path)
        for first in range(0, batch, GEMV_MAX_BATCH):
            y[first:first + GEMV_MAX_BATCH] = launch_w4a16(x[first:first + GEMV_MAX_BATCH], qweight, scales, group,
                                                           config)
        return y
    words = qweight.view(torch.int32)
    strides = (x.stride(0), words.stride(0), scales.stride(0))
    group_words = group // 8
    if config is None:
        def grid(meta):
            return (triton.cdiv(n, meta["BLOCK_N"]),)

        w4a16_gemv_autotuned[grid](x, words, scales, y, batch, n, k // 8, *strides, y.stride(0),
                                   GROUP_WORDS=group_words, BLOCK_B=triton.next_power_of_2(batch))
    elif config["path"] == "gemv":
        w4a16_gemv_kernel[(triton.cdiv(n, config["BLOCK_N"]),)](
            x, words, scales, y, batch, n, k // 8, *strides, y.stride(0), GROUP_WORDS=group_words,
            BLOCK_B=triton.next_power_of_2(batch), BLOCK_N=config["BLOCK_N"], BLOCK_KW=config["BLOCK_KW"],
            num_warps=config.get("num_warps", 4), num_stages=1)
    elif config["path"] == "mma":
        if group % MMA_GROUP_MULTIPLE:
            raise ValueError(f"the tensor-core path needs a group that is a multiple of {MMA_GROUP_MULTIPLE}, "
                             f"got {group}")
        block_n = config["BLOCK_N"]
        sms = sm_count(x.device) if x.is_cuda else H100_SMS
        splits = config.get("SPLIT_K") or split_k(n, k, block_n, sms)
        out = y if splits == 1 else torch.empty((splits, batch, n), dtype=torch.float32, device=x.device)
        w4a16_mma_kernel[(triton.cdiv(n, block_n), splits)](
            x, words, scales, out, batch, n, k // 8, *strides, out.stride(0) if splits > 1 else 0, out.stride(-2),
            GROUP_WORDS=group_words, BLOCK_B=max(8, triton.next_power_of_2(batch)), BLOCK_N=block_n,
            DOT_DTYPE=tl.float32 if interpreted else tl.bfloat16, PRECISION="ieee" if interpreted else "tf32",
            num_warps=config.get("num_warps", 4), num_stages=config.get("num_stages", 3))
        if splits > 1:
            split_sum_kernel[(triton.cdiv(y.numel(), 1024),)](out, y, splits, y.numel(), BLOCK=1024, num_warps=4)
    else:
        raise ValueError(f"config['path'] must be 'gemv' or 'mma', got {config['path']!r}")
    return y


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group: int = 128, *,
                 config: dict | None = None) -> torch.Tensor:
    """x @ dequantize_int4(qweight, scales, group).T for x (K,) or (M <= 32, K) bf16: y (N,) or (M, N) bf16.

    qweight (N, K // 2) uint8 and scales (N, K // group) bf16 as `formats.quantize_int4` makes
    them; group a multiple of 32 (the tensor-core path, M > 2, wants a multiple of 128, else
    the CUDA-core kernel runs two rows at a time). `config` skips the choice: {"path": "gemv",
    "BLOCK_N", "BLOCK_KW", "num_warps"} or {"path": "mma", "BLOCK_N", "num_warps",
    "num_stages", optional "SPLIT_K"}; the tests use it to run both paths anywhere.
    """
    check_w4a16_inputs(x, qweight, scales, group)
    y = launch_w4a16(x.view(1, -1) if x.dim() == 1 else x, qweight, scales, group, config)
    return y.view(-1) if x.dim() == 1 else y


def w4a16_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group: int = 128) -> torch.Tensor:
    """What a user writes eagerly: dequantize to bf16 with PyTorch, then a bf16 linear."""
    from kforge.kernels.quant.formats import dequantize_int4

    return torch.nn.functional.linear(x, dequantize_int4(qweight, scales, group))


def w4a16_min_bytes(m: int, n: int, k: int, group: int = 128) -> int:
    """HBM bytes any W4A16 matmul must move: packed weight and bf16 scales read once, x read, y written (bf16)."""
    return n * k // 2 + n * (k // group) * 2 + m * k * 2 + m * n * 2

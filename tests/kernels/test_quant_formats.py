"""Quantized formats (kforge.kernels.quant): the PyTorch references against hand-worked values,
the Triton kernels bit for bit against the references (interpreter here, CUDA in the gpu
tests, both rounding paths), the packed layouts, bad input, the accumulation trace and the
format error table."""

import json
import math
import subprocess
import sys
import textwrap

import pytest
import torch

from kforge.kernels.quant import formats as F
from kforge.kernels.quant import quantize as Q
from kforge.kernels.quant import trace
from kforge.ops import quant as ops

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.fixture
def poisoned(nan_outputs, monkeypatch):
    """nan_outputs, and integer tensors from torch.empty / empty_like filled with 0xA5 (uint8)
    or 0x5A5A (int16): an output byte a kernel forgets to write shows as a mismatch."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t):
        if t.dtype == torch.uint8:
            t.fill_(0xA5)
        elif t.dtype in (torch.int16, torch.int32):
            t.fill_(0x5A5A)
        return t

    monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: poison(empty(*args, **kwargs)))
    monkeypatch.setattr(torch, "empty_like", lambda *args, **kwargs: poison(empty_like(*args, **kwargs)))


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a tensor as an integer tensor, so comparisons are exact (-0.0 != 0.0)."""
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]
    return t.contiguous().view(view) if t.dtype != view else t


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal bit for bit, except that any NaN matches any NaN."""
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    got, want = got.cpu(), want.cpu()
    got_bits, want_bits = bits(got), bits(want)
    if got.is_floating_point():
        nan_got, nan_want = torch.isnan(got.float()), torch.isnan(want.float())
        assert torch.equal(nan_got, nan_want), f"NaN at different places: {nan_got.sum()} vs {nan_want.sum()}"
        got_bits, want_bits = got_bits.masked_fill(nan_got, 0), want_bits.masked_fill(nan_want, 0)
    diff = got_bits != want_bits
    assert not diff.any(), (f"{int(diff.sum())} of {diff.numel()} differ, first at {diff.nonzero()[0].tolist()}: "
                            f"{got[tuple(diff.nonzero()[0])]} vs {want[tuple(diff.nonzero()[0])]}")


def assert_same_outputs(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert_same_bits(g, w)


def nextafter(t: torch.Tensor, direction: float) -> torch.Tensor:
    return torch.nextafter(t, torch.full_like(t, direction))


# -- the references against hand-worked values -----------------------------------------------------

def test_e2m1_code_table_by_hand():
    codes = torch.arange(16, dtype=torch.uint8)
    values = F.e2m1_decode(codes)
    assert values.tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert torch.signbit(values[8]) and not torch.signbit(values[0])  # code 8 is -0.0
    assert torch.equal(F.e2m1_encode(values), codes)


def test_e2m1_rounding_ties_to_even_index_and_saturates():
    # midpoint: the even index wins (0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert F.e2m1_decode(F.e2m1_encode(ties)).tolist() == [0, 1, 1, 2, 2, 4, 4]
    assert F.e2m1_decode(F.e2m1_encode(nextafter(ties, 10))).tolist() == [0.5, 1, 1.5, 2, 3, 4, 6]
    assert F.e2m1_decode(F.e2m1_encode(nextafter(ties, -10))).tolist() == [0, 0.5, 1, 1.5, 2, 3, 4]
    assert F.e2m1_encode(torch.tensor([6.0, 7.0, 1e30, -8.0])).tolist() == [7, 7, 7, 15]
    assert F.e2m1_encode(torch.tensor([-0.0, -0.1, 0.0, 0.1])).tolist() == [8, 8, 0, 0]  # sign kept on zero


def test_nibble_layout_even_element_in_low_nibble():
    codes = torch.tensor([[1, 2, 3, 4, 15, 0]], dtype=torch.uint8)
    packed = F.pack_nibbles(codes)
    assert packed.tolist() == [[0x21, 0x43, 0x0F]]
    assert torch.equal(F.unpack_nibbles(packed), codes)


def test_int4_by_hand():
    # group 4, one row [7, -3.5, 0.5, -7]: amax 7, scale bf16(7 / 7) = 1.0, q = rne(w) = [7, -4, 0, -7]
    # (-3.5 and 0.5 are ties: to the even -4 and 0); 4-bit two's complement 7 = 0x7, -4 = 0xC, 0 = 0x0,
    # -7 = 0x9; byte j = q[2j] | q[2j+1] << 4: [0xC7, 0x90].
    qweight, scales = F.quantize_int4(torch.tensor([[7.0, -3.5, 0.5, -7.0]]), group=4)
    assert qweight.tolist() == [[0xC7, 0x90]] and scales.dtype == torch.bfloat16 and scales.tolist() == [[1.0]]
    assert F.dequantize_int4(qweight, scales, group=4).tolist() == [[7, -4, 0, -7]]
    # amax 1: scale bf16(1/7) = 146 / 128 * 2^-3 = 0.142578125 (fp32 1/7 rounded to 8 significant bits);
    # 1 / 0.142578125 = 7.01 -> 7; an all-zero group gets scale 1.0
    qweight, scales = F.quantize_int4(torch.tensor([[1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]]), group=4)
    assert scales.tolist() == [[0.142578125, 1.0]] and qweight.tolist() == [[0x07, 0, 0, 0]]


def test_fp8_by_hand():
    # scale = 448 / 448 = 1, so x / scale = x: e4m3 bits 448 = 0x7E, 1 = 0x38, -1 = 0xB8; 17 lies halfway
    # between 16 (0x58) and 18 (0x59): the even code, 16; 19 between 18 and 20 (0x5A): 20. Subnormals step
    # 2^-9: 2^-9 = 0x01, 1.5 * 2^-9 is a tie -> 0x02, 2^-10 a tie -> 0x00; -0.0 keeps its sign (0x80).
    x = torch.tensor([[448.0, 1.0, -1.0, 17.0, 19.0, 2.0 ** -9, 1.5 * 2.0 ** -9, 2.0 ** -10, -0.0]])
    q, scale = F.quantize_fp8_rowwise(x)
    assert scale.tolist() == [[1.0]]
    assert q.view(torch.uint8).tolist() == [[0x7E, 0x38, 0xB8, 0x58, 0x5A, 0x01, 0x02, 0x00, 0x80]]
    # a zero row gets scale 1.0; tensorwise: 0-d amax / 448; e5m2 max 57344
    q, scale = F.quantize_fp8_rowwise(torch.zeros(2, 3))
    assert scale.tolist() == [[1.0], [1.0]] and not q.float().any()
    q, scale = F.quantize_fp8_tensorwise(torch.tensor([896.0, -2.0]))
    assert scale.dim() == 0 and scale.item() == 2.0 and q.float().tolist() == [448.0, -1.0]
    assert F.fp8_max(E5M2) == 57344.0 and F.fp8_max(E4M3) == 448.0


def test_fp8_blockwise_scale_shape_and_partial_blocks():
    x = torch.zeros(130, 260)
    x[0, 0], x[129, 259] = 896.0, -112.0
    q, scale = F.quantize_fp8_blockwise(x, block=(128, 128))
    assert scale.shape == (2, 3) and scale.dtype == torch.float32
    assert scale.tolist() == [[2.0, 1.0, 1.0], [1.0, 1.0, 0.25]]  # 896 / 448; zero blocks 1.0; 112 / 448
    assert F.dequantize_fp8(q, scale, block=(128, 128))[[0, 129], [0, 259]].tolist() == [896.0, -112.0]


def test_mxfp4_by_hand():
    # block 0: amax 5, floor(log2 5) = 2, e = 0, scale byte 127, values as they are: 5 -> tie -> 4 (code 6),
    # -1.25 -> tie -> -1 (code 8 | 2 = 10); block 1: amax 0.3, floor(log2 0.3) = -2, e = -4, byte 123,
    # x * 16: 0.3 -> 4.8 -> 4 (6), 0.1 -> 1.6 -> 1.5 (3); block 2 all zero: e = -127, byte 0, codes 0.
    x = torch.zeros(96)
    x[0], x[1], x[32], x[33] = 5.0, -1.25, 0.3, 0.1
    packed, scales = F.quantize_mxfp4(x)
    assert scales.tolist() == [127, 123, 0]
    codes = F.unpack_nibbles(packed)
    assert codes[[0, 1, 32, 33]].tolist() == [6, 10, 6, 3] and not codes[2:32].any() and not codes[34:].any()
    assert F.dequantize_mxfp4(packed, scales)[[0, 1, 32, 33]].tolist() == [4.0, -1.0, 0.25, 0.09375]


def test_nvfp4_block_worked_by_hand():
    # global scale given: 0.5. Block 0 (16 values), amax 12: block scale e4m3(12 / 6 / 0.5) = 4 (exact),
    # denominator 4 * 0.5 = 2, elements x / 2 rounded to E2M1:
    #   12 -> 6 (7)   -3 -> -1.5 (11)   1.5 -> .75 tie -> 1 (2)   0.7 -> .35 -> .5 (1)
    #   5 -> 2.5 tie -> 2 (4)   7 -> 3.5 tie -> 4 (6)   0.5 -> .25 tie -> 0 (0)   -0.0 -> -0 (8)
    #   10 -> 5 tie -> 4 (6)   11 -> 5.5 -> 6 (7)   2.4 -> 1.2 -> 1 (2)   2.6 -> 1.3 -> 1.5 (3)
    #   -9 -> -4.5 -> -4 (14)   0.1 -> .05 -> 0 (0)   3.6 -> 1.8 -> 2 (4)   -7 -> -3.5 tie -> -4 (14)
    # Block 1, amax 7: 7 / 6 / 0.5 = 2.333 -> e4m3 (step 0.25 in [2, 4)) 2.25; denominator 1.125:
    #   7 -> 6.22 -> 6 (7)   1.125 -> 1 (2)   -0.5625 -> -0.5 (9), the rest 0.
    block0 = [12, -3, 1.5, 0.7, 5, 7, 0.5, -0.0, 10, 11, 2.4, 2.6, -9, 0.1, 3.6, -7]
    block1 = [7, 1.125, -0.5625] + [0.0] * 13
    packed, block_scales, global_scale = F.quantize_nvfp4(torch.tensor([block0 + block1]), global_scale=0.5)
    assert global_scale.item() == 0.5 and block_scales.float().tolist() == [[4.0, 2.25]]
    codes = F.unpack_nibbles(packed)[0].tolist()
    assert codes[:16] == [7, 11, 2, 1, 4, 6, 0, 8, 6, 7, 2, 3, 14, 0, 4, 14]
    assert codes[16:19] == [7, 2, 9] and codes[19:] == [0] * 13
    assert packed[0, 0].item() == 0xB7  # codes 7 (low) and 11 (high)
    restored = F.dequantize_nvfp4(packed, block_scales, global_scale)[0]
    assert restored[:4].tolist() == [12, -3, 2, 1] and restored[16:19].tolist() == [6.75, 1.125, -0.5625]
    # global scale by default: amax / (6 * 448); here 12 / 2688
    assert F.quantize_nvfp4(torch.tensor([block0]))[2].item() == pytest.approx(12 / 2688, rel=1e-7)


def test_round_trips_are_exact_on_representable_values():
    generator = torch.Generator().manual_seed(1)
    e2m1 = F.e2m1_decode(torch.randint(0, 16, (4, 64), generator=generator, dtype=torch.uint8))
    e2m1[:, ::32] = 6.0  # each MXFP4 block's amax 6: e = 0, so the values are the codes' own
    assert torch.equal(F.dequantize_mxfp4(*F.quantize_mxfp4(e2m1)), e2m1)
    ints = torch.randint(-7, 8, (3, 256), generator=generator).float() * 0.25
    ints[:, ::128] = 7 * 0.25  # amax 1.75 per group: scale 0.25, exact in bf16
    assert torch.equal(F.dequantize_int4(*F.quantize_int4(ints.bfloat16(), 128), 128).float(), ints)
    fp8_values = torch.randn(5, 40, generator=generator).to(E4M3).float()
    fp8_values[:, 0] = 448.0
    assert torch.equal(F.dequantize_fp8(*F.quantize_fp8_rowwise(fp8_values)), fp8_values)


# -- the kernels, bit for bit (interpreter) -------------------------------------------------------

def fp8_tie_row(dtype: torch.dtype) -> torch.Tensor:
    """One row holding fp8_max (so the scale is exactly 1) and, for every pair of neighbouring
    positive fp8 values, their midpoint and the fp32 values just either side of it, both signs."""
    values = torch.arange(0, 0x7F if dtype == E4M3 else 0x7C, dtype=torch.uint8).view(dtype).float()
    mid = (values[:-1] + values[1:]) / 2
    row = torch.cat([mid, nextafter(mid, math.inf), nextafter(mid, -math.inf), torch.tensor([F.fp8_max(dtype)])])
    return torch.cat([row, -row, torch.tensor([-0.0, 0.0])])[None, :]


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_fp8_ties_halfway_between_every_pair_round_to_even(dtype, poisoned):
    x = fp8_tie_row(dtype)
    q, scale = F.quantize_fp8_rowwise(x, dtype)
    assert scale.item() == 1.0
    codes = q.view(torch.uint8)[0, : (x.shape[1] - 2) // 6].int()  # the positive midpoints: k + 1/2 ulp
    assert torch.equal(codes, torch.arange(len(codes)) + torch.arange(len(codes)) % 2)  # the even of k, k + 1
    assert_same_outputs(Q.quantize_fp8_rowwise_triton(x, dtype), (q, scale))
    assert_same_outputs(Q.quantize_fp8_tensorwise_triton(x, dtype), F.quantize_fp8_tensorwise(x, dtype))


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("shape,in_dtype", [((7, 200), torch.bfloat16), ((2, 1100), torch.float32),
                                            ((1, 1), torch.float16), ((2, 3, 48), torch.float32)])
def test_fp8_rowwise_and_tensorwise_kernels_match_reference(shape, in_dtype, dtype, poisoned):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    rows = x.view(-1, shape[-1])
    rows *= torch.logspace(-3, 3, rows.shape[0]).reshape(-1, 1)  # rows of very different sizes
    if rows.shape[0] > 1:
        rows[-1] = 0  # a zero row: scale 1.0
    x = x.to(in_dtype)
    assert_same_outputs(Q.quantize_fp8_rowwise_triton(x, dtype), F.quantize_fp8_rowwise(x, dtype))
    assert_same_outputs(Q.quantize_fp8_tensorwise_triton(x, dtype), F.quantize_fp8_tensorwise(x, dtype))


def test_kernels_read_strided_rows(poisoned):
    wide = torch.randn(5, 300, generator=torch.Generator().manual_seed(3))
    x = wide[:, :256]  # row stride 300
    assert_same_outputs(Q.quantize_fp8_rowwise_triton(x), F.quantize_fp8_rowwise(x))
    assert_same_outputs(Q.quantize_fp8_blockwise_triton(x), F.quantize_fp8_blockwise(x))
    assert_same_outputs(Q.quantize_int4_triton(x, 64), F.quantize_int4(x, 64))
    assert_same_outputs(Q.quantize_nvfp4_triton(x), F.quantize_nvfp4(x))


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("shape,block", [((9, 300), (1, 128)), ((70, 40), (64, 32)), ((5, 9), (2, 4)),
                                         ((33, 130), (8, 128)), ((3, 2100), (1, 1024))])
def test_fp8_blockwise_kernel_matches_reference(shape, block, dtype, poisoned):
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(shape, generator=generator) * torch.logspace(-2, 2, shape[1])
    x[: block[0], : block[1]] = 0  # a zero block
    x = x.bfloat16()
    want = F.quantize_fp8_blockwise(x, block, dtype)
    assert_same_outputs(Q.quantize_fp8_blockwise_triton(x, block, dtype), want)
    assert_same_bits(Q.dequantize_fp8_triton(*want, block=block), F.dequantize_fp8(*want, block=block))


def test_fp8_blockwise_tall_blocks_walk_rows_in_steps():
    """(64, 32) on 40 columns is the two-pass path (BLOCK_R < BR): the test above must cover it."""
    block_r, _ = Q.blockwise_tile((64, 32), 40)
    assert block_r < 64
    assert Q.blockwise_tile((1, 128), 7168) == (1, 1024) and Q.blockwise_tile((128, 128), 7168) == (8, 128)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_fp8_dequantize_decodes_all_256_codes(dtype, poisoned):
    q = torch.arange(256, dtype=torch.uint8).view(dtype).reshape(4, 64)
    for scale, block in ((torch.tensor(0.375), None), (torch.tensor([[1.0], [2.0], [0.5], [3.0]]), None),
                         (torch.tensor([[1.0, 0.25], [4.0, 1.5]]), (2, 32))):
        assert_same_bits(Q.dequantize_fp8_triton(q, scale, block), F.dequantize_fp8(q, scale, block))


@pytest.mark.parametrize("shape,group,in_dtype", [((3, 256), 128, torch.bfloat16), ((5, 96), 32, torch.float32),
                                                  ((1, 2048), 128, torch.float16), ((4, 8), 2, torch.bfloat16)])
def test_int4_kernels_match_reference(shape, group, in_dtype, poisoned):
    generator = torch.Generator().manual_seed(5)
    w = (torch.randn(shape, generator=generator) * 0.02).to(in_dtype)
    w[0, :group] = 0  # a zero group
    want = F.quantize_int4(w, group)
    assert_same_outputs(Q.quantize_int4_triton(w, group), want)
    assert_same_bits(Q.dequantize_int4_triton(*want, group), F.dequantize_int4(*want, group))


def test_int4_ties_and_every_nibble(poisoned):
    # amax 7 per group: scale exactly 1, so w / scale hits the half-way points k + 0.5 exactly
    halves = torch.arange(-7, 7).float() + 0.5
    row = torch.cat([halves, nextafter(halves, 9), nextafter(halves, -9), torch.tensor([7.0, -0.0])])
    w = torch.cat([row, torch.zeros(64 - row.numel())])[None, :].repeat(3, 1)
    want = F.quantize_int4(w, 64)
    assert F.unpack_int4(want[0])[0, :14].tolist() == [-6, -6, -4, -4, -2, -2, 0, 0, 2, 2, 4, 4, 6, 6]  # to even
    assert_same_outputs(Q.quantize_int4_triton(w, 64), want)
    qweight = torch.randint(0, 256, (6, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(6))
    scales = (torch.rand(6, 4, generator=torch.Generator().manual_seed(7)) * 0.1).bfloat16()
    assert_same_bits(Q.dequantize_int4_triton(qweight, scales, 32), F.dequantize_int4(qweight, scales, 32))


def e2m1_tie_blocks() -> torch.Tensor:
    """Two blocks of 16, each with amax exactly 6 (an MXFP4 e of 0, an NVFP4 block scale of 1 at
    global scale 1, so x is divided by 1): the seven E2M1 midpoints with both signs, their fp32
    neighbours either side, and both zeros."""
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    first = torch.cat([torch.tensor([6.0]), ties, -ties, torch.tensor([-0.0])])
    second = torch.cat([torch.tensor([-6.0]), nextafter(ties, 9), -nextafter(ties, -9), torch.tensor([0.0])])
    return torch.cat([first, second])


def mxfp4_cases() -> torch.Tensor:
    """Blocks of 32: ties at e = 0, saturation (amax 7.9: e = 0 and 7.9 -> 6), zero, a subnormal amax
    (e = -127, and x * 2^127 still lands on nonzero codes), near fp32's max (e = 125), random."""
    generator = torch.Generator().manual_seed(8)
    saturating = e2m1_tie_blocks()
    saturating[0], saturating[16] = 7.9, -7.0
    ties, zeros = e2m1_tie_blocks(), torch.zeros(32)
    subnormal, huge = torch.linspace(-1, 1, 32) * 5e-39, torch.linspace(-1, 1, 32) * 3e38
    small, large = torch.randn(32, generator=generator) * 1e-3, torch.randn(32, generator=generator) * 40
    return torch.stack([torch.cat([ties, saturating, zeros, subnormal, small]),
                        torch.cat([huge, small, large, ties, zeros])])


def test_mxfp4_kernels_match_reference_on_edge_blocks(poisoned):
    x = mxfp4_cases()
    want = F.quantize_mxfp4(x)
    assert want[1][0, :4].tolist() == [127, 127, 0, 0] and want[1][1, 0].item() == 125 + 127
    assert F.unpack_nibbles(want[0])[0, 96:128].any()  # the subnormal block keeps nonzero codes
    assert_same_outputs(Q.quantize_mxfp4_triton(x), want)
    assert_same_bits(Q.dequantize_mxfp4_triton(*want), F.dequantize_mxfp4(*want))


@pytest.mark.parametrize("shape,in_dtype", [((5, 96), torch.bfloat16), ((2, 3, 64), torch.float32),
                                            ((1, 2048), torch.float16)])
def test_fp4_kernels_match_reference_on_random_input(shape, in_dtype, poisoned):
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(9)) * 3).to(in_dtype)
    assert_same_outputs(Q.quantize_mxfp4_triton(x), F.quantize_mxfp4(x))
    assert_same_outputs(Q.quantize_nvfp4_triton(x), F.quantize_nvfp4(x))
    assert_same_outputs(Q.quantize_nvfp4_triton(x, 0.01), F.quantize_nvfp4(x, 0.01))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # 6 * 2^127 is inf, as it should be
def test_fp4_dequantize_every_code_and_scale(poisoned):
    generator = torch.Generator().manual_seed(10)
    packed = torch.randint(0, 256, (5, 128), dtype=torch.uint8, generator=generator)
    scales = torch.randint(0, 256, (5, 8), dtype=torch.uint8, generator=generator)
    scales[0, :] = torch.tensor([0, 1, 127, 254, 255, 126, 128, 2], dtype=torch.uint8)
    assert_same_bits(Q.dequantize_mxfp4_triton(packed, scales), F.dequantize_mxfp4(packed, scales))
    block_scales = torch.randint(0, 256, (5, 16), dtype=torch.uint8, generator=generator).view(E4M3)
    assert_same_bits(Q.dequantize_nvfp4_triton(packed, block_scales, 0.003),
                     F.dequantize_nvfp4(packed, block_scales, 0.003))


def test_nvfp4_kernels_match_reference_on_edge_blocks(poisoned):
    # global scale 1: a block with amax 6 has block scale 1, so the E2M1 midpoints stay exact ties;
    # amax 6 * 1.0625: block scale is an e4m3 tie, rounds to 1.0 (even); amax 6 * 2^-8: an e4m3
    # subnormal block scale; 6000: block scale saturates at 448; zeros: block scale 0, codes 0.
    ties = e2m1_tie_blocks()
    blocks = [ties[:16], ties[16:], ties[:16] * 1.0625, ties[16:] * 2.0 ** -8, ties[:16] * 1000, torch.zeros(16)]
    x = torch.stack([torch.cat(blocks), torch.cat(blocks[::-1])])
    want = F.quantize_nvfp4(x, global_scale=1.0)
    assert want[1][0].float().tolist() == [1.0, 1.0, 1.0, 2.0 ** -8, 448.0, 0.0]
    assert_same_outputs(Q.quantize_nvfp4_triton(x, 1.0), want)
    assert_same_bits(Q.dequantize_nvfp4_triton(*want), F.dequantize_nvfp4(*want))


# -- bad input ------------------------------------------------------------------------------------

@pytest.mark.parametrize("call,message", [
    (lambda: F.quantize_mxfp4(torch.randn(2, 30)), "multiple of 32"),
    (lambda: Q.quantize_mxfp4_triton(torch.randn(2, 30)), "multiple of 32"),
    (lambda: F.quantize_nvfp4(torch.randn(2, 24)), "multiple of 16"),
    (lambda: Q.quantize_nvfp4_triton(torch.randn(2, 24)), "multiple of 16"),
    (lambda: F.quantize_int4(torch.randn(4, 100), 128), "multiple of the group"),
    (lambda: Q.quantize_int4_triton(torch.randn(4, 96), 96), "power-of-two group"),
    (lambda: F.quantize_int4(torch.randn(4, 7), 7), "even"),
    (lambda: F.quantize_fp8_rowwise(torch.randint(0, 5, (2, 4))), "floating-point"),
    (lambda: F.quantize_fp8_rowwise(torch.randn(2, 4), torch.float16), "fp8 dtype"),
    (lambda: Q.quantize_fp8_rowwise_triton(torch.randn(2, 4, dtype=torch.float64)), "float16, bfloat16 or float32"),
    (lambda: F.quantize_fp8_blockwise(torch.randn(2, 3, 4)), "2-D"),
    (lambda: Q.quantize_fp8_blockwise_triton(torch.randn(4, 8), (3, 4)), "power-of-two"),
    (lambda: F.quantize_fp8_blockwise(torch.randn(4, 8), (0, 4)), "positive"),
    (lambda: F.quantize_fp8_tensorwise(torch.randn(0, 4)), "elements"),
    (lambda: F.dequantize_fp8(torch.zeros(4, 8).to(E4M3), torch.ones(1, 1), block=(2, 4)), r"ceil\(R/br\)"),
    (lambda: Q.dequantize_fp8_triton(torch.zeros(4, 8).to(E4M3), torch.ones(3)), "one per row"),
    (lambda: F.dequantize_int4(torch.zeros(4, 64, dtype=torch.uint8), torch.ones(4, 2)), "bfloat16"),
    (lambda: Q.dequantize_int4_triton(torch.zeros(4, 64, dtype=torch.uint8),
                                      torch.ones(4, 3, dtype=torch.bfloat16)), r"\[N, K // group\]"),
    (lambda: F.dequantize_mxfp4(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8)),
     r"\[\.\.\., C // 32\]"),
    (lambda: Q.dequantize_nvfp4_triton(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 3).to(E4M3), 1.0),
     r"\[\.\.\., C // 16\]"),
    (lambda: F.quantize_nvfp4(torch.randn(2, 16), torch.ones(2)), "one value"),
    (lambda: F.unpack_nibbles(torch.zeros(3, dtype=torch.int32)), "uint8"),
    (lambda: F.pack_nibbles(torch.zeros(3, dtype=torch.uint8)), "multiple of 2"),
    (lambda: ops.quantize_fp8(torch.randn(2, 4), "column"), "granularity"),
])
def test_bad_input_gets_a_one_line_value_error(call, message):
    with pytest.raises(ValueError, match=message) as raised:
        call()
    assert "\n" not in str(raised.value)


# -- the ops on CPU (the reference path) ----------------------------------------------------------

def test_ops_run_the_reference_on_cpu_and_have_fake_shapes():
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(11))
    for granularity, reference in (("row", F.quantize_fp8_rowwise), ("tensor", F.quantize_fp8_tensorwise)):
        assert_same_outputs(ops.quantize_fp8(x, granularity), reference(x))
    q, scale = ops.quantize_fp8(x, "block", block=(4, 128))
    assert_same_outputs((q, scale), F.quantize_fp8_blockwise(x, (4, 128)))
    assert_same_bits(ops.dequantize_fp8(q, scale, block=(4, 128)), F.dequantize_fp8(q, scale, (4, 128)))
    assert_same_outputs(ops.quantize_int4(x, 64), F.quantize_int4(x, 64))
    assert_same_outputs(ops.quantize_mxfp4(x), F.quantize_mxfp4(x))
    assert_same_outputs(ops.quantize_nvfp4(x), F.quantize_nvfp4(x))
    gs = torch.tensor(0.02)
    assert ops.quantize_nvfp4(x, gs)[2] is not gs
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.empty(5, 256)
        shapes = [tuple(t.shape) for t in (*ops.quantize_fp8(fake, "block", block=(2, 128)),
                                           *ops.quantize_int4(fake, 128), *ops.quantize_mxfp4(fake),
                                           *ops.quantize_nvfp4(fake))]
    assert shapes == [(5, 256), (3, 2), (5, 128), (5, 2), (5, 128), (5, 8), (5, 128), (5, 16), ()]
    torch.library.opcheck(ops._quantize_nvfp4, (x, gs))
    torch.library.opcheck(ops._dequantize_int4, (*F.quantize_int4(x, 64), 64))


# -- the accumulation trace and the error table ---------------------------------------------------

def test_fp8_accumulator_freezes_near_32_while_wide_ones_track_the_sum():
    rows = trace.accumulate_trace()
    assert len(rows) == 64 and [r.step for r in rows] == list(range(1, 65))
    last = rows[-1]
    assert 60 < last.exact < 68
    assert last.fp8 == 32.0 and all(r.fp8 == 32.0 for r in rows[40:])  # frozen: 32 + ~1 rounds back to 32
    assert abs(last.fp16 - last.exact) / last.exact < 0.005 and last.fp32 == last.exact
    summary = trace.accumulate_summary(rows)
    assert [(label, bits) for label, bits, _, _ in summary] == [("FP8 E4M3", 3), ("FP16", 10), ("FP32", 23)]
    assert f"{summary[0][2]:.1f} {summary[0][3]:.1%} {last.exact:.1f}" == "32.0 49.9% 63.9"  # the course's table
    assert trace.accumulate_trace(seed=3) == trace.accumulate_trace(seed=3) != rows
    for seed in range(5):  # not one lucky seed
        assert trace.accumulate_trace(seed=seed)[-1].fp8 == 32.0
    assert type(trace.render_accumulate_trace(rows)).__name__ == "Table"
    with pytest.raises(ValueError):
        trace.accumulate_trace(n_terms=0)


def test_format_error_table_orders_formats_and_counts_bits():
    rows = {row.format: row for row in trace.format_error_table()}
    assert list(rows) == list(trace.FORMATS)
    bits = {name: round(row.bits_per_value, 3) for name, row in rows.items()}
    assert bits == {"FP8 E4M3 per tensor": 8.0, "FP8 E4M3 per row": 8.031, "FP8 E4M3 1x128": 8.25,
                    "FP8 E5M2 per row": 8.031, "INT4 g128": 4.125, "MXFP4": 4.25, "NVFP4": 4.5}
    for column in ("gaussian", "laplace", "outlier_activations"):
        errors = {name: getattr(row, column) for name, row in rows.items()}
        assert max(errors[n] for n in trace.FORMATS if n.startswith("FP8 E4M3")) < errors["FP8 E5M2 per row"]
        assert errors["FP8 E5M2 per row"] < min(errors["INT4 g128"], errors["MXFP4"], errors["NVFP4"])
        assert errors["NVFP4"] < errors["MXFP4"]  # 16-value blocks, fp8 scales: finer than 32 and powers of two
        assert all(0 < e < 0.3 for e in errors.values())
    # outliers: the 1x128 blocks isolate them better than one scale per tensor
    assert rows["FP8 E4M3 1x128"].outlier_activations < rows["FP8 E4M3 per tensor"].outlier_activations
    assert trace.format_error_table() == trace.format_error_table()
    assert type(trace.render_format_error_table(list(rows.values()))).__name__ == "Table"


# -- compiled for the H100 (sm_90) ---------------------------------------------------------------

_COMPILE_SM90 = textwrap.dedent(r"""
    import json, os, re
    os.environ["TRITON_INTERPRET"] = "0"
    from pathlib import Path
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from kforge.kernels.quant import quantize as Q
    from kforge.runtime.cuda import Cubin, resources, sass

    def build(fn, types, constants):
        signature = {name: types.get(name, "constexpr") for name in fn.arg_names}
        kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants),
                                target=GPUTarget("cuda", 90, 32), options={"num_warps": Q.NUM_WARPS})
        cubin = Cubin(Path(fn.__name__), "sm_90", (), "", kernel.asm["cubin"], "")
        (used,) = resources(cubin).values()
        ptx = kernel.asm["ptx"]
        count = lambda pattern: len(re.findall(pattern, ptx))
        return dict(registers=used.registers, local=used.local_bytes + used.stack_bytes, shared=kernel.metadata.shared,
                    spills=len(re.findall(r"\b(STL|LDL)\b", sass(cubin))),
                    e4m3=count(r"cvt\.rn\.satfinite\.e4m3x2\.f32"), e5m2=count(r"cvt\.rn\.satfinite\.e5m2x2\.f32"),
                    bf16=count(r"cvt\.rn\.bf16(x2)?\.f32"), div_full=count(r"div\.full"))

    i32 = lambda *names: {name: "i32" for name in names}
    E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
    found = {}
    row = {"x_ptr": "*bf16", "q_ptr": "*u8", "scale_ptr": "*fp32",
           **i32("n_rows", "n_cols", "stride_x", "stride_q", "stride_s")}
    for dtype in (E4, E5):
        block_r, block_c = Q.rowwise_tile(7168)
        found[f"fp8 rowwise {dtype}"] = build(Q.fp8_rowwise_kernel, row, dict(
            Q.fp8_constants(dtype), HARDWARE_CVT=True, BLOCK_R=block_r, BLOCK_C=block_c))
    for block, dtype in (((1, 128), E4), ((128, 128), E5)):
        block_r, block_c = Q.blockwise_tile(block, 7168)
        found[f"fp8 blockwise {block} {dtype}"] = build(Q.fp8_blockwise_kernel, row, dict(
            Q.fp8_constants(dtype), HARDWARE_CVT=True, BR=block[0], BC=block[1], BLOCK_R=block_r, BLOCK_C=block_c))
    block_r, block_c = Q.tile_for(7168, 16)
    for quantize, dtype in ((True, E4), (False, E5)):
        types = {"src_ptr": "*bf16" if quantize else "*u8", "dst_ptr": "*u8" if quantize else "*fp32",
                 "scale_ptr": "*fp32", **i32("n_rows", "n_cols", "stride_src", "stride_dst", "stride_sr", "stride_sc",
                                            "rows_per_scale", "cols_per_scale")}
        mant, bias, max_mag, exp_bits = Q.FP8_LAYOUT[dtype]
        found[f"fp8 {'quantize' if quantize else 'dequantize'} given scale {dtype}"] = build(
            Q.fp8_scaled_kernel, types, dict(QUANTIZE=quantize, FP8_MAX=float(torch.finfo(dtype).max), MANT=mant,
                                             BIAS=bias, MAX_MAG=max_mag, EXP_BITS=exp_bits,
                                             SPECIALS="nan" if dtype == E4 else "ieee", HARDWARE_CVT=True,
                                             BLOCK_R=block_r, BLOCK_C=block_c))
    block_r, block_c = Q.tile_for(4096, 128)
    found["int4 quantize"] = build(Q.int4_quantize_kernel, {"w_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*i16",
                                   **i32("n_rows", "n_cols", "stride_w", "stride_q", "stride_s")},
                                   dict(GROUP=128, BLOCK_R=block_r, BLOCK_C=block_c))
    found["int4 dequantize"] = build(Q.int4_dequantize_kernel, {"q_ptr": "*u8", "s_ptr": "*i16", "out_ptr": "*i16",
                                     **i32("n_rows", "n_cols", "stride_q", "stride_s", "stride_out")},
                                     dict(HARDWARE_CVT=True, GROUP=128, BLOCK_R=block_r, BLOCK_C=block_c))
    for nvfp4, block in ((True, 16), (False, 32)):
        block_r, block_c = Q.tile_for(7168, block)
        scale = {"global_scale_ptr": "*fp32"} if nvfp4 else {}
        no_scale = {} if nvfp4 else {"global_scale_ptr": None}
        found[f"fp4 quantize nvfp4={nvfp4}"] = build(Q.fp4_quantize_kernel, {
            "x_ptr": "*bf16", "packed_ptr": "*u8", "scale_ptr": "*u8", **scale,
            **i32("n_rows", "n_cols", "stride_x", "stride_p", "stride_s")},
            dict(NVFP4=nvfp4, HARDWARE_CVT=True, BLOCK=block, BLOCK_R=block_r, BLOCK_C=block_c, **no_scale))
        found[f"fp4 dequantize nvfp4={nvfp4}"] = build(Q.fp4_dequantize_kernel, {
            "packed_ptr": "*u8", "scale_ptr": "*u8", **scale, "out_ptr": "*fp32",
            **i32("n_rows", "n_cols", "stride_p", "stride_s", "stride_out")},
            dict(NVFP4=nvfp4, BLOCK=block, BLOCK_R=block_r, BLOCK_C=block_c, **no_scale))
    print(json.dumps(found))
""")


@pytest.mark.slow
def test_kernels_compile_for_sm90_with_hardware_rounding_and_no_spills():
    done = subprocess.run([sys.executable, "-c", _COMPILE_SM90], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(found) == 12
    for label, kernel in found.items():
        assert kernel["spills"] == 0 and kernel["local"] == 0, (label, kernel)
        assert kernel["shared"] <= 227 * 1024, (label, kernel)
        # 8 values a thread: few registers, so 16 programs (64 warps) fit an SM and keep loads in flight
        assert kernel["registers"] <= 64, (label, kernel)
        assert kernel["div_full"] == 0, (label, kernel)  # only IEEE div.rn
    # the GPU path rounds to fp8 and bf16 with the hardware's RNE conversions (NVFP4's block scales
    # excepted: quantize.py, fp4_quantize_kernel)
    for label in ("fp8 rowwise torch.float8_e4m3fn", "fp8 blockwise (1, 128) torch.float8_e4m3fn",
                  "fp8 quantize given scale torch.float8_e4m3fn"):
        assert found[label]["e4m3"] > 0, (label, found[label])
    assert found["fp4 quantize nvfp4=True"]["e4m3"] == 0
    assert found["fp8 rowwise torch.float8_e5m2"]["e5m2"] > 0 and found["int4 dequantize"]["bf16"] > 0


# -- GPU: realistic sizes, both rounding paths ----------------------------------------------------

@pytest.fixture(params=[True, False], ids=["hardware_cvt", "integer_rounding"])
def rounding_path(request, monkeypatch):
    """Run the GPU tests once with the hardware conversions, once with the integer path the interpreter uses."""
    monkeypatch.setattr(Q, "hardware_cvt", lambda t: request.param and t.is_cuda)
    return request.param


def gpu_input(shape, dtype=torch.bfloat16, seed=0, outliers=True):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator)
    if outliers:
        x[..., torch.randperm(shape[-1], generator=generator)[: shape[-1] // 100]] *= 50
        x[: shape[0] // 7] *= 1e-3
    return x.to(dtype).cuda()


def on_cpu(outputs):
    return [t.cpu() for t in outputs]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_gpu_fp8_kernels_match_reference(dtype, rounding_path, poisoned):
    x = gpu_input((4096 + 3, 7168))
    reference_input = x.cpu()
    assert_same_outputs(on_cpu(Q.quantize_fp8_rowwise_triton(x, dtype)), F.quantize_fp8_rowwise(reference_input, dtype))
    assert_same_outputs(on_cpu(Q.quantize_fp8_tensorwise_triton(x, dtype)),
                        F.quantize_fp8_tensorwise(reference_input, dtype))
    for block in ((1, 128), (128, 128)):
        want = F.quantize_fp8_blockwise(reference_input[:, :7100], block, dtype)
        assert_same_outputs(on_cpu(Q.quantize_fp8_blockwise_triton(x[:, :7100], block, dtype)), want)
        assert_same_bits(Q.dequantize_fp8_triton(want[0].cuda(), want[1].cuda(), block).cpu(),
                         F.dequantize_fp8(*want, block=block))
    ties = fp8_tie_row(dtype).repeat(3, 1)
    assert_same_outputs(on_cpu(Q.quantize_fp8_rowwise_triton(ties.cuda(), dtype)), F.quantize_fp8_rowwise(ties, dtype))
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).reshape(16, 16)
    scale = torch.rand(16, 1) + 0.5
    assert_same_bits(Q.dequantize_fp8_triton(codes.cuda(), scale.cuda()).cpu(), F.dequantize_fp8(codes, scale))


@pytest.mark.gpu
def test_gpu_int4_kernels_match_reference(rounding_path, poisoned):
    for shape in ((4096, 4096), (14336 + 1, 4096)):
        w = (gpu_input(shape, seed=1, outliers=False) * 0.02).bfloat16()
        want = F.quantize_int4(w.cpu(), 128)
        assert_same_outputs(on_cpu(Q.quantize_int4_triton(w, 128)), want)
        assert_same_bits(Q.dequantize_int4_triton(want[0].cuda(), want[1].cuda(), 128).cpu(), F.dequantize_int4(*want))


@pytest.mark.gpu
def test_gpu_fp4_kernels_match_reference(rounding_path, poisoned):
    for shape in ((4096, 7168), (8, 1, 16384), (4 * 7168 + 5, 2048)):
        x = gpu_input(shape, seed=2)
        reference_input = x.cpu()
        want = F.quantize_mxfp4(reference_input)
        assert_same_outputs(on_cpu(Q.quantize_mxfp4_triton(x)), want)
        assert_same_bits(Q.dequantize_mxfp4_triton(*(t.cuda() for t in want)).cpu(), F.dequantize_mxfp4(*want))
        want = F.quantize_nvfp4(reference_input)
        assert_same_outputs(on_cpu(Q.quantize_nvfp4_triton(x)), want)
        assert_same_bits(Q.dequantize_nvfp4_triton(*(t.cuda() for t in want)).cpu(), F.dequantize_nvfp4(*want))
    edges = mxfp4_cases()
    assert_same_outputs(on_cpu(Q.quantize_mxfp4_triton(edges.cuda())), F.quantize_mxfp4(edges))
    ties = e2m1_tie_blocks()
    nv_edges = torch.cat([ties, ties * 1.0625, ties * 2.0 ** -8, ties * 1000, torch.zeros(32)])[None, :].repeat(3, 1)
    assert_same_outputs(on_cpu(Q.quantize_nvfp4_triton(nv_edges.cuda(), 1.0)), F.quantize_nvfp4(nv_edges, 1.0))


@pytest.mark.gpu
def test_gpu_ops_pick_the_kernels_and_agree_with_the_reference(poisoned):
    x = gpu_input((1000, 4096), seed=3)
    assert_same_outputs(on_cpu(ops.quantize_fp8(x, "block", block=(1, 128))), F.quantize_fp8_blockwise(x.cpu()))
    assert_same_outputs(on_cpu(ops.quantize_nvfp4(x)), F.quantize_nvfp4(x.cpu()))
    compiled = torch.compile(lambda t: ops.dequantize_mxfp4(*ops.quantize_mxfp4(t)), fullgraph=True)
    assert_same_bits(compiled(x).cpu(), F.dequantize_mxfp4(*F.quantize_mxfp4(x.cpu())))


@pytest.mark.gpu
def test_gpu_bandwidth_of_the_quantizers():
    """Prints the share of copy bandwidth each kernel reaches on [8192, 7168] bf16 (run with -s);
    fails only below a floor that would mean something is badly wrong (15% of 3000 GB/s). Measured on
    the H100 (2026-11-21): fp8 38-49%, int4 61%, mxfp4 45%, nvfp4 with a given global scale 23%:
    short of the 55-90% the kernels were planned for; not yet profiled."""
    import triton.testing

    x = gpu_input((8192, 7168), outliers=False)
    n = x.numel()
    cases = {
        "fp8 rowwise": (lambda: Q.quantize_fp8_rowwise_triton(x), 3 * n),
        "fp8 1x128": (lambda: Q.quantize_fp8_blockwise_triton(x), 3 * n + n // 32),
        "fp8 128x128": (lambda: Q.quantize_fp8_blockwise_triton(x, (128, 128)), 3 * n),
        "int4 g128": (lambda: Q.quantize_int4_triton(x, 128), 2.5 * n + n // 64),
        "mxfp4": (lambda: Q.quantize_mxfp4_triton(x), 2.5 * n + n // 32),
        "nvfp4 (given global scale)": (lambda: Q.quantize_nvfp4_triton(x, 0.01), 2.5 * n + n // 16),
    }
    packed, scales = Q.quantize_mxfp4_triton(x)
    cases["mxfp4 dequant"] = (lambda: Q.dequantize_mxfp4_triton(packed, scales), 4.5 * n + n // 32)
    for label, (fn, moved) in cases.items():
        ms = triton.testing.do_bench(fn, warmup=25, rep=100)
        gbps = moved / ms / 1e6
        print(f"{label:28s} {ms * 1e3:8.1f} us  {gbps:7.0f} GB/s  {gbps / 3000:.0%} of 3000 GB/s")
        assert gbps > 0.15 * 3000, label

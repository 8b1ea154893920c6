"""FP8 weight-only GEMV: the Triton kernel under the interpreter against float64 of the dequantized
weight (M = 1 to 16, N tails inside and across 128-row scale bands, K of one chunk to a step and a
half), every e4m3 code at every byte position of a word with its own k, token and scale, by hand;
outputs poisoned with NaN, rows of wider buffers (nothing past K read), bad inputs refused, the
byte count; kforge.ops.fp8_gemv as a custom op (opcheck, torch.compile, the CPU fallback); the
Llama `linear` dispatch (GEMV up to 16 rows, the FP8 GEMM above); the sm_90 machine code of
fp8_gemv.cu (instructions a weight, registers, no spills). On a GPU: fp8_gemv.cu in every variant,
batch and odd shape, every code at every position again, the Llama-3-8B widths at M = 1 to 16,
the Triton fallback, the op under inductor, and the FP8 model's prefill and decode through it."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter

import pytest
import torch
import triton

from kforge.kernels.quant import fp8_gemv as module
from kforge.kernels.quant.formats import dequantize_fp8, quantize_fp8_blockwise
from kforge.kernels.quant.fp8_gemv import (MAX_BATCH, check_fp8_gemv_inputs, fp8_gemv, fp8_gemv_min_bytes,
                                           fp8_gemv_reference)
from kforge.ops.fp8 import fp8_gemv as fp8_gemv_op

SMALL = {"BLOCK_N": 4, "BLOCK_K": 256, "num_warps": 1}  # two chunks a step: K = 384 is a step and a half
LLAMA3_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # (N, K): qkv, o, gate-up, down


def _inputs(m, n, k, device="cpu", seed=0, x_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / k**0.5
    w[:, :128] *= 64.0  # the first column of blocks on another scale: a scale applied to the wrong block shows
    q, scale = quantize_fp8_blockwise(w.to(device), (128, 128))
    x = (torch.randn(m, k, generator=g) * x_scale).to(device=device, dtype=torch.bfloat16)
    return x, q, scale


def assert_matches(y, x, q, scale):
    """y is x @ (q * scale).T rounded once to bf16 (the interpreter truncates: under 2^-7 relative;
    the GPU rounds to nearest: 2^-8), give or take fp32 sums in any order (2^-20 of the terms'
    magnitude), in float64."""
    w = dequantize_fp8(q, scale, (128, 128)).double()
    exact, magnitude = x.double() @ w.T, x.double().abs() @ w.abs().T
    rounding = 2**-8 if y.is_cuda else 2**-7
    assert y.dtype == torch.bfloat16 and y.shape == exact.shape, (y.dtype, y.shape, exact.shape)
    assert torch.isfinite(y).all(), "an output was not written (NaN poison) or overflowed"
    excess = (y.double() - exact).abs() - (rounding * exact.abs() + 2**-20 * magnitude)
    assert excess.max().item() <= 0, f"off the exact product by more than a rounding: {excess.max().item():.3g}"


# --- the Triton kernel under the interpreter -----------------------------------------------------

# (M, N, K, config): N = 300 is three scale bands, the last partial, and 75 tiles of 4 rows; 77 and 129
# end inside a tile and a band; K = 128 is one chunk (a masked step only), 384 a step and a half, 640
# two and a half; M = 3, 5, 9, 16 pad to 4, 8, 16, 16 tokens
CASES = [(1, 300, 384, SMALL), (3, 77, 128, SMALL), (2, 129, 640, SMALL), (5, 40, 256, SMALL),
         (16, 36, 384, {**SMALL, "BLOCK_N": 2}), (9, 130, 512, {"BLOCK_N": 8, "BLOCK_K": 128, "num_warps": 2}),
         (8, 256, 1024, {"BLOCK_N": 128, "BLOCK_K": 512, "num_warps": 4})]


@pytest.mark.parametrize("m, n, k, config", CASES, ids=str)
@pytest.mark.slow
def test_the_triton_kernel_matches_float64_under_the_interpreter(m, n, k, config, nan_outputs):
    x, q, scale = _inputs(m, n, k, seed=m + n)
    assert_matches(fp8_gemv(x, q, scale, config=config), x, q, scale)


def test_the_default_tile_under_the_interpreter(nan_outputs):
    x, q, scale = _inputs(2, 150, 384, seed=1)
    assert_matches(fp8_gemv(x, q, scale), x, q, scale)
    assert_matches(fp8_gemv_reference(x, q, scale), x, q, scale)


def _every_code_at_every_position(m: int, chunk: int, device="cpu"):
    """W of 1024 rows and K = 256 with one nonzero code a row, in chunk `chunk`: row r holds code
    c = r % 256 (NaN's 0x7F and 0xFF replaced by their neighbours 0x7E and 0xFE) in byte j = r // 256
    of word c % 32 of the chunk, so every code sits at every byte position of a word, and the words
    cover the 4 lanes' 8 words each. Row band b (128 rows) has scale 2^(b - 4) on the chunk and 1024
    on the other; x[t, k] = 2^((k + 3t) % 16 - 8). Then y[t, r] = value(c) * 2^(b - 4) * x[t, k],
    exact in bf16: a code, a byte, a lane, a token or a scale taken for another shows."""
    rows, k_in = 1024, 256
    r = torch.arange(rows)
    codes = r % 256
    codes = torch.where((codes == 0x7F) | (codes == 0xFF), codes - 1, codes).to(torch.uint8)
    position = 128 * chunk + 4 * (r % 256 % 32) + r // 256
    q = torch.zeros(rows, k_in, dtype=torch.uint8)
    q[r, position] = codes
    q = q.view(torch.float8_e4m3fn)
    scale = torch.full((rows // 128, 2), 1024.0)
    scale[:, chunk] = torch.exp2(torch.arange(rows // 128) - 4.0)
    kk = torch.arange(k_in)
    x = torch.exp2(((kk[None, :] + 3 * torch.arange(m)[:, None]) % 16 - 8).float()).to(torch.bfloat16)
    expected = (codes.view(torch.float8_e4m3fn).float() * torch.exp2(r // 128 - 4.0))[None, :] * x.float()[:, position]
    return x.to(device), q.to(device), scale.to(device), expected.to(torch.bfloat16).to(device)


@pytest.mark.parametrize("m, chunk", [(1, 0), (3, 1)], ids=str)
def test_every_code_at_every_byte_position_multiplies_its_own_k_token_and_scale(m, chunk):
    x, q, scale, expected = _every_code_at_every_position(m, chunk)
    assert len(torch.unique(q.view(torch.uint8))) == 254  # every code but the two NaNs (0x00 also fills)
    y = fp8_gemv(x, q, scale, config={"BLOCK_N": 128, "BLOCK_K": 256, "num_warps": 1})  # few programs
    torch.testing.assert_close(y, expected, rtol=0, atol=0)


@pytest.mark.parametrize("x_scale", [1e12, 1e-12], ids=["large x", "small x"])
def test_x_far_from_one(x_scale):
    x, q, scale = _inputs(2, 20, 256, x_scale=x_scale)
    assert_matches(fp8_gemv(x, q, scale, config=SMALL), x, q, scale)


def test_a_vector_empty_sizes_and_rows_of_wider_buffers():
    x, q, scale = _inputs(3, 10, 256)
    y = fp8_gemv(x[1], q, scale)
    assert y.shape == (10,)
    assert_matches(y[None], x[1:2], q, scale)
    assert fp8_gemv(x[:0], q, scale).shape == (0, 10)
    assert fp8_gemv(x, q[:0], scale[:0]).shape == (3, 0)
    # x, q and scale as rows of wider buffers holding NaN past K: nothing there may be read
    wide_x = torch.full((3, 300), float("nan"), dtype=torch.bfloat16)
    wide_x[:, :256] = x
    wide_q = torch.full((10, 400), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)
    wide_q[:, :256] = q
    wide_scale = torch.full((1, 5), float("nan"))
    wide_scale[:, :2] = scale
    assert_matches(fp8_gemv(wide_x[:, :256], wide_q[:, :256], wide_scale[:, :2], config=SMALL), x, q, scale)


def _bad_cases():
    x, q, scale = _inputs(2, 8, 256)
    return [
        ((x.float(), q, scale), r"x must be a \(K,\) or \(M, K\) torch.bfloat16"),
        ((x[None], q, scale), r"x must be a \(K,\) or \(M, K\) torch.bfloat16"),
        ((x, q.view(torch.uint8), scale), r"q must be an \(N, K\) torch.float8_e4m3fn"),
        ((x, q.float().to(torch.float8_e5m2), scale), r"q must be an \(N, K\) torch.float8_e4m3fn"),
        ((x, q, scale.bfloat16()), r"scale must be a \(ceil\(N/128\), K/128\) torch.float32"),
        ((x[:, :128], q, scale), "x has K = 128 but q"),
        ((x[:, :64], q[:, :64], scale[:, :1]), "K = 64 must be a positive multiple of 128"),
        ((x, q, scale[:, :1]), r"scale must be \(ceil\(N/128\), K/128\) = \(1, 2\)"),
        ((x, q, torch.ones(2, 2)), r"scale must be \(ceil\(N/128\), K/128\) = \(1, 2\)"),
        ((torch.zeros(17, 256, dtype=torch.bfloat16), q, scale), "at most 16 rows, got 17: use fp8_gemm"),
        ((torch.zeros(2, 512, dtype=torch.bfloat16)[:, ::2], q, scale), "contiguous rows"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_cases())))
def test_bad_inputs_are_refused_with_a_one_line_message(case):
    args, message = _bad_cases()[case]
    for refuse in (check_fp8_gemv_inputs, fp8_gemv):
        with pytest.raises(ValueError, match=message) as raised:
            refuse(*args)
        assert "\n" not in str(raised.value)


def test_minimum_bytes_and_the_tiles_refused():
    # Llama-3-8B gate-up: 117.4 MB of codes, 28 KB of scales (224 x 32 fp32), x and y
    assert fp8_gemv_min_bytes(1, 28672, 4096) == 28672 * 4096 + 224 * 32 * 4 + 2 * (4096 + 28672)
    assert fp8_gemv_min_bytes(16, 300, 256) == 300 * 256 + 3 * 2 * 4 + 16 * (256 + 300) * 2
    x, q, scale = _inputs(1, 8, 256)
    for tile in ({"BLOCK_N": 3, "BLOCK_K": 256}, {"BLOCK_N": 256, "BLOCK_K": 256}, {"BLOCK_N": 4, "BLOCK_K": 64}):
        with pytest.raises(ValueError, match="BLOCK_N must be a power of two dividing 128"):
            fp8_gemv(x, q, scale, config=tile)
    assert MAX_BATCH == 16
    # fp8_gemv.cu's variants that cannot be built are refused before anything compiles or launches
    x, q, scale = _inputs(16, 8, 256)
    y = torch.empty(16, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="needs 61440 bytes of shared memory, over 49152"):
        module.launch_cuda_gemv(x, q, scale, y, m_tiles=4, k_warps=16)
    with pytest.raises(ValueError, match="1, 2, 4 or 8 m-tiles a warp"):
        module.launch_cuda_gemv(x, q, scale, y, m_tiles=3)


# --- the custom op and the model's dispatch ---------------------------------------------------------

def test_op_passes_opcheck_compiles_and_falls_back_to_the_reference_on_cpu():
    x, q, scale = _inputs(3, 140, 256)
    torch.testing.assert_close(fp8_gemv_op(x, q, scale), fp8_gemv_reference(x, q, scale), rtol=0, atol=0)
    assert_matches(fp8_gemv_op(x, q, scale), x, q, scale)
    assert fp8_gemv_op(x[0], q, scale).shape == (140,)
    assert_matches(fp8_gemv_op(torch.zeros(3, 512, dtype=torch.bfloat16)[:, ::2].copy_(x), q, scale), x, q, scale)
    for args in ((x, q, scale), (x[0], q, scale)):  # (opcheck's schema test cannot compare fp8 on the CPU)
        torch.library.opcheck(torch.ops.kforge.fp8_gemv.default, args,
                              test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    compiled = torch.compile(lambda a, b, c: fp8_gemv_op(a, b, c) * 2, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, q, scale), 2 * fp8_gemv_reference(x, q, scale))


def test_op_refuses_bad_dtypes_and_shapes_with_value_errors():
    x, q, scale = _inputs(3, 24, 256)
    for args, message in ((((x[:, :128], q, scale)), "x has K = 128 but q"),
                          ((x.half(), q, scale), "torch.bfloat16"),
                          ((torch.zeros(17, 256, dtype=torch.bfloat16), q, scale), "at most 16 rows"),
                          ((x, q, scale[:, :1]), "scale must be")):
        with pytest.raises(ValueError, match=message):
            fp8_gemv_op(*args)


def test_llama_linear_takes_the_gemv_up_to_16_rows_and_the_dequantized_weight_above(monkeypatch):
    from kforge import ops
    from kforge.models.llama import model
    from kforge.models.llama.quantize import Fp8Weight

    calls = Counter()
    for name in ("fp8_gemv", "fp8_gemm", "quantize_fp8", "dequantize_fp8"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _name=name, _real=real, **kw: calls.update([_name]) or _real(*a, **kw))
    _, q, scale = _inputs(1, 140, 256)
    weight = Fp8Weight(q, scale)
    for rows in (1, 2, 16):
        x = torch.randn(rows, 256).bfloat16()
        assert_matches(model.linear(x, weight), x, q, scale)
    assert calls == {"fp8_gemv": 3}
    x = torch.randn(17, 256).bfloat16()
    y = model.linear(x, weight)
    assert calls == {"fp8_gemv": 3, "dequantize_fp8": 1}  # x stays bf16 at any row count: batch-invariant
    assert y.shape == (17, 140)
    # the weight is rounded to bf16 on the way (2^-9 relative each), then one bf16 GEMM
    exact = x.double() @ dequantize_fp8(q, scale, (128, 128)).double().T
    magnitude = x.double().abs() @ dequantize_fp8(q, scale, (128, 128)).double().abs().T
    assert ((y.double() - exact).abs() <= 2**-7 * exact.abs() + 2**-8 * magnitude).all()



def test_the_residual_add_gives_the_pairs_bits_and_refuses_a_wrong_residual():
    # CPU: the Triton kernel under the interpreter, then the add; the op's reference path; the
    # model's down projection takes it for an FP8 weight at decode (one launch less on the GPU)
    from kforge import ops
    from kforge.models.llama import model
    from kforge.models.llama.quantize import Fp8Weight

    x, q, scale = _inputs(3, 140, 256)
    residual = torch.randn(3, 140).bfloat16()
    pair = residual + fp8_gemv(x, q, scale, config=SMALL)
    assert torch.equal(fp8_gemv(x, q, scale, config=SMALL, residual=residual), pair)
    assert torch.equal(fp8_gemv(x[0], q, scale, config=SMALL, residual=residual[0]), pair[0])
    assert torch.equal(ops.fp8_gemv_residual(x, q, scale, residual), residual + fp8_gemv_reference(x, q, scale))
    weight = Fp8Weight(q, scale)
    assert torch.equal(model.linear_residual(x, weight, residual), residual + model.linear(x, weight))
    for bad, message in ((residual[:, :139], "y's shape"), (residual.float(), "torch.bfloat16"),
                         (torch.randn(140, 3).bfloat16().t(), "contiguous rows")):
        with pytest.raises(ValueError, match=message):
            fp8_gemv(x, q, scale, residual=bad)
        with pytest.raises(ValueError, match=message):
            ops.fp8_gemv_residual(x, q, scale, bad)
    torch.library.opcheck(torch.ops.kforge.fp8_gemv_residual.default, (x, q, scale, residual),
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))

# --- machine code for the H100, compiled on any machine ---------------------------------------------

def _compiled(defines):
    from kforge.runtime.cuda import compile_cuda, resources, sass, sass_loops

    cubin = compile_cuda(module.CUDA_SOURCE, arch="sm_90a", defines=defines)
    return resources(cubin)["fp8_gemv"], max(sass_loops(sass(cubin)), key=len)


@pytest.mark.parametrize("n_tiles, per_weight", [(1, 3.05), (2, 3.4)])
def test_the_cuda_kernel_compiles_for_sm90_as_designed(n_tiles, per_weight):
    """fp8_gemv.cu's loop at the variant `cuda_variant` picks for 8 and 16 tokens (two 128-k chunks,
    taking turns): per chunk, 8 k16 steps of NT bf16 mma.sync; each pair of codes decoded by the
    hardware (F2FP e4m3 unpack), widened (two HADD2.F32) and packed (one F2FP to bf16): 2
    instructions a weight, no integer conversion; W's four 16-byte loads a chunk skip L1 and x's stay
    in it; registers within MINB blocks of KW warps an SM (128 at 2 blocks of 8 warps), no spills;
    under `per_weight` instructions a weight, where an SM can issue ~9 a weight at 3 TB/s."""
    m_tiles, k_warps, x_ahead, min_blocks = module.cuda_variant(4096, 8 * n_tiles, 132)
    used, loop = _compiled({"MT": m_tiles, "NT": n_tiles, "KW": k_warps, "XPF": int(x_ahead), "MINB": min_blocks})
    assert (used.spill_stores, used.spill_loads, used.stack_bytes, used.local_bytes) == (0, 0, 0, 0), used
    assert used.registers <= 65536 // (min_blocks * k_warps * 32) // 8 * 8, used
    assert used.shared_bytes == module.cuda_shared_bytes(m_tiles, n_tiles, k_warps) + 1024, used  # + sm_90's 1 KB
    ops = Counter(loop)
    chunks, weights = 2, 2 * m_tiles * 2 * 32  # two chunks; a lane's 32 k of 2 rows an m-tile
    assert ops["HMMA.16816.F32.BF16"] == chunks * 8 * m_tiles * n_tiles, ops
    assert ops["F2FP.F16.E4M3.UNPACK_B"] == weights // 2 and ops["F2FP.BF16.F32.PACK_AB"] == weights // 2, ops
    assert ops["HADD2.F32"] == weights, ops
    assert ops["LDG.E.NA.128.CONSTANT"] == chunks * 4 * m_tiles, ops
    assert ops["LDG.E.128.CONSTANT"] == chunks * 4 * n_tiles and ops["LDG.E.CONSTANT"] == chunks, ops
    assert not any(op.startswith(("I2F", "F2I", "LDL", "STL", "LDS", "STS", "BAR")) for op in ops), ops
    assert len(loop) <= per_weight * weights, f"{len(loop) / weights:.2f} instructions a weight"


def test_the_residual_build_adds_in_the_store_and_keeps_the_loop():
    """RESIDUAL 1: the same loop instruction for instruction; each stored element reads one bf16 of
    residual (a 16-bit load), adds once in fp32 and rounds once more; no spills."""
    m_tiles, k_warps, x_ahead, min_blocks = module.cuda_variant(4096, 1, 132)
    defines = {"MT": m_tiles, "NT": 1, "KW": k_warps, "XPF": int(x_ahead), "MINB": min_blocks}
    from kforge.runtime.cuda import compile_cuda, sass

    _, plain_loop = _compiled(defines)
    used, loop = _compiled({**defines, "RESIDUAL": 1})
    assert loop == plain_loop
    assert (used.spill_stores, used.spill_loads, used.local_bytes) == (0, 0, 0), used
    assert used.registers <= 65536 // (min_blocks * k_warps * 32) // 8 * 8, used
    code = sass(compile_cuda(module.CUDA_SOURCE, arch="sm_90a", defines={**defines, "RESIDUAL": 1}))
    plain = sass(compile_cuda(module.CUDA_SOURCE, arch="sm_90a", defines=defines))
    count = lambda op, text: sum(f" {op} " in line for line in text.splitlines())
    # a lane stores four elements (two rows x two tokens of its m16 n8 fragment): each one more load, add, rounding
    for op in ("LDG.E.U16.CONSTANT", "FADD", "F2F.BF16.F32"):
        assert count(op, code) == count(op, plain) + 4, op


SWEEP_VARIANTS = [(1, 8, 0, 3), (1, 8, 1, 2), (1, 8, 1, 1), (1, 4, 0, 5), (1, 4, 1, 4), (1, 16, 0, 1), (1, 16, 1, 1),
                  (2, 4, 0, 3), (2, 8, 0, 1), (2, 4, 1, 2), (1, 2, 1, 6)]  # fp8_gemv_sweep.py's (MT, KW, XPF, MINB)


@pytest.mark.slow
def test_every_variant_the_sweep_times_compiles_without_spills():
    for (m_tiles, k_warps, x_ahead, min_blocks), n_tiles in itertools.product(SWEEP_VARIANTS, (1, 2)):
        used, _ = _compiled({"MT": m_tiles, "NT": n_tiles, "KW": k_warps, "XPF": x_ahead, "MINB": min_blocks})
        assert (used.spill_stores, used.spill_loads, used.local_bytes) == (0, 0, 0), (m_tiles, k_warps, n_tiles, used)
        assert used.shared_bytes <= module.CUDA_SHARED_LIMIT + 1024, used


def test_the_sweep_script_times_the_variants_the_tests_compile():
    import ast
    from pathlib import Path

    script = Path(module.__file__).parents[4] / "scripts" / "fp8_gemv_sweep.py"
    tree = ast.parse(script.read_text())
    (value,) = [node.value for node in tree.body if isinstance(node, ast.Assign)
                and any(getattr(t, "id", None) == "VARIANTS" for t in node.targets)]
    assert ast.literal_eval(value) == SWEEP_VARIANTS
    for n in (4096, 6144, 28672):
        m_tiles, k_warps, x_ahead, min_blocks = module.cuda_variant(n, 1, 132)
        assert (m_tiles, k_warps, int(x_ahead), min_blocks) in SWEEP_VARIANTS


# --- on the GPU ------------------------------------------------------------------------------------

VARIANTS = [(m, k, x) for m, k, x in itertools.product((1, 2, 4), (1, 4, 8, 16), (False, True))]


def _variants(batch: int) -> list[tuple[int, int, bool]]:
    """The (MT, KW, XPF) whose cross-warp sums fit static shared memory at this batch."""
    n_tiles = triton.cdiv(batch, 8)
    return [v for v in VARIANTS if module.cuda_shared_bytes(v[0], n_tiles, v[1]) <= module.CUDA_SHARED_LIMIT]


def _count(monkeypatch, name):
    calls = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *args, **kw: calls.append(args) or real(*args, **kw))
    return calls


@pytest.mark.gpu
def test_the_cuda_kernel_in_every_variant_batch_and_odd_shape(nan_outputs):
    """fp8_gemv.cu against float64 for 1 to 16 tokens (one or two n-tiles, the last partly past the
    batch), every (MT, KW, XPF) variant, N not a multiple of a block's rows nor of a band (9, 300,
    777, 4100), K of one chunk (fewer chunks than warps) to 112 chunks, x far from 1; each output
    NaN-poisoned first."""
    cases = [(9, 128, 1.0), (300, 1152, 1.0), (777, 2048, 1e12), (4100, 4096, 1.0), (300, 14336, 1e-12)]
    for batch in (1, 2, 3, 8, 9, 16):
        for n, k, x_scale in cases:
            x, q, scale = _inputs(batch, n, k, "cuda", seed=batch + n, x_scale=x_scale)
            assert module.cuda_kernel_fits(x, q)
            for m_tiles, k_warps, x_ahead in _variants(batch):
                y = torch.full((batch, n), float("nan"), dtype=torch.bfloat16, device="cuda")
                module.launch_cuda_gemv(x, q, scale, y, m_tiles=m_tiles, k_warps=k_warps, x_ahead=x_ahead,
                                        min_blocks=1)
                assert_matches(y, x, q, scale)


@pytest.mark.gpu
def test_the_cuda_residual_build_gives_the_pairs_bits(nan_outputs):
    """RESIDUAL 1 against the unfused pair (the plain build, then torch's bf16 add), bit for bit, for
    1 to 16 tokens and odd N, residual rows wider than N; and through the op."""
    from kforge import ops

    for batch in (1, 3, 9, 16):
        for n, k in ((300, 1152), (4096, 4096), (4100, 14336)):
            x, q, scale = _inputs(batch, n, k, "cuda", seed=batch + n)
            residual = torch.randn(batch, n + 8, device="cuda").bfloat16()[:, :n]
            pair = residual + fp8_gemv(x, q, scale)
            assert torch.equal(fp8_gemv(x, q, scale, residual=residual), pair), (batch, n, k)
            assert torch.equal(ops.fp8_gemv_residual(x, q, scale, residual), pair)


@pytest.mark.gpu
@pytest.mark.parametrize("m, chunk", [(1, 0), (1, 1), (3, 0), (9, 1), (16, 0)], ids=str)
def test_every_code_at_every_byte_position_on_the_gpu(m, chunk):
    x, q, scale, expected = _every_code_at_every_position(m, chunk, "cuda")
    for m_tiles, k_warps, x_ahead in _variants(m):
        y = torch.full(expected.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
        module.launch_cuda_gemv(x, q, scale, y, m_tiles=m_tiles, k_warps=k_warps, x_ahead=x_ahead, min_blocks=1)
        variant = (m_tiles, k_warps, x_ahead)
        torch.testing.assert_close(y, expected, rtol=0, atol=0, msg=lambda text, variant=variant: f"{variant} {text}")
    triton_tile = module.triton_tile(m, None, False)  # the fallback's tile: K = 256 is one masked step of 512
    torch.testing.assert_close(fp8_gemv(x, q, scale, config=triton_tile), expected, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 3, 8, 16])
@pytest.mark.parametrize("n, k", LLAMA3_8B, ids=str)
def test_the_llama3_8b_widths_take_the_cuda_kernel(n, k, m, monkeypatch, nan_outputs):
    calls = _count(monkeypatch, "launch_cuda_gemv")
    x, q, scale = _inputs(m, n, k, "cuda", seed=m)
    assert_matches(fp8_gemv(x, q, scale), x, q, scale)
    assert_matches(fp8_gemv_op(x, q, scale), x, q, scale)
    assert len(calls) == 2


@pytest.mark.gpu
def test_the_triton_kernel_on_the_gpu_and_what_falls_back_to_it(monkeypatch, nan_outputs):
    """Every tile size asked for and the default fallback tile at each batch; x or W whose rows are
    not 16-byte aligned take the Triton kernel; padded rows of W and x that are aligned take CUDA."""
    calls = _count(monkeypatch, "launch_cuda_gemv")
    for batch in (1, 2, 5, 16):
        x, q, scale = _inputs(batch, 777, 1152, "cuda", seed=batch)
        rows = max(1, 16 // triton.next_power_of_2(batch))  # 64 accumulators a thread at most: no spills
        for config in (module.triton_tile(batch, None, False), {"BLOCK_N": rows, "BLOCK_K": 256, "num_warps": 2},
                       {"BLOCK_N": 1, "BLOCK_K": 128, "num_warps": 1}):
            assert_matches(fp8_gemv(x, q, scale, config=config), x, q, scale)
        shifted = torch.empty(batch * 1152 + 1, dtype=torch.bfloat16, device="cuda")[1:].view(batch, 1152)
        shifted.copy_(x)
        assert not module.cuda_kernel_fits(shifted, q)
        assert_matches(fp8_gemv(shifted, q, scale), x, q, scale)
    unaligned_q = torch.empty(777 * 1160, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    unaligned_q = unaligned_q.view(777, 1160)[:, 8:]
    unaligned_q.copy_(q)
    assert not module.cuda_kernel_fits(x, unaligned_q)
    assert_matches(fp8_gemv(x, unaligned_q, scale), x, q, scale)
    assert not calls
    wide_x = torch.full((16, 1152 + 64), float("nan"), dtype=torch.bfloat16, device="cuda")
    wide_x[:, :1152] = x
    wide_q = torch.full((777, 1152 + 128), 0x7F, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    wide_q[:, :1152] = q
    assert module.cuda_kernel_fits(wide_x[:, :1152], wide_q[:, :1152])
    assert_matches(fp8_gemv(wide_x[:, :1152], wide_q[:, :1152], scale), x, q, scale)
    assert len(calls) == 1


@pytest.mark.gpu
def test_op_on_the_gpu_runs_our_kernel_and_compiles_with_inductor(monkeypatch):
    from kforge.ops.fp8 import gemv_can_run

    calls = _count(monkeypatch, "launch_cuda_gemv")
    for m in (1, 16):
        x, q, scale = _inputs(m, 6144, 4096, "cuda")
        assert gemv_can_run(x, q, scale)
        compiled = torch.compile(lambda a, b, c: fp8_gemv_op(a, b, c), fullgraph=True)
        assert_matches(compiled(x, q, scale), x, q, scale)
    assert len(calls) == 2


@pytest.mark.gpu
def test_the_fp8_model_prefills_and_decodes_through_the_gemv(monkeypatch):
    """llama3-1b's widths, 2 layers, FP8 weights. A 12-token prompt (every linear at 12 rows) takes
    the GEMV: its logits are those of the bf16 model holding the dequantized weights (the weights'
    own bf16 rounding apart), closer than the FP8 GEMM path's, which also quantizes x. The engine's
    decode steps (CUDA graphs) take the GEMV too."""
    from kforge.models.engine import Engine
    from kforge.models.llama import Batch, KVCache, random_model
    from kforge.models.llama import model as model_module
    from kforge.models.llama.config import preset
    from kforge.models.llama.quantize import LINEAR_WEIGHTS
    from kforge.models.sampling import SamplingParams

    config = dataclasses.replace(preset("llama3-1b"), n_layers=2)
    quantized = random_model(config, device="cuda", weights="fp8")
    dequantized = random_model(config, device="cuda")
    for q_block, d_block in zip(quantized.layers, dequantized.layers):
        for name in LINEAR_WEIGHTS:
            weight = getattr(q_block, name)
            getattr(d_block, name).data.copy_(dequantize_fp8(weight.q, weight.scale, (128, 128)))

    prompt = list(range(1000, 1012))

    def prompt_logits(model):
        cache = KVCache(model.config, num_pages=4, page_size=16, max_slots=1, max_context=64, dtype=torch.bfloat16,
                        device="cuda")
        cache.assign(0, list(range(4)))
        batch = Batch.build([], [(0, 0, prompt, True)], "cuda")
        batch.logit_rows = torch.arange(len(prompt), device="cuda")
        return model(batch, cache)

    def relative(a, b):
        return float((a - b).norm() / b.norm())

    calls = _count(monkeypatch, "launch_cuda_gemv")
    ours = prompt_logits(quantized)
    assert len(calls) == config.n_layers * len(LINEAR_WEIGHTS)
    bf16 = prompt_logits(dequantized)
    monkeypatch.setattr(model_module, "FP8_GEMV_MAX_ROWS", 0)  # every linear through the dequantized weight
    gemm = prompt_logits(quantized)
    monkeypatch.undo()
    assert relative(ours, bf16) < 2e-2, relative(ours, bf16)  # 0.007 on the CPU at dim 256
    # the bf16 model's own weights: only its GEMV's rounding chain against the GEMM's (0.012 on the H100)
    assert relative(gemm, bf16) < 2e-2, relative(gemm, bf16)
    calls = _count(monkeypatch, "launch_cuda_gemv")
    prompts = [prompt[:8], prompt[:5]]  # one prefill step of 13 rows, then decode steps of 2
    tokens = Engine(quantized, max_slots=2, max_context=64).generate(prompts, SamplingParams(max_tokens=4))
    assert all(1 <= len(t) <= 4 for t in tokens)
    # the prefill's, and a decode step's before its graph is captured (and again as it is)
    assert len(calls) >= 2 * config.n_layers * len(LINEAR_WEIGHTS)

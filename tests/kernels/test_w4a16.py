"""W4A16: both kernels under the interpreter (the CUDA-core GEMV and the tensor-core path with
split K) against float64 on odd N, K tails, groups 32 to 256, M = 1, 2, 3, 17, 32; every
nibble of a word on its own k, by hand; x's dynamic range; outputs poisoned with NaN; bad
inputs refused; the path choice, the split, the pruning and the byte count;
kforge.ops.w4a16_matmul as a custom op (opcheck, torch.compile, the fallback); the problem
file through gate 1; the sm_90 machine code of the tiles (shared memory, spills) and of the
one-token CUDA kernel (w4a16_gemv.cu). On a GPU: Llama-3-8B widths at M = 1, 3, 16, 32, every
tile of both paths, the CUDA kernel in every variant, group and odd shape (and what falls
back), the op under inductor."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import triton

from conftest import codegen_of_triton_3_6
from kforge.kernels.quant import w4a16
from kforge.kernels.quant.formats import dequantize_int4, pack_nibbles, quantize_int4, unpack_int4
from kforge.kernels.quant.w4a16 import (GEMV_CONFIGS, GEMV_LANE_WORK_LIMIT, MMA_CONFIGS, _gemv_configs_for,
                                        check_w4a16_inputs, gemv_lane_work, split_k, w4a16_matmul, w4a16_min_bytes,
                                        w4a16_reference)
from kforge.ops.w4a16 import w4a16_matmul as w4a16_op

PROBLEM = Path(w4a16.__file__).parents[2] / "problems" / "level1" / "w4a16_gemv_bf16.py"
GEMV = {"path": "gemv", "BLOCK_N": 4, "BLOCK_KW": 32, "num_warps": 1}  # 256 k a step
MMA = {"path": "mma", "BLOCK_N": 16, "num_warps": 1, "num_stages": 1}


def _inputs(m, n, k, group, device="cpu", seed=0, x_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    qweight, scales = quantize_int4((torch.randn(n, k, generator=g) / k**0.5).to(device), group)
    return (torch.randn(m, k, generator=g) * x_scale).to(device=device, dtype=torch.bfloat16), qweight, scales


def _exact(x, qweight, scales, group):
    """float64 x @ (q * s).T, the product the kernels sum (each q * s exact), and the sum of |x| * s *
    (|q| + 8): the magnitude of the terms as the GEMV forms them (u = q + 8, minus 8 * sum x)."""
    q = unpack_int4(qweight).double()
    s = scales.double().repeat_interleave(group, dim=1)
    return x.double() @ (q * s).T, x.double().abs() @ ((q.abs() + 8) * s).T


def assert_matches(y, x, qweight, scales, group):
    """y is x @ (q * s).T rounded once to bf16 (the interpreter truncates: under 2^-7 relative; the
    GPU rounds to nearest: 2^-8), give or take fp32 sums in any order (2^-20 of the terms'
    magnitude); and it is within the weights' own bf16 rounding (2^-9 of that at worst) of the
    eager reference x @ dequantize_int4(...).T, in float64."""
    exact, magnitude = _exact(x, qweight, scales, group)
    rounding = 2**-8 if y.is_cuda else 2**-7
    assert y.dtype == torch.bfloat16 and y.shape == exact.shape
    assert torch.isfinite(y).all(), "an output was not written (NaN poison) or overflowed"
    excess = (y.double() - exact).abs() - (rounding * exact.abs() + 2**-20 * magnitude)
    assert excess.max().item() <= 0, f"off the exact product by more than a rounding: {excess.max().item():.3g}"
    eager = x.double() @ dequantize_int4(qweight, scales, group).double().T
    excess = (y.double() - eager).abs() - (rounding * eager.abs() + 2**-9 * magnitude)
    assert excess.max().item() <= 0, f"off the eager reference: {excess.max().item():.3g}"


# --- the kernels under the interpreter -------------------------------------------------------

# (M, N, K, group, config): N = 77, 45, 33 not multiples of the tile; K = 384 is 1.5 GEMV steps
# (a masked tail step), 640 is 5 tensor-core blocks split 2 + 3 (uneven) or 3 ways; groups of
# 32 and 64 (scale changes inside a step) and 256 (two blocks a scale); M = 17 and 32 pad to 32
GEMV_CASES = [(1, 77, 384, 128, GEMV), (2, 33, 256, 64, GEMV), (1, 9, 160, 32, GEMV),
              (2, 40, 512, 256, {**GEMV, "BLOCK_N": 8, "BLOCK_KW": 64})]
MMA_CASES = [(3, 45, 640, 128, {**MMA, "SPLIT_K": 2}), (17, 20, 256, 128, {**MMA, "SPLIT_K": 1}),
             (32, 19, 512, 256, {**MMA, "SPLIT_K": 3}), (5, 33, 640, 128, {**MMA, "BLOCK_N": 32, "SPLIT_K": 5})]


@pytest.mark.parametrize("m, n, k, group, config", GEMV_CASES + MMA_CASES, ids=str)
@pytest.mark.slow
def test_kernels_match_float64_under_the_interpreter(m, n, k, group, config, nan_outputs):
    x, qweight, scales = _inputs(m, n, k, group)
    assert_matches(w4a16_matmul(x, qweight, scales, group, config=config), x, qweight, scales, group)


@pytest.mark.parametrize("m, group", [(1, 128), (3, 128), (17, 128), (32, 128), (3, 64)], ids=str)
@pytest.mark.slow
def test_the_default_path_for_each_batch(m, group, nan_outputs):
    """M <= 2: the GEMV; more: the tensor cores, or the GEMV two rows at a time for a group they cannot take."""
    x, qweight, scales = _inputs(m, 21, 256, group, seed=m)
    assert_matches(w4a16_matmul(x, qweight, scales, group), x, qweight, scales, group)


@pytest.mark.parametrize("config", [{**GEMV, "BLOCK_N": 128, "BLOCK_KW": 16}, {**MMA, "BLOCK_N": 128}],
                         ids=["gemv", "mma"])  # few programs: the interpreter runs them one by one
def test_every_nibble_of_a_word_multiplies_its_own_k(config):
    """Row r of W holds one nonzero q, at k = r % 128, of value ((r % 128) + 2 * (r // 128)) % 16 - 8:
    every value -8..7 at every nibble position. x row 0 is 2^(k % 16 - 8), row 1 2^(k // 16 - 4),
    so together they name k, and y[b, r] = q * scale * x[b, k] exactly (powers of two times q)."""
    k, rows = 128, 1024
    position = torch.arange(rows) % k
    q = torch.zeros(rows, k, dtype=torch.int8)
    q[torch.arange(rows), position] = ((position + 2 * (torch.arange(rows) // k)) % 16 - 8).to(torch.int8)
    qweight = pack_nibbles((q & 0xF).to(torch.uint8))
    scales = torch.full((rows, 1), 0.5, dtype=torch.bfloat16)
    kk = torch.arange(k, dtype=torch.float32)
    x = torch.stack((torch.exp2(kk % 16 - 8), torch.exp2(kk // 16 - 4))).to(torch.bfloat16)
    y = w4a16_matmul(x, qweight, scales, config=config)
    expected = q.sum(dim=1).float()[None, :] * 0.5 * x.float()[:, position]
    torch.testing.assert_close(y, expected.to(torch.bfloat16), rtol=0, atol=0)


@pytest.mark.parametrize("x_scale", [1e12, 1e-12], ids=["large x", "small x"])
@pytest.mark.parametrize("config", [GEMV, MMA], ids=["gemv", "mma"])
def test_x_far_from_one(x_scale, config):
    """The GEMV's products are x * 2^(77 - 4p) times subnormal nibbles: exact for 6e-17 < |x| < 2.3e15."""
    x, qweight, scales = _inputs(2, 16, 256, 128, x_scale=x_scale)
    assert_matches(w4a16_matmul(x, qweight, scales, config=config), x, qweight, scales, 128)


def test_a_vector_empty_sizes_and_strided_rows():
    x, qweight, scales = _inputs(3, 10, 256, 128)
    y = w4a16_matmul(x[1], qweight, scales)
    assert y.shape == (10,)
    assert_matches(y[None], x[1:2], qweight, scales, 128)
    assert w4a16_matmul(x[:0], qweight, scales).shape == (0, 10)
    assert w4a16_matmul(x, qweight[:0], scales[:0]).shape == (3, 0)
    for config in (GEMV, MMA):  # rows of wider buffers, NaN past K: nothing there may be read
        wide_x = torch.full((3, 300), float("nan"), dtype=torch.bfloat16)
        wide_x[:, :256] = x
        wide_scales = torch.full((10, 5), float("nan"), dtype=torch.bfloat16)
        wide_scales[:, :2] = scales
        y = w4a16_matmul(wide_x[:, :256], qweight, wide_scales[:, :2], config=config)
        assert_matches(y, x, qweight, scales, 128)


@pytest.mark.parametrize("bad, message", [
    (lambda x, q, s: (x.float(), q, s, 128), "x must be bfloat16"),
    (lambda x, q, s: (x, q.to(torch.int8), s, 128), "qweight uint8"),
    (lambda x, q, s: (x, q, s.float(), 128), "scales bfloat16"),
    (lambda x, q, s: (x[:, :128], q, s, 128), "K = 128 but qweight"),
    (lambda x, q, s: (x, q, s, 100), "multiple of 32"),
    (lambda x, q, s: (x, q, s, 96), "not a multiple of the group"),
    (lambda x, q, s: (x, q, s[:, :1], 128), r"scales must be \(N, K // group\)"),
    (lambda x, q, s: (torch.zeros(33, 256, dtype=torch.bfloat16), q, s, 128), "at most 32 rows"),
    (lambda x, q, s: (x[None], q, s, 128), "must be"),
    (lambda x, q, s: (torch.zeros(2, 512, dtype=torch.bfloat16)[:, ::2], q, s, 128), "contiguous rows"),
    (lambda x, q, s: (x, torch.zeros(8, 130, dtype=torch.uint8)[:, 1:129], s, 128), "multiples of 4 bytes"),
])
def test_bad_inputs_are_refused_with_a_message(bad, message):
    x, qweight, scales = _inputs(2, 8, 256, 128)
    with pytest.raises(ValueError, match=message):
        check_w4a16_inputs(*bad(x, qweight, scales))
    with pytest.raises(ValueError, match=message):
        w4a16_matmul(*bad(x, qweight, scales))


def test_split_pruning_and_bytes():
    # N = 4096: 32 tiles of 128 rows, 32 blocks of K: 8 splits of 4 blocks, 256 programs... and
    # ~4 programs an SM is 528: 17 wanted -> 2 blocks a split -> 16 splits, 512 programs
    assert split_k(4096, 4096, 128, 132) == 16
    assert split_k(28672, 4096, 128, 132) == 3  # 224 tiles
    assert split_k(14336, 4096, 64, 132) == 3  # 224 tiles
    assert split_k(4096, 14336, 128, 132) == 16  # 112 blocks: 7 a split
    assert split_k(64, 128, 128, 132) == 1 and split_k(64, 640, 16, 132) == 5  # never an empty split
    for block_b in (1, 2):
        kept = _gemv_configs_for(GEMV_CONFIGS, {}, BLOCK_B=block_b)
        assert kept and all(gemv_lane_work(block_b, c.kwargs["BLOCK_N"], c.kwargs["BLOCK_KW"], c.num_warps)
                            <= GEMV_LANE_WORK_LIMIT for c in kept)
    assert len(_gemv_configs_for(GEMV_CONFIGS, {}, BLOCK_B=1)) == len(GEMV_CONFIGS)
    # Llama-3-8B up projection: 29.36 MB of nibbles, 0.92 MB of scales, x and y
    assert w4a16_min_bytes(1, 14336, 4096) == 14336 * 2048 + 14336 * 32 * 2 + 4096 * 2 + 14336 * 2
    assert w4a16_min_bytes(16, 4096, 4096, group=64) == 4096 * 2048 + 4096 * 64 * 2 + 16 * (4096 + 4096) * 2


# --- the custom op ---------------------------------------------------------------------------

def test_op_passes_opcheck_compiles_and_falls_back_to_eager_on_cpu():
    x, qweight, scales = _inputs(3, 24, 256, 128)
    torch.testing.assert_close(w4a16_op(x, qweight, scales), w4a16_reference(x, qweight, scales), rtol=0, atol=0)
    assert w4a16_op(x[0], qweight, scales).shape == (24,)
    torch.library.opcheck(w4a16_op, (x, qweight, scales, 128))
    torch.library.opcheck(w4a16_op, (x[0], qweight, scales))
    compiled = torch.compile(lambda a, b, c: w4a16_op(a, b, c) * 2, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, qweight, scales), 2 * w4a16_reference(x, qweight, scales))


def test_op_refuses_bad_shapes_with_value_errors():
    x, qweight, scales = _inputs(3, 24, 256, 128)
    with pytest.raises(ValueError, match="K = 128 but qweight"):
        w4a16_op(x[:, :128], qweight, scales)
    with pytest.raises(ValueError, match="not a multiple of the group"):
        w4a16_op(x, qweight, scales, 96)
    with pytest.raises(ValueError, match="at most 32 rows"):
        w4a16_op(torch.zeros(33, 256, dtype=torch.bfloat16), qweight, scales)
    with pytest.raises(ValueError, match="scales must be"):
        w4a16_op(x, qweight, scales[:, :1])


# --- the problem file ------------------------------------------------------------------------

class OurW4A16(torch.nn.Module):
    def forward(self, x, qweight, scales):
        return w4a16_matmul(x, qweight, scales, 128)


@pytest.mark.slow
def test_problem_file_passes_gate_1_with_our_kernel(cpu, cpu_ceilings, fast_timing):
    from kforge.harness.evaluate import evaluate
    from kforge.harness.problem import load_problem
    from kforge.ladder import source_candidate

    problem = load_problem(PROBLEM, "tiny")
    x, qweight, scales = problem.make_inputs(0, torch.device("cpu"))
    assert (x.shape, qweight.shape, scales.shape) == ((1, 256), (40, 128), (40, 2))
    assert problem.count_bytes([x, qweight, scales], None, None) == w4a16_min_bytes(1, 40, 256)
    assert problem.count_flops([x, qweight, scales]) == 2 * 40 * 256
    record = evaluate(problem, source_candidate("ours", OurW4A16, [Path(w4a16.__file__)]), device=cpu,
                      ceilings=cpu_ceilings, timing=fast_timing)
    assert record.gate1["passed"], record.reason


# --- machine code for the H100, compiled on any machine --------------------------------------

_COMPILE_SM90 = textwrap.dedent(r"""
    import json, os, re, sys
    os.environ["TRITON_INTERPRET"] = "0"
    from pathlib import Path
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from kforge.kernels.quant import w4a16
    from kforge.runtime.cuda import Cubin, loop_opcodes, resources, sass

    def loop_ops(code):  # base opcodes inside the K loops
        return [op.split(".")[0] for op in loop_opcodes(code)]

    INTS = ("batch", "n_out", "k_words", "stride_xb", "stride_wn", "stride_sn", "stride_yb", "stride_os", "stride_ob")
    ALIGNED = {"x_ptr", "w_ptr", "s_ptr", "y_ptr", "out_ptr", "n_out", "k_words", "stride_xb", "stride_wn",
               "stride_sn", "stride_yb", "stride_ob"}

    def build(fn, pointers, constants, warps, stages, disassemble):
        types = {**{name: "i32" for name in INTS}, **pointers}
        signature = {name: types.get(name, "constexpr") for name in fn.arg_names}
        attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in ALIGNED if name in fn.arg_names}
        kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs),
                                target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
        cubin = Cubin(Path(fn.__name__), "sm_90", (), "", kernel.asm["cubin"], "")
        (used,) = resources(cubin).values()
        found = dict(registers=used.registers, local=used.local_bytes + used.stack_bytes, shared=kernel.metadata.shared)
        if disassemble:
            code = sass(cubin)
            count = lambda pattern: len(re.findall(pattern, code))
            loop = loop_ops(code)
            found.update(ldg128=count(r"\bLDG\.E\.128\b"), hmma=count(r"\bHMMA\b"), hgmma=count(r"\bHGMMA\b"),
                         ldgsts=count(r"\bLDGSTS\b"), i2f=count(r"\bI2F\b"), loop=len(loop),
                         loop_shared=sum(op in ("LDS", "STS", "BAR") for op in loop))
        return found

    every = sys.argv[1] == "every"
    gemv_pointers = dict(x_ptr="*bf16", w_ptr="*i32", s_ptr="*bf16", y_ptr="*bf16")
    mma_pointers = dict(x_ptr="*bf16", w_ptr="*i32", s_ptr="*bf16", out_ptr="*fp32")
    found = {}
    gemv_tiles = [(c, b) for c in w4a16.GEMV_CONFIGS for b in (1, 2)
                  if c in w4a16._gemv_configs_for([c], {}, BLOCK_B=b)]
    for config, block_b in gemv_tiles if every else gemv_tiles[:1]:
        found[f"gemv {config.kwargs} warps={config.num_warps} B={block_b}"] = build(
            w4a16.w4a16_gemv_kernel, gemv_pointers, dict(config.kwargs, BLOCK_B=block_b, GROUP_WORDS=16),
            config.num_warps, 1, not every)
    mma_tiles = [(c, b) for c in w4a16.MMA_CONFIGS for b in (8, 32)]
    for config, block_b in mma_tiles if every else mma_tiles[:2]:
        constants = dict(BLOCK_N=config["BLOCK_N"], BLOCK_B=block_b, GROUP_WORDS=16, DOT_DTYPE=tl.bfloat16,
                         PRECISION="tf32")
        found[f"mma {config} B={block_b}"] = build(w4a16.w4a16_mma_kernel, mma_pointers, constants,
                                                   config["num_warps"], config["num_stages"], not every)
    print(json.dumps(found))
""")


def _compile_sm90(which: str) -> dict:
    done = subprocess.run([sys.executable, "-c", _COMPILE_SM90, which], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@codegen_of_triton_3_6
def test_default_tiles_compile_for_sm90_as_designed():
    found = _compile_sm90("defaults")
    for label, kernel in found.items():
        assert kernel["local"] == 0 and kernel["shared"] <= 227 * 1024, (label, kernel)
    gemv = next(v for k, v in found.items() if k.startswith("gemv"))
    # 16-byte loads of the words and of x, no tensor cores, no int -> float conversion (the nibbles
    # are read as floats), at most 128 registers: 4 programs (16 warps) an SM
    assert gemv["ldg128"] >= 8 and gemv["hmma"] == gemv["hgmma"] == gemv["i2f"] == 0, gemv
    assert gemv["registers"] <= 128 and gemv["loop_shared"] == 0, gemv
    # ~3.1 instructions a weight (8 rows x 32 k a lane a step), ~60% of what an SM can issue at 3 TB/s
    assert gemv["loop"] <= 3.3 * 8 * 32, gemv
    mma_sync, wgmma = (v for k, v in found.items() if k.startswith("mma"))
    # the words stream through cp.async (LDGSTS) into shared memory and on to the tensor cores
    assert mma_sync["hmma"] > 0 and mma_sync["ldgsts"] > 0, mma_sync
    assert wgmma["hgmma"] > 0 and wgmma["ldgsts"] > 0, wgmma
    # 128 weights a lane a step: ~3.9 instructions each at batch 8, ~5.2 at 32
    assert mma_sync["loop"] <= 4.2 * 128 and wgmma["loop"] <= 5.5 * 128, (mma_sync, wgmma)


@pytest.mark.slow
def test_every_tile_compiles_for_sm90_in_shared_memory_without_spills():
    found = _compile_sm90("every")
    assert len(found) == len(_gemv_configs_for(GEMV_CONFIGS, {}, BLOCK_B=1)) + len(
        _gemv_configs_for(GEMV_CONFIGS, {}, BLOCK_B=2)) + 2 * len(MMA_CONFIGS)
    for label, kernel in found.items():
        assert kernel["local"] == 0 and kernel["shared"] <= 227 * 1024, (label, kernel)


# --- on the GPU ------------------------------------------------------------------------------

LLAMA3_8B = [(4096, 4096), (6144, 4096), (14336, 4096), (28672, 4096), (4096, 14336)]  # (N, K)


def test_the_one_token_cuda_kernel_compiles_for_sm90_as_designed():
    """w4a16_gemv.cu's loop: W's 16 bytes a row through loads that skip L1, its scales beside,
    x's 64 bytes through cached loads; one FFMA a weight (32 a row), no int -> float
    conversion (the nibbles are read as fp32 bit patterns), no spills; under 3.6 instructions a
    weight (an SM can issue ~4.9 a weight at 3 TB/s)."""
    from collections import Counter

    from kforge.runtime.cuda import compile_cuda, loop_opcodes, resources, sass

    rows, warps = w4a16.cuda_variant(14336)
    cubin = compile_cuda(w4a16.CUDA_SOURCE, arch="sm_90a", defines={"ROWS": rows, "WARPS": warps})
    used = resources(cubin)["w4a16_gemv"]
    # at most 128 registers: 16 warps an SM, each with two steps of 4 rows in flight (the double buffer)
    assert (used.spill_stores, used.spill_loads, used.stack_bytes) == (0, 0, 0) and used.registers <= 128, used
    loop = Counter(loop_opcodes(sass(cubin)))
    assert loop["LDG.E.NA.128.CONSTANT"] == rows and loop["LDG.E.NA.U16.CONSTANT"] == rows, loop
    assert loop["LDG.E.128.CONSTANT"] == 4, loop
    assert loop["FFMA"] >= 33 * rows, loop  # 32 products and the scale a row
    assert not any(op.startswith(("I2F", "F2I")) for op in loop), loop
    assert sum(loop.values()) <= 3.6 * 32 * rows, f"{sum(loop.values()) / (32 * rows):.2f} instructions a weight"


def test_the_residual_build_adds_in_the_store_and_keeps_the_loop():
    """RESIDUAL 1: a loop of the same length and work (ptxas schedules it a little differently and
    picks other integer adds for the addressing), and each stored row one 16-bit load, one add
    and one more rounding."""
    from collections import Counter

    from kforge.runtime.cuda import compile_cuda, loop_opcodes, resources, sass

    rows, warps = w4a16.cuda_variant(4096)
    plain, fused = (compile_cuda(w4a16.CUDA_SOURCE, arch="sm_90a", defines={"ROWS": rows, "WARPS": warps, **extra})
                    for extra in ({}, {"RESIDUAL": 1}))
    fused_loop, plain_loop = loop_opcodes(sass(fused)), loop_opcodes(sass(plain))
    assert len(fused_loop) == len(plain_loop)
    work = ("LDG", "FFMA", "LOP3", "FADD", "FMUL", "SHFL")
    assert Counter(op for op in fused_loop if op.startswith(work)) == Counter(op for op in plain_loop
                                                                              if op.startswith(work))
    used = resources(fused)["w4a16_gemv"]
    assert (used.spill_stores, used.spill_loads, used.stack_bytes) == (0, 0, 0), used

    def ops(cubin):
        return Counter(line.split("*/", 1)[1].split()[0] for line in sass(cubin).splitlines()
                       if line.strip().startswith("/*") and "*/" in line and line.split("*/", 1)[1].split())

    more = ops(fused) - ops(plain)
    assert more["LDG.E.U16.CONSTANT"] == 1 and more["FADD"] == 1 and more["F2F.BF16.F32"] == 1, more


@pytest.mark.parametrize("n", [4096, 28672])
def test_the_one_token_mma_builds_compile_for_sm90_as_designed(n):
    """w4a16_mma.cu as one token takes it (`mma_variant(n, 1)`): DEPTH chunks a warp a trip of the
    loop (8 k16 steps of MT mma.sync each), no spills; its RESIDUAL build does the same work in the
    loop and, per stored element, one 16-bit load, one add and one more rounding (a lane stores
    four: two rows x two tokens of its fragment, MT m-tiles)."""
    from collections import Counter

    from kforge.runtime.cuda import compile_cuda, resources, sass, sass_loops

    m_tiles, k_warps, x_ahead, depth = w4a16.mma_variant(n, 1)
    defines = {"MT": m_tiles, "NT": 1, "KW": k_warps, "XPF": int(x_ahead), "DEPTH": depth}
    plain, fused = (compile_cuda(w4a16.MMA_SOURCE, arch="sm_90a", defines={**defines, **extra})
                    for extra in ({}, {"RESIDUAL": 1}))
    for cubin in (plain, fused):
        used = resources(cubin)["w4a16_mma"]
        assert (used.spill_stores, used.spill_loads, used.stack_bytes, used.local_bytes) == (0, 0, 0, 0), used
    plain_loop, fused_loop = (Counter(max(sass_loops(sass(c)), key=len)) for c in (plain, fused))
    assert plain_loop["HMMA.16816.F32.BF16"] == depth * 8 * m_tiles, plain_loop
    assert plain_loop["LDG.E.NA.128.CONSTANT"] == depth * 2 * m_tiles, plain_loop
    assert fused_loop == plain_loop

    def count(op, cubin):
        return sum(f" {op} " in line for line in sass(cubin).splitlines())

    for op in ("LDG.E.U16.CONSTANT", "FADD", "F2F.BF16.F32"):
        assert count(op, fused) == count(op, plain) + 4 * m_tiles, op


def test_one_token_kernel_by_width():
    """The H200's choice of one-token kernel at the Llama-3-8B widths (`one_token_kernel`)."""
    chosen = {(n, k): w4a16.one_token_kernel(n, k) for n, k in LLAMA3_8B}
    assert chosen == {(4096, 4096): "mma", (6144, 4096): "gemv", (14336, 4096): "bulk", (28672, 4096): "mma",
                      (4096, 14336): "mma"}
    assert w4a16.one_token_kernel(14336, 8192) == "gemv"  # the bulk-fed kernel takes K up to 4096
    assert w4a16.mma_variant(28672, 1) == (2, 4, True, 2) and w4a16.mma_variant(4096, 1) == (1, 8, True, 3)


def test_the_residual_op_gives_the_pairs_bits_and_the_model_takes_it(monkeypatch):
    from kforge import ops
    from kforge.models.llama import model
    from kforge.models.llama.quantize import Int4Weight

    x, qweight, scales = _inputs(3, 96, 256, 128)
    residual = torch.randn(3, 96).bfloat16()
    pair = residual + w4a16_op(x, qweight, scales, 128)
    assert torch.equal(ops.w4a16_matmul_residual(x, qweight, scales, residual, 128), pair)
    assert torch.equal(ops.w4a16_matmul_residual(x[0], qweight, scales, residual[0], 128), pair[0])
    weight = Int4Weight(qweight, scales, 128)
    assert torch.equal(model.linear_residual(x, weight, residual), residual + model.linear(x, weight))
    with pytest.raises(ValueError, match="residual must be a torch.bfloat16 tensor of y's shape"):
        ops.w4a16_matmul_residual(x, qweight, scales, residual[:, :95], 128)
    torch.library.opcheck(torch.ops.kforge.w4a16_matmul_residual.default, (x, qweight, scales, residual, 128),
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("rows, per_weight", [(2, 2.9), (4, 2.7)])
@pytest.mark.slow
def test_the_bulk_fed_kernel_compiles_for_sm90_as_designed(rows, per_weight):
    """w4a16_gemv_bulk.cu: W and its scales arrive by bulk copies (UBLKCP) and the consumers'
    inner loop reads shared memory only (no global loads): per 16-byte unit, x's 32 prescaled
    values (8 LDS.128), its offset, and each row's 16 bytes and scale; one FFMA a weight, no
    int -> float conversion, no spills; under 2.9 instructions a weight at 2 rows a warp (the
    default), 2.7 at 4 (w4a16_gemv.cu: ~3.5)."""
    from collections import Counter

    from kforge.runtime.cuda import compile_cuda, resources, sass, sass_loops

    cubin = compile_cuda(w4a16.BULK_SOURCE, arch="sm_90a", defines={"ROWS": rows, "CONSUMERS": 4, "STAGES": 4})
    used = resources(cubin)["w4a16_gemv_bulk"]
    assert (used.spill_stores, used.spill_loads, used.stack_bytes) == (0, 0, 0), used
    code = sass(cubin)
    assert "UBLKCP.S.G" in code, "the bulk copies"
    inner = min((loop for loop in sass_loops(code) if "LDS.128" in loop), key=len)  # the consumers' unit loop
    ops = Counter(inner)
    assert ops["LDS.128"] == 8 + rows and ops["LDS.U16"] == rows and ops["LDS"] == 1, ops
    assert not any(op.startswith(("LDG", "LD.", "I2F", "F2I")) for op in ops), ops
    assert ops["FFMA"] >= 33 * rows, ops  # 32 products and the scale a row
    assert len(inner) <= per_weight * 32 * rows, f"{len(inner) / (32 * rows):.2f} instructions a weight"


@pytest.mark.parametrize("m_tiles, n_tiles, per_weight", [(2, 2, 2.7), (2, 4, 3.4), (4, 1, 2.3)])
@pytest.mark.slow
def test_the_few_token_mma_kernel_compiles_for_sm90_as_designed(m_tiles, n_tiles, per_weight):
    """w4a16_mma.cu's loop (two chunks of 128 k, taking turns): per chunk and m-tile, 8 k16 steps of
    NT bf16 mma.sync; the weights decoded without a conversion (one LOP3 and one bf16x2 FMA a pair,
    no I2F, no per-use rebuild of the mask constant); W's 16-byte loads skip L1, x's stay in it;
    no spills; under `per_weight` instructions a weight (an SM can issue ~4.9 a weight at 3 TB/s)."""
    from collections import Counter

    from kforge.runtime.cuda import compile_cuda, resources, sass, sass_loops

    cubin = compile_cuda(w4a16.MMA_SOURCE, arch="sm_90a", defines={"MT": m_tiles, "NT": n_tiles, "KW": 4})
    used = resources(cubin)["w4a16_mma"]
    assert (used.spill_stores, used.spill_loads, used.stack_bytes) == (0, 0, 0), used
    assert used.shared_bytes == w4a16.mma_shared_bytes(m_tiles, n_tiles, 4) + 1024, used  # + the 1 KB sm_90 keeps
    loop = max(sass_loops(sass(cubin)), key=len)
    ops = Counter(loop)
    chunks = 2
    assert ops["HMMA.16816.F32.BF16"] == chunks * 8 * m_tiles * n_tiles, ops
    assert ops["HFMA2.BF16_V2"] == chunks * m_tiles * 32, ops  # 2 rows x 4 words x 4 pairs, a chunk and m-tile
    assert ops["LOP3.LUT"] <= ops["HFMA2.BF16_V2"] + 8, ops
    assert ops["LDG.E.NA.128.CONSTANT"] == chunks * 2 * m_tiles and ops["LDG.E.128.CONSTANT"] == chunks * 4 * n_tiles
    assert ops["IMAD.MOV.U32"] <= 16, ops
    assert not any(op.startswith(("I2F", "F2I", "LDL", "STL")) for op in ops), ops
    weights = chunks * m_tiles * 2 * 32  # a lane's
    assert len(loop) <= per_weight * weights, f"{len(loop) / weights:.2f} instructions a weight"


def _count_cuda_launches(monkeypatch):
    calls = []
    real = w4a16.launch_cuda_gemv
    monkeypatch.setattr(w4a16, "launch_cuda_gemv", lambda *args, **kw: calls.append(args) or real(*args, **kw))
    return calls


@pytest.mark.gpu
def test_the_one_token_cuda_kernel_in_every_variant_group_and_odd_shape(monkeypatch):
    """N not a multiple of a block's rows (777, 9), K of one 32-weight load (32) to a step and a
    half (1536), groups of 32 to 256 (a load's scale changes every 1 to 8 loads), x far from 1,
    a strided W (padded rows); two rows take w4a16_mma.cu."""
    launch = w4a16.launch_cuda_gemv
    calls = _count_cuda_launches(monkeypatch)
    # (N, K, group, x's scale, whether w4a16_matmul takes w4a16_gemv.cu: the rest fit w4a16_mma.cu)
    cases = [(777, 1536, 128, 1.0, False), (9, 32, 32, 1.0, True), (4096, 4096, 64, 1e12, True),
             (300, 2048, 256, 1e-12, False), (1000, 4096, 128, 1.0, False), (6144, 1024, 128, 1.0, True)]
    for n, k, group, x_scale, gemv_taken in cases:
        before = len(calls)
        x, qweight, scales = _inputs(1, n, k, group, "cuda", x_scale=x_scale)
        assert_matches(w4a16_matmul(x, qweight, scales, group), x, qweight, scales, group)
        assert len(calls) - before == int(gemv_taken), (n, k, group)
        for rows, warps in ((1, 4), (2, 8), (4, 4), (8, 8)):
            y = torch.full((1, n), float("nan"), dtype=torch.bfloat16, device="cuda")
            launch(x, qweight, scales, group, y, rows=rows, warps=warps)
            assert_matches(y, x, qweight, scales, group)
    x, qweight, scales = _inputs(1, 6000, 1024, 128, "cuda")
    padded = torch.zeros(6000, 1024 // 2 + 16, dtype=torch.uint8, device="cuda")
    padded[:, :512] = qweight
    before = len(calls)
    assert_matches(w4a16_matmul(x[0], padded[:, :512], scales), x[0], qweight, scales, 128)
    assert len(calls) == before + 1
    mma_calls = []
    real_mma = w4a16.launch_cuda_mma
    monkeypatch.setattr(w4a16, "launch_cuda_mma", lambda *args, **kw: mma_calls.append(args) or real_mma(*args, **kw))
    x2, qweight, scales = _inputs(2, 300, 1024, 128, "cuda")
    assert_matches(w4a16_matmul(x2, qweight, scales), x2, qweight, scales, 128)
    assert len(calls) == before + 1 and len(mma_calls) == 1, "two rows take w4a16_mma.cu"


@pytest.mark.gpu
@pytest.mark.parametrize("rows, consumers, stages", [(4, 4, 4), (2, 8, 2), (8, 4, 2), (2, 4, 8)])
def test_the_bulk_fed_kernel_computes_the_one_token_kernels_bits(rows, consumers, stages):
    """w4a16_gemv_bulk.cu against w4a16_gemv.cu, bit for bit (the same sums in the same order),
    and against float64: a tile with fewer rows than the block's (N = 5, 1000, 4100, 12289), one
    chunk (K = 1024, 2048, 4096), a short last chunk (14336 = 3.5 chunks), Llama-3-8B widths, x
    far from 1;
    every output NaN-poisoned first. Shapes it does not take (K % 1024, group 64, a padded W) are
    refused by bulk_kernel_fits."""
    cases = [(5, 1024, 1.0), (1000, 4096, 1e12), (4100, 14336, 1.0), (28672, 4096, 1.0), (4096, 14336, 1e-12),
             (12289, 2048, 1.0)]
    for n, k, x_scale in cases:
        x, qweight, scales = _inputs(1, n, k, 128, "cuda", seed=n, x_scale=x_scale)
        assert w4a16.bulk_kernel_fits(x, qweight, scales, 128, rows=rows, consumers=consumers, stages=stages)
        want = torch.full((1, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        w4a16.launch_cuda_gemv(x, qweight, scales, 128, want)
        y = torch.full((1, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        w4a16.launch_bulk_gemv(x, qweight, scales, y, rows=rows, consumers=consumers, stages=stages)
        assert torch.equal(y, want), (n, k)
        assert_matches(y, x, qweight, scales, 128)
    x, qweight, scales = _inputs(1, 64, 1536, 128, "cuda")
    assert not w4a16.bulk_kernel_fits(x, qweight, scales, 128)
    x, qweight, scales = _inputs(1, 64, 55 * 1024, 128, "cuda")
    assert not w4a16.bulk_kernel_fits(x, qweight, scales, 128), "x's prescaled copy and a ring exceed shared memory"
    x, qweight, scales = _inputs(1, 64, 1024, 64, "cuda")
    assert not w4a16.bulk_kernel_fits(x, qweight, scales, 64)
    x, qweight, scales = _inputs(1, 64, 1024, 128, "cuda")
    padded = torch.zeros(64, 1024 // 2 + 16, dtype=torch.uint8, device="cuda")[:, :512]
    assert not w4a16.bulk_kernel_fits(x, padded, scales, 128)


@pytest.mark.gpu
def test_one_token_takes_the_kernel_one_token_kernel_names(monkeypatch, nan_outputs):
    """w4a16_matmul at batch 1 at the Llama-3-8B widths: each through the kernel `one_token_kernel`
    names (w4a16_mma.cu at 4096 and 28672 rows, the bulk-fed kernel at 14336 x 4096, w4a16_gemv.cu
    at 6144), and a W whose group the bulk kernel does not take through w4a16_gemv.cu; the numbers
    right either way."""
    calls = {name: [] for name in ("bulk", "mma", "gemv")}
    for name, attribute in (("bulk", "launch_bulk_gemv"), ("mma", "launch_cuda_mma"), ("gemv", "launch_cuda_gemv")):
        real = getattr(w4a16, attribute)
        monkeypatch.setattr(w4a16, attribute, lambda *args, real=real, seen=calls[name], **kw:
                            seen.append(args) or real(*args, **kw))
    for (n, k, group), taken in {(14336, 4096, 128): "bulk", (28672, 4096, 128): "mma", (4096, 4096, 128): "mma",
                                 (4096, 14336, 128): "mma", (6144, 4096, 128): "gemv",
                                 (14336, 4096, 64): "gemv"}.items():
        before = {name: len(seen) for name, seen in calls.items()}
        x, qweight, scales = _inputs(1, n, k, group, "cuda", seed=n + k)
        assert_matches(w4a16_matmul(x, qweight, scales, group), x, qweight, scales, group)
        assert {name: len(seen) - before[name] for name, seen in calls.items()} == {
            name: int(name == taken) for name in calls}, (n, k, group)


@pytest.mark.gpu
def test_the_residual_build_gives_the_pairs_bits(nan_outputs):
    """One token: RESIDUAL 1 against the plain build and torch's bf16 add, bit for bit, at odd N,
    both groups, on w4a16_gemv.cu and w4a16_mma.cu (each adds in its store) and on the bulk-fed path
    (which adds after); several tokens add after."""
    from kforge import ops

    for m, n, k, group in ((1, 300, 1024, 128), (1, 4096, 14336, 128), (1, 14336, 4096, 128), (1, 777, 512, 64),
                           (1, 28672, 4096, 128), (1, 6144, 4096, 128), (3, 300, 1024, 128)):
        x, qweight, scales = _inputs(m, n, k, group, "cuda", seed=n)
        residual = torch.randn(m, n, device="cuda").bfloat16()
        pair = residual + w4a16_op(x, qweight, scales, group)
        assert torch.equal(ops.w4a16_matmul_residual(x, qweight, scales, residual, group), pair), (m, n, k, group)


@pytest.mark.gpu
def test_the_few_token_mma_kernel_in_every_variant_batch_group_and_odd_shape(nan_outputs):
    """w4a16_mma.cu against float64 for 1 to 32 tokens (one to four n-tiles, the last partly past
    the batch), every (MT, KW, XPF) variant that fits shared memory (one token: two and three chunks
    held a warp), N not a multiple of a block's rows
    (9, 777, 4100), K of one chunk (fewer chunks than warps) to 112, groups of 1, 2 and 4 chunks,
    x far from 1, x with padded rows and W with padded rows; each output NaN-poisoned first."""
    cases = [(777, 1152, 128, 1.0), (9, 128, 128, 1.0), (4100, 4096, 256, 1e12), (300, 14336, 512, 1e-12),
             (1000, 2048, 128, 1.0)]
    for batch in (1, 2, 3, 8, 9, 16, 17, 32):
        for n, k, group, x_scale in cases:
            x, qweight, scales = _inputs(batch, n, k, group, "cuda", seed=batch + n, x_scale=x_scale)
            assert w4a16.cuda_mma_fits(x, qweight, group)
            for m_tiles, k_warps, x_ahead in itertools.product((1, 2, 3, 4), (1, 4, 8), (False, True)):
                if w4a16.mma_shared_bytes(m_tiles, triton.cdiv(batch, 8), k_warps) > w4a16.MMA_SHARED_LIMIT:
                    continue
                for depth in (2, 3) if batch == 1 else (2,):
                    y = torch.full((batch, n), float("nan"), dtype=torch.bfloat16, device="cuda")
                    w4a16.launch_cuda_mma(x, qweight, scales, group, y, m_tiles=m_tiles, k_warps=k_warps,
                                          x_ahead=x_ahead, depth=depth)
                    assert_matches(y, x, qweight, scales, group)
    x, qweight, scales = _inputs(5, 300, 1024, 128, "cuda")
    wide_x = torch.randn(5, 1024 + 64, device="cuda").bfloat16()
    wide_x[:, :1024] = x
    padded = torch.zeros(300, 1024 // 2 + 16, dtype=torch.uint8, device="cuda")
    padded[:, :512] = qweight
    assert w4a16.cuda_mma_fits(wide_x[:, :1024], padded[:, :512], 128)
    assert_matches(w4a16_matmul(wide_x[:, :1024], padded[:, :512], scales), x, qweight, scales, 128)
    with pytest.raises(ValueError, match="shared memory"):
        w4a16.launch_cuda_mma(*_inputs(32, 64, 1024, 128, "cuda"), 128, torch.empty(32, 64, device="cuda").bfloat16(),
                              m_tiles=4, k_warps=8)


@pytest.mark.gpu
def test_a_few_tokens_take_the_mma_kernel_where_it_fits(monkeypatch, nan_outputs):
    """w4a16_matmul for 2 to 32 tokens: w4a16_mma.cu where the group is 128 k times a power of two,
    the Triton kernels otherwise (group 64; 384, three chunks); one token where `one_token_kernel`
    names it (1000 rows)."""
    calls = []
    real = w4a16.launch_cuda_mma
    monkeypatch.setattr(w4a16, "launch_cuda_mma", lambda *args, **kw: calls.append(args) or real(*args, **kw))
    for (batch, group), taken in {(3, 128): True, (32, 256): True, (16, 64): False, (16, 384): False,
                                  (1, 128): True, (2, 128): True}.items():
        before = len(calls)
        x, qweight, scales = _inputs(batch, 1000, 1536, group, "cuda", seed=batch)
        assert_matches(w4a16_matmul(x, qweight, scales, group), x, qweight, scales, group)
        assert len(calls) - before == int(taken), (batch, group)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3, 16, 32])
@pytest.mark.parametrize("n, k", LLAMA3_8B, ids=str)
def test_on_the_gpu_at_llama_widths(n, k, m):
    x, qweight, scales = _inputs(m, n, k, 128, "cuda")
    assert_matches(w4a16_matmul(x, qweight, scales), x, qweight, scales, 128)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2])
def test_every_gemv_tile_on_the_gpu(m):
    for n, k, group in ((777, 1152, 128), (1536, 4096, 128), (300, 2048, 64), (64, 14336, 32)):
        x, qweight, scales = _inputs(m, n, k, group, "cuda")
        for config in _gemv_configs_for(GEMV_CONFIGS, {}, BLOCK_B=triton.next_power_of_2(m)):
            tile = dict(config.kwargs, path="gemv", num_warps=config.num_warps)
            assert_matches(w4a16_matmul(x, qweight, scales, group, config=tile), x, qweight, scales, group)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [3, 8, 17, 32])
def test_every_tensor_core_tile_and_split_on_the_gpu(m):
    for n, k, group in ((777, 1152, 128), (4096, 4096, 128), (300, 2048, 256)):
        x, qweight, scales = _inputs(m, n, k, group, "cuda")
        for config in MMA_CONFIGS:
            for split in (None, 1, 3):
                tile = dict(config, path="mma", SPLIT_K=split)
                assert_matches(w4a16_matmul(x, qweight, scales, group, config=tile), x, qweight, scales, group)


@pytest.mark.gpu
def test_op_on_the_gpu_runs_our_kernels_and_compiles_with_inductor():
    from kforge.ops.w4a16 import ours_can_run

    for m in (1, 16):
        x, qweight, scales = _inputs(m, 6144, 4096, 128, "cuda")
        assert ours_can_run(x, qweight, scales, 128)
        compiled = torch.compile(lambda a, b, c: w4a16_op(a, b, c), fullgraph=True)
        assert_matches(compiled(x, qweight, scales), x, qweight, scales, 128)

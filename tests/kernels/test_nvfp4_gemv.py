"""Batched NVFP4 GEMV: the kernel under the interpreter against float64 of the dequantized
operands (M tails, K tails down to one 16-value block, several batches, zero blocks), every
E2M1 code at every nibble position by hand, outputs poisoned with NaN, bad inputs refused, the
byte count; kforge.ops.nvfp4_batched_gemv as a custom op (opcheck, torch.compile, the
fallback); the problem file through gate 1; the sm_90 machine code of every tile and of the
CUDA kernel (nvfp4_gemv.cu). On a GPU: the three shapes of the problem set with every tile
and every CUDA variant, odd shapes, strided batches and which kernel runs, the op under
inductor."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import codegen_of_triton_3_6
from kforge.kernels.quant import nvfp4_gemv
from kforge.kernels.quant.formats import dequantize_nvfp4, e2m1_decode, pack_nibbles, quantize_nvfp4
from kforge.kernels.quant.nvfp4_gemv import (CONFIGS, check_nvfp4_gemv_inputs, nvfp4_batched_gemv,
                                             nvfp4_gemv_min_bytes, nvfp4_gemv_reference)
from kforge.ops.nvfp4 import nvfp4_batched_gemv as nvfp4_op

PROBLEM = Path(nvfp4_gemv.__file__).parents[2] / "problems" / "level1" / "nvfp4_batched_gemv.py"
PROBLEM_SET = [(7168, 16384, 1), (4096, 7168, 8), (7168, 2048, 4)]  # (M, K, L)
SMALL = {"BLOCK_M": 4, "BLOCK_KW": 16, "num_warps": 1}  # 128 k a step


def _inputs(m, k, batches, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    a = quantize_nvfp4(torch.randn(batches, m, k, generator=g).to(device))
    b = quantize_nvfp4((torch.randn(batches, 1, k, generator=g) / k**0.5).to(device))
    return (*a, *b)


def assert_matches(c, a, a_scales, a_gs, b, b_scales, b_gs):
    """c is dequant(a) @ dequant(b)^T rounded once to fp16 (half an ulp: 2^-11 relative), give or
    take fp32 sums in any order (2^-20 of sum |terms|), in float64."""
    av, bv = dequantize_nvfp4(a, a_scales, a_gs).double(), dequantize_nvfp4(b, b_scales, b_gs).double()
    exact, magnitude = av @ bv.transpose(1, 2), av.abs() @ bv.abs().transpose(1, 2)
    assert c.dtype == torch.float16 and c.shape == exact.shape
    assert torch.isfinite(c).all(), "an output was not written (NaN poison) or overflowed"
    excess = (c.double() - exact).abs() - (2**-11 * exact.abs() + 2**-20 * magnitude)
    assert excess.max().item() <= 0, f"off by more than a rounding: {excess.max().item():.3g}"


# --- the kernel under the interpreter --------------------------------------------------------

# (M, K, L, config): M tails (13, 21 rows in tiles of 4 and 8); K = 48 is 6 words (a chunk half
# past K), 160 is 1.25 steps of 128, 16 a single block; 1024 is 8 unmasked steps
CASES = [(13, 256, 1, SMALL), (9, 48, 2, SMALL), (21, 160, 3, {**SMALL, "BLOCK_M": 8}), (3, 16, 2, SMALL),
         (5, 1024, 2, {"BLOCK_M": 8, "BLOCK_KW": 64, "num_warps": 2})]


@pytest.mark.parametrize("m, k, batches, config", CASES, ids=str)
@pytest.mark.slow
def test_kernel_matches_float64_under_the_interpreter(m, k, batches, config, nan_outputs):
    inputs = _inputs(m, k, batches)
    assert_matches(nvfp4_batched_gemv(*inputs, config=config), *inputs)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("m, k, batches, config", CASES[1:3], ids=str)
@pytest.mark.slow
def test_nothing_past_k_is_read(m, k, batches, config, device):
    """Operands as rows of wider buffers padded with code 7 (6.0) and scale 0x7F (NaN on the GPU;
    the interpreter decodes it as 480): a read past K that is not masked to zero shows in c."""
    a, sa, ga, b, sb, gb = _inputs(m, k, batches, device)

    def padded(t, fill):
        wide = torch.full((*t.shape[:-1], t.shape[-1] + 8), fill, dtype=torch.uint8, device=device)
        wide[..., :t.shape[-1]] = t.view(torch.uint8)
        return wide[..., :t.shape[-1]].view(t.dtype)

    inputs = (padded(a, 0x77), padded(sa, 0x7F), ga, padded(b, 0x77), padded(sb, 0x7F), gb)
    assert inputs[1].stride(1) == k // 16 + 8
    assert_matches(nvfp4_batched_gemv(*inputs, config=config), a, sa, ga, b, sb, gb)


def test_the_default_tile_under_the_interpreter(nan_outputs):
    inputs = _inputs(6, 96, 2, seed=1)
    assert_matches(nvfp4_batched_gemv(*inputs), *inputs)


@pytest.mark.slow
def test_every_code_at_every_nibble_position():
    """Row r of a holds one nonzero code, at k = r % 128: (r + r // 128) % 16, so every code (the
    two zeros included) sits at every nibble position. Batch l's b has code (k + 5 l) % 16 at k
    and block scale 2^(block - 4): (batch, k % 16, k // 16) names k. Every product is exact."""
    k, rows, batches = 128, 1024, 2
    position = torch.arange(rows) % k
    codes = torch.zeros(batches, rows, k, dtype=torch.uint8)
    codes[:, torch.arange(rows), position] = ((torch.arange(rows) + torch.arange(rows) // k) % 16).to(torch.uint8)
    b_codes = ((torch.arange(k)[None, :] + 5 * torch.arange(batches)[:, None]) % 16).to(torch.uint8)[:, None, :]
    a_scales = torch.ones(batches, rows, k // 16).to(torch.float8_e4m3fn)
    b_scales = torch.exp2(torch.arange(k // 16) - 4.0).expand(batches, 1, k // 16).to(torch.float8_e4m3fn)
    one = torch.tensor(1.0)
    c = nvfp4_batched_gemv(pack_nibbles(codes), a_scales, one, pack_nibbles(b_codes), b_scales, one,
                           config={"BLOCK_M": 128, "BLOCK_KW": 16, "num_warps": 1})
    a_value = e2m1_decode(codes.sum(dim=2).to(torch.uint8))  # the one nonzero code of each row
    b_value = e2m1_decode(b_codes[:, 0, :])[:, position] * torch.exp2(position // 16 - 4.0)
    torch.testing.assert_close(c[..., 0], (a_value * b_value).half(), rtol=0, atol=0)


def test_zero_blocks_and_zero_scales(nan_outputs):
    x = torch.randn(2, 7, 64)
    x[0, :, 16:32] = 0.0  # a zero block: scale 0, codes 0
    x[1, 3] = 0.0  # a zero row
    a = quantize_nvfp4(x)
    b = quantize_nvfp4(torch.randn(2, 1, 64))
    assert (a[1][0, :, 1].float() == 0).all()
    c = nvfp4_batched_gemv(*a, *b, config=SMALL)
    assert_matches(c, *a, *b)
    assert c[1, 3, 0] == 0


def _bad_cases():
    a, sa, ga, b, sb, gb = _inputs(4, 64, 2)
    return [
        ((a.view(torch.int8), sa, ga, b, sb, gb), "a must be a 3-D torch.uint8"),
        ((a, sa.float(), ga, b, sb, gb), "a_scales must be a 3-D torch.float8_e4m3fn"),
        ((a[0], sa, ga, b, sb, gb), "a must be a 3-D"),
        ((a[..., :4], sa[..., :0], ga, b[..., :4], sb[..., :0], gb), "multiple of the NVFP4 block, 16"),
        ((a, sa[:, :, :2], ga, b, sb, gb), r"a_scales must be \(2, 4, 4\)"),
        ((a, sa, ga, b[:1], sb, gb), r"b must be \(2, 1, 32\)"),
        ((a, sa, ga, torch.cat((b, b), 1), sb, gb), r"b must be \(2, 1, 32\)"),
        ((a, sa, ga.double(), b, sb, gb), "a_gs must be a one-element float32 tensor"),
        ((a, sa, ga, b, sb, torch.ones(2)), "b_gs must be a one-element float32 tensor"),
        ((a, sa, ga, b, sb, 1.0), "b_gs must be a one-element float32 tensor"),
        ((torch.zeros(2, 4, 36, dtype=torch.uint8)[..., 2:34], sa, ga, b, sb, gb), "multiples of 4 bytes"),
        ((torch.zeros(2, 4, 64, dtype=torch.uint8)[..., ::2], sa, ga, b, sb, gb), "contiguous rows"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_cases())))
def test_bad_inputs_are_refused_with_a_message(case):
    args, message = _bad_cases()[case]
    with pytest.raises(ValueError, match=message):
        check_nvfp4_gemv_inputs(*args)
    with pytest.raises(ValueError, match=message):
        nvfp4_batched_gemv(*args)


def test_empty_sizes_and_minimum_bytes():
    a, sa, ga, b, sb, gb = _inputs(4, 64, 2)
    assert nvfp4_batched_gemv(a[:, :0], sa[:, :0], ga, b, sb, gb).shape == (2, 0, 1)
    assert nvfp4_batched_gemv(a[:0], sa[:0], ga, b[:0], sb[:0], gb).shape == (0, 4, 1)
    # codes and scales of a and b, c in fp16, the two global scales: 66.1, 132.2, 33.1 MB
    moved = [nvfp4_gemv_min_bytes(m, k, batches) for m, k, batches in PROBLEM_SET]
    assert moved == [66_083_848, 132_218_376, 33_092_104]
    assert moved[0] == 7168 * (8192 + 1024) + 8192 + 1024 + 7168 * 2 + 8


# --- the custom op ---------------------------------------------------------------------------

def test_op_passes_opcheck_compiles_and_falls_back_to_eager_on_cpu():
    inputs = _inputs(5, 64, 2)
    before = [t.view(torch.uint8).clone() if t.dtype == torch.float8_e4m3fn else t.clone() for t in inputs]
    torch.testing.assert_close(nvfp4_op(*inputs), nvfp4_gemv_reference(*inputs), rtol=0, atol=0)
    for t, saved in zip(inputs, before):  # nothing mutated (opcheck's schema test cannot compare fp8 on CPU)
        assert torch.equal(t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t, saved)
    torch.library.opcheck(nvfp4_op, inputs,
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    compiled = torch.compile(lambda *t: nvfp4_op(*t) * 2, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(*inputs), nvfp4_gemv_reference(*inputs) * 2)


def test_op_refuses_bad_shapes_with_value_errors():
    a, sa, ga, b, sb, gb = _inputs(4, 64, 2)
    with pytest.raises(ValueError, match="b must be"):
        nvfp4_op(a, sa, ga, b[:1], sb, gb)
    with pytest.raises(ValueError, match="scales must be"):
        nvfp4_op(a, sa[..., :2], ga, b, sb, gb)
    with pytest.raises(ValueError, match="one element"):
        nvfp4_op(a, sa, torch.ones(2), b, sb, gb)


# --- the problem file ------------------------------------------------------------------------

class OurNvfp4(torch.nn.Module):
    def forward(self, *inputs):
        return nvfp4_batched_gemv(*inputs)


@pytest.mark.slow
def test_problem_file_passes_gate_1_with_our_kernel(cpu, cpu_ceilings, fast_timing):
    from kforge.harness.evaluate import evaluate
    from kforge.harness.problem import load_problem
    from kforge.ladder import source_candidate

    problem = load_problem(PROBLEM, "tiny")
    inputs = problem.make_inputs(0, torch.device("cpu"))
    assert [tuple(t.shape) for t in inputs] == [(2, 24, 80), (2, 24, 10), (), (2, 1, 80), (2, 1, 10), ()]
    assert problem.count_bytes(inputs, None, None) == nvfp4_gemv_min_bytes(24, 160, 2)
    record = evaluate(problem, source_candidate("ours", OurNvfp4, [Path(nvfp4_gemv.__file__)]), device=cpu,
                      ceilings=cpu_ceilings, timing=fast_timing)
    assert record.gate1["passed"], record.reason


# --- machine code for the H100, compiled on any machine --------------------------------------

_COMPILE_SM90 = textwrap.dedent(r"""
    import json, os, re, sys
    os.environ["TRITON_INTERPRET"] = "0"
    from pathlib import Path
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from kforge.kernels.quant import nvfp4_gemv
    from kforge.runtime.cuda import Cubin, loop_opcodes, resources, sass

    def loop_ops(code):  # base opcodes inside the K loops
        return [op.split(".")[0] for op in loop_opcodes(code)]

    INTS = ("m_rows", "k_words", "stride_al", "stride_am", "stride_sal", "stride_sam", "stride_bl", "stride_sbl",
            "stride_cl", "stride_cm")
    TYPES = {**{name: "i32" for name in INTS}, "a_ptr": "*i32", "sa_ptr": "*fp8e4nv", "a_gs_ptr": "*fp32",
             "b_ptr": "*i32", "sb_ptr": "*fp8e4nv", "b_gs_ptr": "*fp32", "c_ptr": "*fp16"}
    ALIGNED = set(TYPES) - {"a_gs_ptr", "b_gs_ptr", "stride_cm"}
    fn = nvfp4_gemv.nvfp4_gemv_kernel
    every = sys.argv[1] == "every"
    found = {}
    for config in nvfp4_gemv.CONFIGS if every else nvfp4_gemv.CONFIGS[:1]:
        signature = {name: TYPES.get(name, "constexpr") for name in fn.arg_names}
        attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in ALIGNED}
        kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=dict(config.kwargs), attrs=attrs),
                                target=GPUTarget("cuda", 90, 32), options={"num_warps": config.num_warps})
        cubin = Cubin(Path(fn.__name__), "sm_90", (), "", kernel.asm["cubin"], "")
        (used,) = resources(cubin).values()
        entry = dict(registers=used.registers, local=used.local_bytes + used.stack_bytes,
                     shared=kernel.metadata.shared)
        if not every:
            code = sass(cubin)
            count = lambda pattern: len(re.findall(pattern, code))
            loop = loop_ops(code)
            entry.update(ldg128=count(r"\bLDG\.E\.128\b"), i2f=count(r"\bI2F\b"), loop=len(loop),
                         loop_shared=sum(op in ("LDS", "STS", "BAR") for op in loop))
        found[f"{config.kwargs} warps={config.num_warps}"] = entry
    print(json.dumps(found))
""")


def _compile_sm90(which: str) -> dict:
    done = subprocess.run([sys.executable, "-c", _COMPILE_SM90, which], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@codegen_of_triton_3_6
def test_default_tile_compiles_for_sm90_as_designed():
    (kernel,) = _compile_sm90("defaults").values()
    # 16-byte loads of a's words, no spills, no int -> float conversion (codes are read as floats),
    # no shared-memory shuffles in the K loop, at most 128 registers: 4 programs (16 warps) an SM
    assert kernel["local"] == 0 and kernel["ldg128"] >= 8 and kernel["i2f"] == 0 and kernel["loop_shared"] == 0, kernel
    # the decode's cost: ~5.1 instructions a value (8 rows x 32 values a lane a step), against the
    # ~6 an SM can issue per value at 3 TB/s
    assert kernel["loop"] <= 5.5 * 8 * 32, kernel
    assert kernel["registers"] <= 128 and kernel["shared"] <= 227 * 1024, kernel


@pytest.mark.slow
@codegen_of_triton_3_6
def test_every_tile_compiles_for_sm90_in_shared_memory_without_spills():
    found = _compile_sm90("every")
    assert len(found) == len(CONFIGS)
    for label, kernel in found.items():
        assert kernel["local"] == 0 and kernel["shared"] <= 227 * 1024, (label, kernel)


def test_the_cuda_kernel_compiles_for_sm90_as_designed():
    """nvfp4_gemv.cu's loop: a's 16 bytes a row through loads that skip L1 and b's through cached
    ones; 16 fp16-pair products a row (32 codes) and 16 for b's decode (HFMA2 or HMUL2), the
    scales converted by the hardware (F2FP E4M3), no int -> float conversion, no spills; at
    most 4.75 instructions a code (4.6 at 2 rows a warp, b's decode shared by two; 3.7 at 4),
    where an SM can issue ~5.5 a code at 3 TB/s."""
    from collections import Counter

    from kforge.runtime.cuda import compile_cuda, loop_opcodes, resources, sass

    rows, warps = nvfp4_gemv.cuda_variant(16384)
    cubin = compile_cuda(nvfp4_gemv.CUDA_SOURCE, arch="sm_90a", defines={"ROWS": rows, "WARPS": warps})
    used = resources(cubin)["nvfp4_gemv"]
    assert (used.spill_stores, used.spill_loads, used.stack_bytes) == (0, 0, 0) and used.registers <= 96, used
    loop = Counter(loop_opcodes(sass(cubin)))
    assert loop["LDG.E.NA.128.CONSTANT"] == rows and loop["LDG.E.NA.U16.CONSTANT"] == rows, loop
    assert loop["LDG.E.128.CONSTANT"] == 1 and loop["LDG.E.U16.CONSTANT"] == 1, loop
    assert loop["HFMA2"] + loop["HFMA2.MMA"] + loop["HMUL2"] == 16 * rows + 16, loop
    assert loop["F2FP.F16.E4M3.UNPACK_B"] == rows + 1, loop
    assert not any(op.startswith(("I2F", "F2I")) for op in loop), loop
    assert sum(loop.values()) <= 4.75 * 32 * rows, f"{sum(loop.values()) / (32 * rows):.2f} instructions a code"


# --- on the GPU ------------------------------------------------------------------------------

CUDA_VARIANTS = [(1, 4), (2, 8), (4, 4), (4, 8), (8, 8)]  # (ROWS, WARPS)


def _count_cuda_launches(monkeypatch):
    calls = []
    real = nvfp4_gemv.launch_cuda_gemv
    monkeypatch.setattr(nvfp4_gemv, "launch_cuda_gemv", lambda *args, **kw: calls.append(args) or real(*args, **kw))
    return calls


@pytest.mark.gpu
@pytest.mark.parametrize("m, k, batches", PROBLEM_SET, ids=str)
def test_the_cuda_kernel_on_the_problem_set_in_every_variant(m, k, batches, monkeypatch):
    calls = _count_cuda_launches(monkeypatch)
    inputs = _inputs(m, k, batches, "cuda")
    assert_matches(nvfp4_batched_gemv(*inputs), *inputs)
    assert len(calls) == 1, "the default path is the CUDA kernel"
    for rows, warps in CUDA_VARIANTS:
        c = torch.full((batches, m, 1), float("nan"), dtype=torch.float16, device="cuda")
        nvfp4_gemv.launch_cuda_gemv(*inputs, c, rows=rows, warps=warps)
        assert_matches(c, *inputs)


@pytest.mark.gpu
def test_the_cuda_kernel_on_odd_shapes_and_strided_batches_and_what_falls_back(monkeypatch):
    """M not a multiple of a block's rows (777, 5, 4099), K of one to a few 16-byte units (32,
    96) or not a multiple of 32 (1040, 16: the Triton kernel), every other batch of a larger
    tensor (batch strides twice the batch)."""
    calls = _count_cuda_launches(monkeypatch)
    for m, k, batches in ((777, 96, 3), (5, 32, 2), (4099, 4096, 1), (33, 2048, 5)):
        inputs = _inputs(m, k, batches, "cuda", seed=m)
        assert_matches(nvfp4_batched_gemv(*inputs), *inputs)
        wide = _inputs(m, k, 2 * batches, "cuda", seed=m + 1)
        every_other = [t[::2] if t.dim() == 3 else t for t in wide]
        assert_matches(nvfp4_batched_gemv(*every_other), *every_other)
    assert len(calls) == 8
    for m, k, batches in ((777, 1040, 3), (5, 16, 2)):
        inputs = _inputs(m, k, batches, "cuda")
        assert_matches(nvfp4_batched_gemv(*inputs), *inputs)
    assert len(calls) == 8, "K not a multiple of 32 takes the Triton kernel"


@pytest.mark.gpu
@pytest.mark.parametrize("m, k, batches", PROBLEM_SET, ids=str)
def test_the_problem_set_on_the_gpu_with_every_tile(m, k, batches):
    inputs = _inputs(m, k, batches, "cuda")
    assert_matches(nvfp4_batched_gemv(*inputs), *inputs)
    for config in CONFIGS:
        tile = dict(config.kwargs, num_warps=config.num_warps)
        assert_matches(nvfp4_batched_gemv(*inputs, config=tile), *inputs)


@pytest.mark.gpu
def test_odd_shapes_on_the_gpu_with_every_tile():
    for m, k, batches in ((777, 1040, 3), (5, 16, 2), (4099, 4096, 1)):  # K tails: 130 and 2 words
        inputs = _inputs(m, k, batches, "cuda")
        for config in CONFIGS:
            tile = dict(config.kwargs, num_warps=config.num_warps)
            assert_matches(nvfp4_batched_gemv(*inputs, config=tile), *inputs)


@pytest.mark.gpu
def test_op_on_the_gpu_runs_our_kernel_and_compiles_with_inductor():
    from kforge.ops.nvfp4 import ours_can_run

    inputs = _inputs(4096, 7168, 8, "cuda")
    assert ours_can_run(*inputs)
    compiled = torch.compile(lambda *t: nvfp4_op(*t), fullgraph=True)
    assert_matches(compiled(*inputs), *inputs)

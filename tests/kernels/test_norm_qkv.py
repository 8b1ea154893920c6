"""RMSNorm fused into the QKV projection: both paths under the interpreter (decode: the GEMV
kernel with the norm, batch 1..16; prefill: the persistent GEMM, 70 rows over 4 programs)
in fp16 and fp32 on K and N tails, against the float64 math; eps that dominates the
statistic; gamma folded into W; every output written; bad inputs refused; the eager
reference and kforge.ops.rms_norm_qkv as a custom op; the sm_90 machine code of both
kernels (compiled on any machine). On a GPU: bf16 at the Llama-3 8B and 70B shapes,
decode and prefill, and every tile of both autotuners' lists."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
import triton

from kforge.kernels.serving import gemv
from kforge.kernels.serving.norm_qkv import (CONFIGS, DECODE_ROWS, check_norm_qkv_inputs, fold_norm_weight,
                                             fused_fills_half_the_sms, prefill_tile_width, rms_norm_qkv,
                                             rms_norm_qkv_min_bytes, rms_norm_qkv_reference)
from kforge.ops.norm_qkv import rms_norm_qkv as rms_norm_qkv_op

GEMV_CUDA_CORE = {"BLOCK_N": 64, "BLOCK_K": 256, "USE_DOT": False}
GEMV_TENSOR_CORE = {"BLOCK_N": 64, "BLOCK_K": 256, "USE_DOT": True}
GEMM = {"BM": 64, "BN": 256, "BK": 256, "GROUP_M": 2, "FLATTEN": False}  # 70 x 777: 2 x 4 tiles, 4 programs
# fp16: x * gamma rounded once before the tensor cores and the output rounded once, each
# 2^-11 relative; fp32: sums of ~1000 products, ~1e-7
# fp32: sums of up to K = 4096 products in another order than float64's round off like a
# random walk, ~sqrt(K) * 2^-24 of the output's RMS: measured up to 9.3e-6 on the H100
# (2026-11-21), so 2e-5.
TOLERANCE = {torch.float16: 2e-3, torch.float32: 2e-5, torch.bfloat16: 1.6e-2}


def _inputs(rows, n, k, dtype, device="cpu", seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * scale
    gamma = torch.rand(k, generator=g) + 0.5
    w = torch.randn(n, k, generator=g) / k**0.5
    return x.to(dtype=dtype, device=device), gamma.to(dtype=dtype, device=device), w.to(dtype=dtype, device=device)


def expected(x, gamma, w, eps):
    """The fused op's math in float64; gamma=None: already in w."""
    x = x.double()
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (x * r * (1.0 if gamma is None else gamma.double())) @ w.double().T


def assert_matches(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """Elementwise within the dtype's rounding of each value, plus the same fraction of the
    output's RMS for the rounding of x * gamma, which is summed over K."""
    tol = TOLERANCE[dtype]
    scale = want.pow(2).mean().sqrt().item()
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * scale)


# --- decode: the GEMV kernel with the norm ---------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("rows, config", [(1, GEMV_CUDA_CORE), (3, GEMV_TENSOR_CORE), (13, GEMV_CUDA_CORE),
                                          (16, GEMV_TENSOR_CORE)], ids=["1-cuda-core", "3-tensor-core",
                                                                        "13-cuda-core", "16-tensor-core"])
def test_decode_path_matches_float64_under_the_interpreter(rows, config, dtype, nan_outputs):
    x, gamma, w = _inputs(rows, 777, 1000, dtype)  # tails: N = 12 * 64 + 9, K = 3 * 256 + 232
    y = rms_norm_qkv(x, gamma, w, 1e-5, config=config)
    assert y.shape == (rows, 777) and y.dtype == dtype
    assert_matches(y, expected(x, gamma, w, 1e-5), dtype)


@pytest.mark.parametrize("config", [GEMV_CUDA_CORE, GEMV_TENSOR_CORE], ids=["cuda-core", "tensor-core"])
def test_decode_path_applies_eps_where_it_dominates_the_mean_square(config):
    x, gamma, w = _inputs(3, 40, 300, torch.float32, scale=0.01)  # mean(x^2) = 1e-4
    for eps in (1e-6, 1e-2):
        y = rms_norm_qkv(x, gamma, w, eps, config=config)
        assert_matches(y, expected(x, gamma, w, eps), torch.float32)
    assert not torch.allclose(expected(x, gamma, w, 1e-6), expected(x, gamma, w, 1e-2), rtol=0.5)


def test_decode_path_of_a_vector_and_of_folded_weights():
    x, gamma, w = _inputs(2, 48, 300, torch.float32, seed=1)
    y = rms_norm_qkv(x[1], gamma, w, 1e-6, config=GEMV_CUDA_CORE)
    assert y.shape == (48,)
    assert_matches(y, expected(x[1], gamma, w, 1e-6), torch.float32)
    folded = fold_norm_weight(gamma, w)
    assert_matches(rms_norm_qkv(x, None, folded, 1e-6, config=GEMV_TENSOR_CORE), expected(x, gamma, w, 1e-6),
                   torch.float32)


# --- prefill: the persistent GEMM ------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_prefill_path_matches_float64_under_the_interpreter(dtype, nan_outputs):
    # 70 = 64 + 6 rows, N = 777 = 3 * 256 + 9, K = 1000 = 3 * 256 + 232: every tile has a tail
    x, gamma, w = _inputs(70, 777, 1000, dtype)
    y = rms_norm_qkv(x.view(2, 35, 1000), gamma, w, 1e-5, config=GEMM)
    assert y.shape == (2, 35, 777) and y.dtype == dtype
    assert_matches(y.view(70, 777), expected(x, gamma, w, 1e-5), dtype)


def test_prefill_path_with_folded_weights_eps_and_the_first_row_count_past_decode(nan_outputs):
    rows = DECODE_ROWS + 1  # the first count that takes the GEMM (a GEMV config would not fit it)
    x, gamma, w = _inputs(rows, 40, 96, torch.float32, seed=2, scale=0.01)
    # 2 x 2 tiles in one group of GROUP_M = 4 tile rows that has only 2
    tiles = {"BM": 16, "BN": 32, "BK": 32, "GROUP_M": 4, "FLATTEN": False}
    for eps in (1e-6, 1e-2):
        assert_matches(rms_norm_qkv(x, gamma, w, eps, config=tiles), expected(x, gamma, w, eps), torch.float32)
    folded = fold_norm_weight(gamma, w)
    assert_matches(rms_norm_qkv(x, None, folded, 1e-6, config=tiles), expected(x, gamma, w, 1e-6), torch.float32)
    with pytest.raises(KeyError):
        rms_norm_qkv(x, gamma, w, config=GEMV_CUDA_CORE)


# --- inputs, references, bytes ---------------------------------------------------------------

def _bad_cases():
    x, gamma, w = _inputs(4, 8, 16, torch.float32)
    prefill_x = torch.randn(DECODE_ROWS + 1, 12)  # 48-byte rows: fine for TMA
    return [
        ((x, gamma, w.half(), 1e-6), "share one dtype"),
        ((x.int(), gamma, w.int(), 1e-6), "share one dtype"),
        ((x[:, :15], gamma[:15], w, 1e-6), "K = 15"),
        ((x[:, :0], gamma[:0], w[:, :0], 1e-6), "K = 0"),
        ((x, gamma[:15], w, 1e-6), "vector of K = 16"),
        ((x, gamma.int(), w, 1e-6), "vector of K = 16"),
        ((x, torch.randn(32)[::2], w, 1e-6), "norm_weight must be contiguous"),
        ((x, gamma, w, -1.0), "eps must be"),
        ((x, gamma, w, float("nan")), "eps must be"),
        ((x, gamma, torch.randn(16, 8).T, 1e-6), "contiguous rows"),
        ((torch.randn(4, 32)[:, ::2], gamma, w, 1e-6), "contiguous rows"),
        ((x[0, 0], gamma, w, 1e-6), "must be"),
        ((torch.randn(DECODE_ROWS + 1, 10).half(), gamma[:10].half(), torch.randn(8, 10).half(), 1e-6), "TMA"),
        ((torch.randn(DECODE_ROWS + 1, 13)[:, :12], gamma[:12], torch.randn(8, 12), 1e-6), "TMA"),
        ((prefill_x, gamma[:12], torch.randn(8, 13)[:, :12], 1e-6), "TMA"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_cases())))
def test_bad_inputs_are_refused_before_any_kernel_runs(case):
    args, message = _bad_cases()[case]
    with pytest.raises(ValueError, match=message):
        check_norm_qkv_inputs(*args)
    with pytest.raises(ValueError, match=message):
        rms_norm_qkv(*args)


def test_reference_is_the_eager_pair_and_fold_scales_w_along_k():
    x, gamma, w = _inputs(5, 24, 64, torch.float64)
    torch.testing.assert_close(rms_norm_qkv_reference(x, gamma, w, 1e-5), expected(x, gamma, w, 1e-5))
    half = [t.half() for t in (x, gamma, w)]
    assert_matches(rms_norm_qkv_reference(*half, 1e-5), expected(*half, 1e-5), torch.float16)
    torch.testing.assert_close(fold_norm_weight(gamma, w), w * gamma[None, :])
    assert fold_norm_weight(gamma.half(), w.bfloat16()).dtype == torch.bfloat16


def test_minimum_bytes_count_x_weights_and_y_but_no_normed_rows():
    m, n, k = 4096, 6144, 4096
    assert rms_norm_qkv_min_bytes(m, n, k) == (m * k + n * k + k + m * n) * 2
    assert rms_norm_qkv_min_bytes(1, n, k) - gemv.gemv_min_bytes(1, n, k) == 2 * k  # gamma on top of the GEMV


# --- the custom op ---------------------------------------------------------------------------

def test_op_falls_back_to_the_eager_pair_on_cpu_passes_opcheck_and_compiles():
    x, gamma, w = _inputs(6, 24, 40, torch.float32)
    torch.testing.assert_close(rms_norm_qkv_op(x, gamma, w), rms_norm_qkv_reference(x, gamma, w, 1e-6))
    torch.testing.assert_close(rms_norm_qkv_op(x.view(2, 3, 40), gamma, w, 0.1),
                               rms_norm_qkv_reference(x, gamma, w, 0.1).view(2, 3, 24))
    torch.library.opcheck(rms_norm_qkv_op, (x, gamma, w, 1e-5))
    compiled = torch.compile(lambda a, b, c: rms_norm_qkv_op(a, b, c) * 2, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, gamma, w), 2 * rms_norm_qkv_reference(x, gamma, w, 1e-6))


def test_op_refuses_mismatched_shapes_with_value_errors():
    x, gamma, w = _inputs(6, 24, 40, torch.float32)
    with pytest.raises(ValueError, match="K differs"):
        rms_norm_qkv_op(x, gamma[:39], w)
    with pytest.raises(ValueError, match="K differs"):
        rms_norm_qkv_op(x, gamma, w[:, :39])
    with pytest.raises(ValueError, match="takes x"):
        rms_norm_qkv_op(x, gamma[None], w)


# --- machine code for the H100, compiled on any machine --------------------------------------

_COMPILE_SM90 = textwrap.dedent(r"""
    import json, os, re
    os.environ["TRITON_INTERPRET"] = "0"
    from pathlib import Path
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from kforge.kernels.serving import gemv, norm_qkv
    from kforge.runtime.cuda import Cubin, resources, sass

    def build(fn, types, constants, aligned, config):
        signature = {name: types.get(name, "constexpr") for name in fn.arg_names}
        attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned if name in types}
        source = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": config.num_warps, "num_stages": config.num_stages})
        cubin = Cubin(Path(fn.__name__), "sm_90", (), "", kernel.asm["cubin"], "")
        code = sass(cubin)
        (used,) = resources(cubin).values()
        count = lambda pattern: len(re.findall(pattern, code))
        return dict(registers=used.registers, local=used.local_bytes + used.stack_bytes,
                    spills=count(r"\b(STL|LDL)\b"), ldg128=count(r"\bLDG\.E\.128\b"), hmma=count(r"\bHMMA\b"),
                    ldgsts=count(r"\bLDGSTS\b"), hgmma=count(r"\bHGMMA\b"), tma=count(r"\bUTMALDG\b"),
                    shared=kernel.metadata.shared)

    found = {}
    ints = {name: "i32" for name in ("batch", "n_out", "k_in", "stride_xb", "stride_wn", "stride_yb")}
    pointers = {name: "*bf16" for name in ("x_ptr", "w_ptr", "y_ptr", "gamma_ptr")}
    aligned = ("x_ptr", "w_ptr", "y_ptr", "gamma_ptr", "n_out", "k_in", "stride_xb", "stride_wn", "stride_yb")
    for label, config, block_b in [("gemv batch 1", gemv.CONFIGS[0], 1), ("gemv batch 16", gemv.CONFIGS[4], 16)]:
        for norm in (False, True):
            constants = dict(config.kwargs, BLOCK_B=block_b, NORM=norm, DOT_PRECISION="tf32")
            found[f"{label} norm={norm}"] = build(gemv.gemv_kernel, {**pointers, **ints, "eps": "fp32"}, constants,
                                                  aligned, config)
    config = norm_qkv.CONFIGS[0]
    bm, bn, bk = (config.kwargs[key] for key in ("BM", "BN", "BK"))
    types = {"x_desc": f"tensordesc<bf16[{bm},{bk}]>", "w_desc": f"tensordesc<bf16[{bn},{bk}]>", "y_ptr": "*bf16",
             "gamma_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", "stride_ym": "i32", "eps": "fp32",
             "M_BUCKET": "i32"}
    constants = dict(config.kwargs, NUM_PROGRAMS=132, DOT_PRECISION="tf32")
    found["gemm"] = build(norm_qkv.norm_matmul_kernel, types, constants, ("y_ptr", "gamma_ptr", "N", "K", "stride_ym"),
                          config)
    print(json.dumps(found))
""")


@pytest.mark.slow
def test_both_kernels_compile_for_sm90_as_designed_without_spills():
    done = subprocess.run([sys.executable, "-c", _COMPILE_SM90], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    for label, kernel in found.items():
        assert kernel["spills"] == 0 and kernel["local"] == 0, (label, kernel)
    for norm in (False, True):
        # batch 1, BLOCK_N = 8 on CUDA cores: 8 LDG.128 of W and 1 of x per K step (again in
        # the tail step); at most 128 registers keeps 4 programs (16 warps) on an SM
        small = found[f"gemv batch 1 norm={norm}"]
        assert small["ldg128"] >= 18 and small["registers"] <= 128 and small["hmma"] == 0, small
        # batch 16 on tensor cores: W streams through cp.async (LDGSTS) into mma.sync (HMMA)
        large = found[f"gemv batch 16 norm={norm}"]
        assert large["hmma"] > 0 and large["ldgsts"] > 0, large
    gemm = found["gemm"]  # wgmma fed by TMA, in the 227 KB of shared memory
    assert gemm["hgmma"] > 0 and gemm["tma"] > 0 and gemm["shared"] <= 227 * 1024, gemm


# --- on the GPU ------------------------------------------------------------------------------

LLAMA3_QKV = {"8B": (6144, 4096), "70B": (10240, 8192)}  # (N, K)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4, 16, 512, 2048])
@pytest.mark.parametrize("model", LLAMA3_QKV)
def test_on_the_gpu_matches_float64_at_llama_shapes(model, rows):
    n, k = LLAMA3_QKV[model]
    x, gamma, w = _inputs(rows, n, k, torch.bfloat16, "cuda")
    # bf16: x * gamma rounded to bf16 before the tensor cores (2^-9 relative, summed over K
    # into ~2^-9 of the output's RMS), the output rounded once (2^-9 relative)
    want = expected(x, gamma, w, 1e-5)
    assert_matches(rms_norm_qkv(x, gamma, w, 1e-5), want, torch.bfloat16)
    assert_matches(rms_norm_qkv(x, None, fold_norm_weight(gamma, w), 1e-5), want, torch.bfloat16)


def test_the_prefill_takes_192_wide_tiles_only_where_256_would_leave_many_sms_idle():
    # Llama-3 QKV widths on 132 SMs (the measured cases in prefill_tile_width's docstring)
    assert prefill_tile_width(512, 6144, 132) == 192  # 96 tiles of 256 (73% of one wave) against 128 of 192
    assert prefill_tile_width(1024, 6144, 132) == 192
    assert prefill_tile_width(512, 10240, 132) == 192
    assert prefill_tile_width(1024, 10240, 132) == 256  # 81% against 82%: not worth the norm's extra work
    assert prefill_tile_width(2048, 6144, 132) == 256
    assert prefill_tile_width(4096, 10240, 132) == 256
    assert prefill_tile_width(17, 776, 132) == 192  # one row tile: 5 narrower tiles finish before 4 wide ones


def test_a_few_rows_past_the_gemv_go_unfused_where_the_fused_tiles_would_leave_half_the_sms_idle():
    # llama3-8b's QKV (6144 columns: 24 tiles a 128-row band) on 132 SMs
    assert not fused_fills_half_the_sms(17, 6144, 132) and not fused_fills_half_the_sms(64, 6144, 132)
    assert not fused_fills_half_the_sms(256, 6144, 132)  # 48 tiles: 84 SMs idle
    assert fused_fills_half_the_sms(257, 6144, 132) and fused_fills_half_the_sms(4096, 6144, 132)  # 72 tiles
    assert fused_fills_half_the_sms(17, 10240 * 4, 132)  # 160 tiles in one band


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [17, 64, 96, 128, 256])
def test_decode_batches_past_the_gemv_take_the_norm_then_cublas(rows, monkeypatch):
    import torch.nn.functional as F

    from kforge import ops
    from kforge.kernels import gemm_bf16

    fused = []
    real = gemm_bf16.gemm
    monkeypatch.setattr(gemm_bf16, "gemm", lambda *a, **kw: fused.append(kw.get("norm_weight") is not None)
                        or real(*a, **kw))
    x, gamma, w = _inputs(rows, 6144, 4096, torch.bfloat16, "cuda")
    want = expected(x, gamma, w, 1e-5)
    got = rms_norm_qkv(x, gamma, w, 1e-5)
    assert_matches(got, want, torch.bfloat16)
    assert_matches(rms_norm_qkv(x, None, fold_norm_weight(gamma, w), 1e-5), want, torch.bfloat16)
    assert True not in fused
    assert torch.equal(got, F.linear(ops.rms_norm(x, gamma, 1e-5), w))  # the unfused pair, bit for bit


@pytest.mark.gpu
def test_bf16_prefill_runs_on_the_gemm_ladder_with_the_norm_as_a_row_scale(monkeypatch):
    """Over 16 bf16 rows on Hopper, where its tiles fill more than half the SMs: rung 4 with its
    norm (NORM_A), gamma given or folded into W; tails in M, N and K (TMA's zero fill past K
    adds no squares), several tiles a CTA; 128 x 256 tiles and (at 512 on 132 SMs) 128 x 192."""
    from kforge.kernels import gemm_bf16

    calls = []
    real = gemm_bf16.gemm
    monkeypatch.setattr(gemm_bf16, "gemm", lambda *a, **kw: calls.append(kw.get("norm_weight") is not None)
                        or real(*a, **kw))
    for rows, n, k in ((2100, 776, 1000), (400, 6144, 4096), (2000, 1032, 520), (512, 6144, 4096)):
        x, gamma, w = _inputs(rows, n, k, torch.bfloat16, "cuda")
        want = expected(x, gamma, w, 1e-5)
        assert_matches(rms_norm_qkv(x, gamma, w, 1e-5), want, torch.bfloat16)
        assert_matches(rms_norm_qkv(x, None, fold_norm_weight(gamma, w), 1e-5), want, torch.bfloat16)
    assert calls == [True] * 8


@pytest.mark.gpu
def test_every_tile_either_autotuner_may_pick_is_correct_on_the_gpu():
    for rows in (1, 2, 4, 13):  # decode: odd sizes, then the unmasked vectorized loop
        for n, k in ((777, 1000), (1536, 2048)):
            x, gamma, w = _inputs(rows, n, k, torch.bfloat16, "cuda")
            for config in gemv._configs_for(gemv.CONFIGS, {}, BLOCK_B=triton.next_power_of_2(rows)):
                tiles = dict(config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)
                assert_matches(rms_norm_qkv(x, gamma, w, 1e-5, config=tiles), expected(x, gamma, w, 1e-5),
                               torch.bfloat16)
    x, gamma, w = _inputs(300, 777, 1000, torch.bfloat16, "cuda")  # prefill: tails in M, N and K
    for config in CONFIGS:
        tiles = dict(config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)
        assert_matches(rms_norm_qkv(x, gamma, w, 1e-5, config=tiles), expected(x, gamma, w, 1e-5), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_on_the_gpu_in_fp16_and_fp32(dtype):
    for rows in (3, 600):
        x, gamma, w = _inputs(rows, 1536, 2048, dtype, "cuda")
        assert_matches(rms_norm_qkv(x, gamma, w, 1e-5), expected(x, gamma, w, 1e-5), dtype)


@pytest.mark.gpu
def test_op_on_the_gpu_runs_our_kernels_and_compiles_with_inductor():
    from kforge.ops.norm_qkv import ours_can_run

    x, gamma, w = _inputs(64, 6144, 4096, torch.bfloat16, "cuda")
    assert ours_can_run(x, gamma, w, 1e-5)
    compiled = torch.compile(lambda a, b, c: rms_norm_qkv_op(a, b, c, 1e-5), fullgraph=True)
    for rows in (1, 64):
        assert_matches(compiled(x[:rows], gamma, w), expected(x[:rows], gamma, w, 1e-5), torch.bfloat16)

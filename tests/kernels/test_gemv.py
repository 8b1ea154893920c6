"""Decode GEMV: the Triton kernel under the interpreter (fp16, fp32; batch 1..16 incl. 3 and
13; K and N tails; the CUDA-core and the tensor-core path) against float64, every output
written (allocations poisoned with NaN), bad inputs refused; kforge.ops.gemv as a custom
op; which tiles the autotuner may pick; the fused residual and SwiGLU epilogues, bit for bit
the unfused pair's. On a GPU: bf16 at the Llama-3-8B widths, every
tile of the autotuner's list, fp16 and fp32. (The kernel's sm_90 machine code is checked
in test_norm_qkv.py, with the fused GEMM's, in one compiler process.)"""

from __future__ import annotations

import pytest
import torch
import triton

from kforge.kernels.serving.gemv import (CONFIGS, CUDA_CORE_ROWS, EPI_NONE, EPI_RESIDUAL, EPI_SWIGLU, MAX_BATCH,
                                         _configs_for, check_gemv_inputs, gemv, gemv_epilogue_reference,
                                         gemv_min_bytes, gemv_reference)
from kforge.kernels.serving.swiglu import swiglu_forward
from kforge.ops.gemv import gemv as gemv_op
from kforge.ops.gemv import gemv_residual, gemv_swiglu

CUDA_CORE = {"BLOCK_N": 64, "BLOCK_K": 256, "USE_DOT": False}
TENSOR_CORE = {"BLOCK_N": 64, "BLOCK_K": 256, "USE_DOT": True}
# fp16: the output is rounded once (2^-11 relative), fp32 sums of ~1000 products: ~1e-7
# fp32: sums of up to K = 4096 products in another order than float64's round off like a
# random walk, ~sqrt(K) * 2^-24 of the output's RMS: measured up to 9.3e-6 on the H100
# (2026-11-21), so 2e-5.
TOLERANCE = {torch.float16: 1e-3, torch.float32: 2e-5, torch.bfloat16: 8e-3}


def _inputs(batch, n, k, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, k, generator=g)
    w = torch.randn(n, k, generator=g) / k**0.5
    return x.to(dtype=dtype, device=device), w.to(dtype=dtype, device=device)


def assert_matches(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """Elementwise within the dtype's rounding of each value, plus the same fraction of the
    output's RMS for the summation error (which does not shrink with the value)."""
    tol = TOLERANCE[dtype]
    scale = expected.pow(2).mean().sqrt().item()
    torch.testing.assert_close(got.double(), expected, rtol=tol, atol=tol * scale)


# --- the kernel under the interpreter -------------------------------------------------------

# (batch, N, K): tails in N (777 = 12 * 64 + 9) and K (1000 = 3 * 256 + 232), K below one
# step (100), K a whole number of steps (512), batch 1..16 padded to 1, 4, 16, 16
SHAPES = [(1, 777, 1000), (3, 70, 100), (13, 65, 512), (16, 40, 1000)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("config", [CUDA_CORE, TENSOR_CORE], ids=["cuda-core", "tensor-core"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gemv_matches_float64_under_the_interpreter(shape, config, dtype, nan_outputs):
    x, w = _inputs(*shape, dtype)
    y = gemv(x, w, config=config)
    assert y.shape == (shape[0], shape[1]) and y.dtype == dtype
    assert_matches(y, x.double() @ w.double().T, dtype)


def test_gemv_takes_a_vector_and_strided_rows(nan_outputs):
    x, w = _inputs(5, 48, 300, torch.float32)
    y = gemv(x[2], w, config=CUDA_CORE)
    assert y.shape == (48,)
    assert_matches(y, x[2].double() @ w.double().T, torch.float32)
    # rows of wider buffers: x's and W's row strides differ, and neither is K
    x, w = torch.randn(4, 400)[:, :300], torch.randn(48, 320)[:, 20:]
    for config in (CUDA_CORE, TENSOR_CORE):
        assert_matches(gemv(x, w, config=config), x.double() @ w.double().T, torch.float32)


def test_gemv_of_empty_sizes():
    x, w = _inputs(2, 8, 16, torch.float32)
    assert gemv(x[:0], w).shape == (0, 8)
    assert gemv(x, w[:0]).shape == (2, 0)
    torch.testing.assert_close(gemv(x[:, :0], w[:, :0]), torch.zeros(2, 8))  # empty sums are 0


@pytest.mark.parametrize("bad, message", [
    (lambda x, w: (x[None], w), "must be"),
    (lambda x, w: (x, w.half()), "share one dtype"),
    (lambda x, w: (x.int(), w.int()), "share one dtype"),
    (lambda x, w: (x[:, :15], w), "K = 15"),
    (lambda x, w: (torch.randn(MAX_BATCH + 1, 16), w), "at most 16 rows.*use a GEMM"),
    (lambda x, w: (x, torch.randn(16, 8).T), "contiguous rows"),
    (lambda x, w: (torch.randn(2, 32)[:, ::2], w), "contiguous rows"),
])
def test_gemv_refuses_what_it_cannot_take(bad, message):
    x, w = _inputs(2, 8, 16, torch.float32)
    with pytest.raises(ValueError, match=message):
        check_gemv_inputs(*bad(x, w))
    with pytest.raises(ValueError, match=message):
        gemv(*bad(x, w))


def test_autotuner_gives_cuda_core_tiles_only_to_the_batches_their_registers_fit():
    for block_b in (1, 2, 4, 8, 16):
        kept = _configs_for(CONFIGS, {}, BLOCK_B=block_b)
        cuda_core = [c for c in kept if not c.kwargs["USE_DOT"]]
        assert all(block_b * c.kwargs["BLOCK_N"] == CUDA_CORE_ROWS for c in cuda_core)
        assert bool(cuda_core) == (block_b <= 4)
        assert sum(c.kwargs["USE_DOT"] for c in kept) == sum(c.kwargs["USE_DOT"] for c in CONFIGS)
    for c in CONFIGS:  # CUDA-core tiles: one 16-byte vector of K per thread per row, no shuffle
        assert c.kwargs["USE_DOT"] or c.kwargs["BLOCK_K"] == 256 * c.num_warps


def test_reference_and_minimum_bytes():
    x, w = _inputs(3, 10, 20, torch.float64)
    torch.testing.assert_close(gemv_reference(x, w), torch.einsum("bk,nk->bn", x, w))
    assert gemv_min_bytes(1, 4096, 4096) == (4096 * 4096 + 2 * 4096) * 2  # W, x, y in bf16
    assert gemv_min_bytes(16, 6144, 4096, itemsize=4) == (6144 * 4096 + 16 * 4096 + 16 * 6144) * 4


# --- the fused epilogues ---------------------------------------------------------------------

def _unfused(x, w, epilogue, residual, config):
    """The pair the epilogue replaces, each on its own kernel (the interpreter's on CPU)."""
    y = gemv(x, w, config=config)
    if epilogue == EPI_RESIDUAL:
        return residual + y
    return swiglu_forward(y)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("config", [CUDA_CORE, TENSOR_CORE], ids=["cuda-core", "tensor-core"])
@pytest.mark.parametrize("epilogue", [EPI_RESIDUAL, EPI_SWIGLU], ids=["residual", "swiglu"])
@pytest.mark.parametrize("batch, n, k", [(1, 77, 1000), (3, 130, 100), (13, 64, 512)], ids=str)
def test_a_fused_epilogue_gives_the_unfused_pairs_bits(batch, n, k, epilogue, config, dtype, nan_outputs):
    """N tails (77, 130 against 64-wide tiles), K tails, several rows: the fused kernel against
    the GEMV and then the add or the SwiGLU kernel, bit for bit, and near float64."""
    rows = 2 * n if epilogue == EPI_SWIGLU else n
    x, w = _inputs(batch, rows, k, dtype, seed=batch)
    residual = torch.randn(batch, n, generator=torch.Generator().manual_seed(7)).to(dtype)
    residual = residual if epilogue == EPI_RESIDUAL else None
    got = gemv(x, w, config=config, epilogue=epilogue, residual=residual)
    assert got.shape == (batch, n)
    assert torch.equal(got, _unfused(x, w, epilogue, residual, config))
    exact = x.double() @ w.double().T
    exact = residual.double() + exact if epilogue == EPI_RESIDUAL else (
        torch.nn.functional.silu(exact[:, :n]) * exact[:, n:])
    assert_matches(got, exact, dtype)


def test_swiglu_after_the_fused_norm_scales_gate_and_up_alike(nan_outputs):
    """launch_gemv with norm_eps and EPI_SWIGLU: silu(r x g W_gate^T) * (r x g W_up^T), r the
    row's 1/rms, against float64 (the norm's factor on the up half too)."""
    from kforge.kernels.serving.gemv import launch_gemv

    x, w = _inputs(3, 2 * 40, 256, torch.float32, seed=5)
    gamma = 1 + torch.rand(256, generator=torch.Generator().manual_seed(6))
    got = launch_gemv(x, w, CUDA_CORE, norm_eps=1e-5, norm_weight=gamma, epilogue=EPI_SWIGLU)
    normed = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5) * gamma.double()
    gate, up = (normed @ w.double().T).chunk(2, dim=-1)
    assert_matches(got, torch.nn.functional.silu(gate) * up, torch.float32)


def test_a_fused_call_and_the_plain_gemv_of_one_weight_share_a_tuned_tile():
    """The autotuner's key names the weight's rows, not the output's or the epilogue: the gate/up
    GEMV and its SwiGLU-fused call look up one tile, so both add up K in one order (same bits)."""
    from kforge.kernels.serving.gemv import gemv_autotuned

    assert "EPILOGUE" not in gemv_autotuned.keys and "n_out" not in gemv_autotuned.keys
    assert "weight_rows" in gemv_autotuned.keys


def test_the_epilogue_reference_is_the_unfused_pair_and_a_vector_takes_a_vector_residual():
    x, w = _inputs(2, 12, 40, torch.float32)
    r = torch.randn(2, 12)
    torch.testing.assert_close(gemv_epilogue_reference(x, w, EPI_RESIDUAL, r), r + x @ w.T)
    gate, up = (x @ w.T).chunk(2, dim=-1)
    torch.testing.assert_close(gemv_epilogue_reference(x, w, EPI_SWIGLU), torch.nn.functional.silu(gate) * up)
    assert torch.equal(gemv_epilogue_reference(x, w, EPI_NONE), x @ w.T)
    vector = gemv(x[0], w, config=CUDA_CORE, epilogue=EPI_RESIDUAL, residual=r[0])
    assert vector.shape == (12,)
    assert torch.equal(vector, gemv(x[:1], w, config=CUDA_CORE, epilogue=EPI_RESIDUAL, residual=r[:1])[0])


@pytest.mark.parametrize("epilogue, residual, message", [
    (EPI_SWIGLU, None, "2 x hidden rows, got 11"),
    (EPI_RESIDUAL, None, "residual must be \\(batch, N\\)"),
    (EPI_RESIDUAL, torch.randn(2, 10), "residual must be \\(batch, N\\) = \\(2, 11\\)"),
    (EPI_RESIDUAL, torch.randn(2, 11, dtype=torch.float64), "residual must be a torch.float32"),
    (EPI_RESIDUAL, torch.randn(11, 2).t(), "contiguous rows"),
])
def test_an_epilogue_refuses_operands_it_cannot_take(epilogue, residual, message):
    x, w = _inputs(2, 11, 40, torch.float32)
    with pytest.raises(ValueError, match=message):
        gemv(x, w, config=CUDA_CORE, epilogue=epilogue, residual=residual)


def test_the_one_token_kernel_fuses_each_epilogue_without_spills_and_leaves_the_plain_build_alone():
    """gemv_rows.cu for sm_90a per EPILOGUE: the residual build adds one 2-byte load; the SwiGLU
    build streams two rows a warp (twice the 16-byte W loads and shuffles) and computes the
    sigmoid as Triton does (MUFU.EX2, then MUFU.RCP for div.full); the plain build is the
    same machine code, instruction for instruction, as with no EPILOGUE given."""
    import re

    from kforge.kernels.serving.gemv import ROWS_SOURCE
    from kforge.runtime.cuda import compile_cuda, resources, sass

    def build(**defines):
        cubin = compile_cuda(ROWS_SOURCE, arch="sm_90a", defines=defines)
        used = resources(cubin)["gemv_bf16"]
        assert (used.spill_stores, used.spill_loads, used.stack_bytes) == (0, 0, 0)
        assert used.registers <= 64
        code = sass(cubin)
        return code, len(re.findall(r"\bLDG\.E\.NA\.128\b", code)), len(re.findall(r"\bSHFL\.BFLY\b", code))

    def instructions(code):
        return re.findall(r"^\s+/\*[0-9a-f]{4}\*/\s+([^;]*);", code, re.M)

    plain, plain_loads, plain_shuffles = build()
    assert instructions(build(EPILOGUE=EPI_NONE)[0]) == instructions(plain)
    residual, loads, _ = build(EPILOGUE=EPI_RESIDUAL)
    assert loads == plain_loads and len(re.findall(r"\bLDG\.E\.U16", residual)) == 1
    swiglu, loads, shuffles = build(EPILOGUE=EPI_SWIGLU)
    assert (loads, shuffles) == (2 * plain_loads, 2 * plain_shuffles)
    assert re.search(r"MUFU\.EX2", swiglu) and re.search(r"MUFU\.RCP", swiglu)
    assert not re.search(r"MUFU", plain)


# --- the custom op ---------------------------------------------------------------------------

def test_op_falls_back_on_cpu_passes_opcheck_and_compiles():
    x, w = _inputs(4, 24, 40, torch.float32)
    torch.testing.assert_close(gemv_op(x, w), x @ w.T)
    assert gemv_op(x[0], w).shape == (24,)
    torch.library.opcheck(gemv_op, (x, w))
    torch.library.opcheck(gemv_op, (x[0], w))
    compiled = torch.compile(lambda a, b: gemv_op(a, b) * 2, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, w), 2 * (x @ w.T))


def test_op_refuses_bad_shapes_and_large_batches_with_value_errors():
    x, w = _inputs(4, 24, 40, torch.float32)
    with pytest.raises(ValueError, match="K = 39"):
        gemv_op(x[:, :39], w)
    with pytest.raises(ValueError, match="at most 16 rows.*use a GEMM"):
        gemv_op(torch.randn(17, 40), w)
    with pytest.raises(ValueError, match="takes x"):
        gemv_op(x[None], w)


def test_the_fused_ops_fall_back_on_cpu_to_the_unfused_pair_and_pass_opcheck():
    x, w = _inputs(4, 24, 40, torch.float32)
    r = torch.randn(4, 24)
    assert torch.equal(gemv_residual(x, w, r), r + x @ w.T)
    assert torch.equal(gemv_swiglu(x, w), gemv_epilogue_reference(x, w, EPI_SWIGLU))
    assert gemv_residual(x[0], w, r[0]).shape == (24,) and gemv_swiglu(x[0], w).shape == (12,)
    torch.library.opcheck(gemv_residual, (x, w, r))
    torch.library.opcheck(gemv_swiglu, (x, w))
    with pytest.raises(ValueError, match="residual of the result's shape \\(4, 24\\)"):
        gemv_residual(x, w, r[:, :5])
    with pytest.raises(ValueError, match="fused gate/up weight"):
        gemv_swiglu(x, w[:23])


# --- on the GPU ------------------------------------------------------------------------------

LLAMA3_8B = [(4096, 4096), (6144, 4096), (14336, 4096), (28672, 4096), (4096, 14336)]  # (N, K)


def test_the_one_token_cuda_kernel_streams_w_with_16_byte_loads_that_skip_l1():
    """gemv_rows.cu for sm_90a: W through 16-byte loads that do not allocate in L1 (read once),
    x through cached 16-byte loads, the rows' sums meeting in shuffles; no spills."""
    import re

    from kforge.kernels.serving.gemv import ROWS_SOURCE
    from kforge.runtime.cuda import compile_cuda, resources, sass

    cubin = compile_cuda(ROWS_SOURCE, arch="sm_90a")
    used = resources(cubin)["gemv_bf16"]
    assert (used.spill_stores, used.spill_loads, used.stack_bytes) == (0, 0, 0)
    code = sass(cubin)
    assert len(re.findall(r"\bLDG\.E\.NA\.128\b", code)) >= 8, "W: 16-byte loads that skip L1, several in flight"
    assert re.search(r"\bLDG\.E\.128\.CONSTANT\b", code), "x: cached 16-byte loads"
    assert len(re.findall(r"\bSHFL\.BFLY\b", code)) == 5, "a warp's 32 partial sums in 5 butterfly steps"
    assert used.registers <= 64, "at most 64 registers: 32 warps an SM keep ~64 KB of W in flight"


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", [(4096, 4096), (777, 1000), (9, 8), (130, 2056), (6144, 4104), (4096, 14336)])
def test_one_bf16_token_takes_the_cuda_kernel_and_matches_float64(n, k, monkeypatch):
    """N not a multiple of the block's 8 rows, K tails below a step (a step is 32 lanes x 4 x 8 =
    1024 values: 1000, 8 alone, 2056, 4104), and a strided W whose rows stay 16-byte aligned."""
    from kforge.kernels.serving import gemv as module

    calls = []
    real = module.launch_rows_kernel
    monkeypatch.setattr(module, "launch_rows_kernel", lambda *args: calls.append(args) or real(*args))
    x, w = _inputs(1, n, k, torch.bfloat16, "cuda")
    torch.full((n,), float("nan"), dtype=torch.bfloat16, device="cuda")  # freed: the output may reuse it
    assert_matches(gemv(x, w), x.double() @ w.double().T, torch.bfloat16)
    assert_matches(gemv(x[0], w), x[0].double() @ w.double().T, torch.bfloat16)
    padded = torch.zeros(n, k + 8, dtype=torch.bfloat16, device="cuda")
    padded[:, :k] = w
    assert_matches(gemv(x, padded[:, :k]), x.double() @ w.double().T, torch.bfloat16)
    assert len(calls) == 3
    x3, _ = _inputs(3, n, k, torch.bfloat16, "cuda")
    gemv(x3, w)
    assert len(calls) == 3, "three rows take the Triton kernel"


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 3, 16])
@pytest.mark.parametrize("n, k", LLAMA3_8B, ids=str)
def test_gemv_on_the_gpu_matches_float64_at_llama_widths(n, k, batch):
    x, w = _inputs(batch, n, k, torch.bfloat16, "cuda")
    # bf16 output: rounded once, 2^-9 relative; fp32 sums of 4096-14336 exact products
    assert_matches(gemv(x, w), x.double() @ w.double().T, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 2, 4, 13])
def test_every_tile_the_autotuner_may_pick_is_correct_on_the_gpu(batch):
    x, w = _inputs(batch, 777, 1000, torch.bfloat16, "cuda")  # tails in N and K, unaligned rows
    x2, w2 = _inputs(batch, 1536, 2048, torch.bfloat16, "cuda")  # the unmasked, vectorized loop
    for config in _configs_for(CONFIGS, {}, BLOCK_B=triton.next_power_of_2(batch)):
        tiles = dict(config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)
        assert_matches(gemv(x, w, config=tiles), x.double() @ w.double().T, torch.bfloat16)
        assert_matches(gemv(x2, w2, config=tiles), x2.double() @ w2.double().T, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_gemv_on_the_gpu_in_fp16_and_fp32(dtype):
    for batch in (1, 8):
        x, w = _inputs(batch, 4096, 4096, dtype, "cuda")
        assert_matches(gemv(x, w), x.double() @ w.double().T, dtype)


@pytest.mark.gpu
def test_op_on_the_gpu_runs_our_kernel_and_compiles_with_inductor():
    from kforge.ops.gemv import ours_can_run

    x, w = _inputs(4, 6144, 4096, torch.bfloat16, "cuda")
    assert ours_can_run(x, w)
    compiled = torch.compile(lambda a, b: gemv_op(a, b), fullgraph=True)
    assert_matches(compiled(x, w), x.double() @ w.double().T, torch.bfloat16)
    assert_matches(gemv_op(x[1], w), x[1].double() @ w.double().T, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("n, k, epilogue", [(4096, 14336, EPI_RESIDUAL), (14336, 4096, EPI_SWIGLU),
                                            (777, 1000, EPI_RESIDUAL), (777, 1000, EPI_SWIGLU)], ids=str)
def test_fused_epilogues_on_the_gpu_give_the_unfused_pairs_bits(n, k, epilogue, batch):
    """Llama-3-8B's down projection with the residual and its gate/up projection with SwiGLU,
    and odd widths: one token on gemv_rows.cu, three on the Triton kernel, each against the GEMV
    then `kforge.ops.swiglu` or the add, as the decode step ran them unfused."""
    from kforge.ops.swiglu import swiglu

    rows = 2 * n if epilogue == EPI_SWIGLU else n
    x, w = _inputs(batch, rows, k, torch.bfloat16, "cuda")
    residual = torch.randn(batch, n, device="cuda").to(torch.bfloat16)
    if epilogue == EPI_RESIDUAL:
        got, unfused = gemv_residual(x, w, residual), residual + gemv_op(x, w)
    else:
        got, unfused = gemv_swiglu(x, w), swiglu(gemv_op(x, w))
    assert torch.equal(got, unfused)


def test_the_launch_refuses_a_residual_without_its_epilogue_and_the_epilogue_without_one():
    # the autotuned launch lends y as the residual argument when there is none (one tuned tile
    # for the plain and residual-add GEMVs): a residual-add with none would add y's garbage
    from kforge.kernels.serving.gemv import launch_gemv

    x, w = torch.randn(2, 64), torch.randn(32, 64)
    with pytest.raises(ValueError, match="a residual goes with EPI_RESIDUAL"):
        launch_gemv(x, w, None, epilogue=EPI_RESIDUAL)
    with pytest.raises(ValueError, match="a residual goes with EPI_RESIDUAL"):
        launch_gemv(x, w, None, epilogue=EPI_NONE, residual=torch.randn(2, 32))

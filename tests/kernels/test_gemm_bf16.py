"""The bf16 GEMM ladder: every Hopper rung compiled for sm_90a and its machine code checked
(on any machine), the Triton kernel under the interpreter, kforge.ops.matmul as a custom
op; on a GPU, every rung and both B layouts on odd shapes against a float64 reference."""

import json
import math
import re
import subprocess
import sys

import pytest
import torch

from kforge.bench import bench_rows, geomean
from kforge.bench.gemm import gemm_label, gemm_shapes
from kforge.kernels import gemm_bf16
from kforge.kernels.gemm_bf16 import RUNGS, LaunchError, gemm, rung
from kforge.kernels.gemm_bf16 import triton_matmul
from kforge.ops import matmul
from kforge.runtime.cuda import compile_cuda, resources, sass

ODD_SHAPES = [(1, 8, 8), (67, 48, 72), (129, 136, 72), (257, 264, 4104), (1000, 520, 1032)]


def test_every_rung_file_is_registered_and_says_what_it_changed():
    files = sorted(p.name for p in gemm_bf16.HERE.glob("*.cu"))
    assert files == [r.source.name for r in RUNGS]
    for r in RUNGS:
        text = r.source.read_text()
        assert text.splitlines()[0].startswith(f"// Rung {r.number}: "), r.source.name
        assert "Predicted" in text and "What changed" in text, r.source.name


@pytest.mark.parametrize("b_layout", gemm_bf16.B_LAYOUTS)
@pytest.mark.slow
def test_the_ampere_rung_assembles_to_mma_sync_ldmatrix_and_cp_async_without_spills(b_layout):
    cubin = compile_cuda(rung(1).source, arch="sm_90a", defines={"B_KMAJOR": int(b_layout == "nk")})
    code = sass(cubin)
    assert len(re.findall(r"\bHMMA\.16816\.F32\.BF16\b", code)) == 128, "32 mma.sync per k16 step, 4 steps a tile"
    assert "LDGSTS" in code and "LDSM.16.M88.4" in code
    assert ("LDSM.16.MT88.4" in code) == (b_layout == "kn"), "a K x N B is transposed by ldmatrix.trans"
    assert "HGMMA" not in code and "UTMALDG" not in code
    used = resources(cubin)["gemm"]
    assert (used.spill_stores, used.spill_loads, used.stack_bytes) == (0, 0, 0)
    assert used.registers <= 65536 // (2 * 128), "two 128-thread blocks must fit an SM's registers"


@pytest.mark.parametrize("b_layout", gemm_bf16.B_LAYOUTS)
@pytest.mark.parametrize("step", [r for r in RUNGS if not r.pointers], ids=lambda r: r.label)
@pytest.mark.slow
def test_hopper_rungs_assemble_to_wgmma_and_tma_without_spills(step, b_layout):
    cubin = compile_cuda(step.source, arch="sm_90a", defines={"B_KMAJOR": int(b_layout == "nk")})
    code = sass(cubin)
    tile_n = step.parameters()["BN"]
    assert re.search(rf"\bHGMMA\.64x{tile_n}x16\.F32\.BF16\b", code), "no wgmma in the machine code"
    assert "UTMALDG" in code, "no TMA loads"
    if b_layout == "kn":
        assert ".tnspB" in code, "a K x N B must be read N-major (transposed) by wgmma"
    used = resources(cubin)["gemm"]
    assert (used.spill_stores, used.spill_loads, used.stack_bytes) == (0, 0, 0)
    assert not re.search(r"\b(STL|LDL)\b", code), "local memory in the machine code"
    if step.number >= 3:  # warp-specialized: registers move from the producer to the consumers
        assert "USETMAXREG.DEALLOC" in code and "USETMAXREG.TRY_ALLOC" in code
        assert "C7508" not in cubin.ptxas_log, "ptxas ignored setmaxnreg"
    if step.persistent:
        assert "UTMASTG" in code, "the persistent rungs store C through TMA"
    assert ("MULTICAST" in code) == (step.number == 5), "only rung 5 multicasts"


@pytest.mark.slow
def test_sweep_variants_compile_without_spills_and_fit_shared_memory():
    for number, defines in gemm_bf16.SWEEP:
        step = rung(number)
        assert step.shared_bytes(step.parameters(defines)) <= 227 * 1024
        for b_kmajor in (0, 1):
            used = resources(compile_cuda(step.source, arch="sm_90a", defines={**defines, "B_KMAJOR": b_kmajor}))["gemm"]
            assert (used.spill_stores, used.spill_loads, used.stack_bytes) == (0, 0, 0), (number, defines)


@pytest.mark.slow
def test_norm_a_builds_compile_without_spills_or_serialized_wgmmas():
    """Rungs 4 and 5 with the RMSNorm on A (what `gemm(norm_weight=...)` compiles): no spills,
    A from registers into wgmma, ptxas not serializing the wgmmas (its C7513 note, which
    a register fragment written while a wgmma group stays in flight brings), and gamma read
    from shared memory only."""
    a, b = torch.empty(256, 512, dtype=torch.bfloat16), torch.empty(512, 384, dtype=torch.bfloat16)
    for number, width in ((4, 256), (5, 256), (4, 192)):
        step = rung(number)
        defines = {"BN": width, **gemm_bf16._epilogue_defines(step, a, b, "kn", None, "none", None,
                                                               torch.empty(512, dtype=torch.bfloat16))}
        assert defines["NORM_A"] == 1 and step.shared_bytes(step.parameters(defines)) <= 227 * 1024
        for b_kmajor in (0, 1):
            cubin = compile_cuda(step.source, arch="sm_90a", defines={**defines, "B_KMAJOR": b_kmajor})
            used = resources(cubin)["gemm"]
            assert (used.spill_stores, used.spill_loads, used.stack_bytes) == (0, 0, 0), (number, width, b_kmajor)
            code = sass(cubin)
            assert re.search(rf"HGMMA\.64x{width}x16\.F32\.BF16 R\d+, R\d+, gdesc", code), "A from registers"
            assert "C7513" not in cubin.ptxas_log, "ptxas serialized the wgmmas"
            # gamma arrives with each stage and is read with LDS: a global or generic load in the
            # consumers' loop cost 8% (docs/worklogs/serving.md)
            assert re.search(r"\bLDS\b", code) and not re.search(r"\bLDG\.|\bLD\.E\b", code), (number, b_kmajor)


@pytest.mark.parametrize("b_kmajor", [0, 1])
@pytest.mark.slow
def test_fused_epilogues_compile_without_spills_with_two_mufu_ops_a_value(b_kmajor):
    """Rung 4's bias/activation/residual combinations: no spills at the 168-register cap, and the
    activations evaluated branch-free: one ex2 and one reciprocal per value (128 per thread:
    a 64 x 256 share over 128 threads), not libdevice's erff."""
    step = rung(4)
    plain_loads = sass(compile_cuda(step.source, arch="sm_90a", defines={"B_KMAJOR": b_kmajor})).count("LDG")
    for bias, residual in ((0, 0), (1, 0), (1, 1), (0, 1)):
        for name, act in gemm_bf16.ACTIVATIONS.items():
            if not (bias or act or residual) or (residual and act not in (0, 2)):  # (the models' combinations)
                continue
            cubin = compile_cuda(step.source, arch="sm_90a", defines={"B_KMAJOR": b_kmajor, "EPI_BIAS": bias,
                                                                      "EPI_ACT": act, "EPI_RESIDUAL": residual})
            used = resources(cubin)["gemm"]
            assert (used.spill_stores, used.spill_loads, used.stack_bytes) == (0, 0, 0), (bias, name, residual)
            code = sass(cubin)
            assert len(re.findall(r"\bMUFU\.EX2\b", code)) == (128 if act else 0), (bias, name)
            assert (code.count("LDG") > plain_loads) == bool(bias or residual), "the epilogue's only global loads"


@pytest.mark.parametrize("bad, message", [
    (lambda: gemm(_bf16(4, 16), _bf16(16, 8), 4, activation="relu"), "activation must be one of"),
    (lambda: gemm(_bf16(4, 16), _bf16(16, 8), 3, activation="gelu"), "needs a persistent rung"),
    (lambda: gemm(_bf16(4, 16), _bf16(16, 8), 4, bias=_bf16(16)), r"bias must be .* of shape \(8,\)"),
    (lambda: gemm(_bf16(4, 16), _bf16(16, 8), 4, bias=torch.ones(8)), "bias must be .*bf16"),
    (lambda: gemm(_bf16(4, 16), _bf16(8, 16), 4, b_layout="nk", bias=_bf16(16)), r"shape \(8,\)"),
    (lambda: gemm(_bf16(4, 16), _bf16(16, 8), 4, residual=_bf16(8, 4)), r"residual must be .* shape \(4, 8\)"),
    (lambda: gemm(_bf16(4, 16), _bf16(16, 8), 4, norm_weight=_bf16(8)), r"norm_weight must be .* shape \(16,\)"),
    (lambda: gemm(_bf16(4, 16), _bf16(16, 8), 6, norm_weight=_bf16(16)), "norm_weight needs rung 4 or 5"),
    (lambda: gemm(_bf16(4, 16), _bf16(16, 8), 4, norm_weight=_bf16(16), norm_eps=-1.0), "norm_eps must be"),
    (lambda: gemm(_bf16(4, 16), _bf16(16, 8), 4, norm_weight=_bf16(16), activation="silu"), "norm_weight takes no"),
])
def test_bad_epilogue_arguments_are_refused_before_any_kernel_runs(bad, message):
    with pytest.raises(LaunchError, match=message):
        bad()


def test_split_k_fills_idle_sms_only_and_keeps_enough_k_per_split():
    from kforge.kernels.gemm_bf16 import MIN_K_TILES_PER_SPLIT, auto_splits

    assert auto_splits(tiles=512, resident_ctas=132, k_tiles=64) == 1  # 4096^3: the tiles fill the SMs
    assert auto_splits(tiles=67, resident_ctas=132, k_tiles=64) == 1  # just over half full
    assert auto_splits(tiles=32, resident_ctas=132, k_tiles=16) == 4  # 1024^3 at 128 x 256: 128 CTAs busy
    assert auto_splits(tiles=16, resident_ctas=132, k_tiles=64) == 8
    assert auto_splits(tiles=16, resident_ctas=132, k_tiles=2 * MIN_K_TILES_PER_SPLIT) == 2  # short K caps it
    assert auto_splits(tiles=1, resident_ctas=132, k_tiles=3) == 1


def test_split_k_is_refused_where_it_cannot_run():
    a, b = _bf16(4, 16), _bf16(16, 8)
    with pytest.raises(LaunchError, match="split_k must be a positive int and the rung persistent"):
        gemm(a, b, 2, split_k=2)
    with pytest.raises(LaunchError, match="split_k must be a positive int"):
        gemm(a, b, 4, split_k=0)


def test_rungs_are_found_by_number_name_or_label():
    assert rung(4) is rung("4") is rung("persistent") is rung("04_persistent")
    with pytest.raises(LaunchError, match="no bf16 GEMM rung"):
        rung(9)


def _bf16(*shape):
    return torch.ones(*shape, dtype=torch.bfloat16)


@pytest.mark.parametrize("bad, message", [
    (lambda: gemm(_bf16(4, 16), _bf16(8, 8)), "inner dimensions differ"),
    (lambda: gemm(_bf16(4, 16), _bf16(8, 8), b_layout="nk"), "inner dimensions differ"),
    (lambda: gemm(torch.ones(4, 16), _bf16(16, 8)), "takes torch.bfloat16"),
    (lambda: gemm(_bf16(4, 12), _bf16(12, 8)), "multiples of 8"),
    (lambda: gemm(_bf16(4, 16), _bf16(16, 12)), "multiples of 8"),
    (lambda: gemm(_bf16(4, 16), _bf16(16, 8), b_layout="tn"), "b_layout must be"),
    (lambda: gemm(_bf16(16), _bf16(16, 8)), "must be a 2-D tensor"),
    (lambda: gemm(_bf16(4, 16), _bf16(16, 8)), "the kernels run on a CUDA device"),
])
def test_bad_arguments_are_refused_before_any_kernel_runs(bad, message):
    with pytest.raises(LaunchError, match=message):
        bad()


@pytest.mark.parametrize("b_layout", ["kn", "nk"])
@pytest.mark.parametrize("m, n, k", [(37, 48, 72), (1, 16, 8), (70, 40, 136)])
def test_triton_kernel_matches_fp32_under_the_interpreter(m, n, k, b_layout):
    torch.manual_seed(0)
    a = torch.randn(m, k, dtype=torch.float16)
    b = torch.randn(k, n, dtype=torch.float16) if b_layout == "kn" else torch.randn(n, k, dtype=torch.float16)
    got = triton_matmul.matmul(a, b, b_layout=b_layout, config=dict(BM=16, BN=16, BK=16, GROUP_M=2))
    expected = a.double() @ (b.double() if b_layout == "kn" else b.double().t())
    assert got.shape == (m, n) and got.dtype == torch.float16
    torch.testing.assert_close(got.double(), expected, atol=2e-2, rtol=2e-3)


def test_ops_matmul_is_a_custom_op_that_traces_and_differentiates():
    torch.manual_seed(0)
    a, b = torch.randn(5, 8, requires_grad=True), torch.randn(8, 3, requires_grad=True)
    out = matmul(a, b)  # on CPU: the torch fallback, through the same op
    torch.testing.assert_close(out, a @ b)
    out.sum().backward()
    torch.testing.assert_close(a.grad, torch.ones(5, 3) @ b.detach().t())
    torch.testing.assert_close(b.grad, a.detach().t() @ torch.ones(5, 3))
    compiled = torch.compile(lambda x, y: matmul(x, y) * 2, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(a.detach(), b.detach()), 2 * (a.detach() @ b.detach()))
    torch.library.opcheck(matmul, (torch.randn(4, 8), torch.randn(8, 16)))
    with pytest.raises(RuntimeError, match="inner dimensions differ"):
        torch.compile(lambda x, y: matmul(x, y), backend="aot_eager", fullgraph=True)(torch.randn(4, 8),
                                                                                     torch.randn(7, 3))


def test_ops_matmul_picks_the_rung_by_tiles_waves_width_and_k():
    from kforge.ops.matmul import best_kernel

    assert best_kernel(1024, 1024, 1024) == (4, gemm_bf16.SPLIT_K_VARIANT)  # 32 tiles of 128 x 256
    assert best_kernel(16, 4096, 14336) == (4, gemm_bf16.SPLIT_K_VARIANT)
    assert best_kernel(16, 28672, 4096) == (4, {})  # 112 tiles: most SMs busy, one row tile
    assert best_kernel(4096, 4096, 4096) == (4, {})
    assert best_kernel(8192, 8192, 8192) == (4, {})  # rung 5 no faster since the overlapped epilogue
    assert best_kernel(2048, 2048, 2048) == (4, {})  # 128 tiles: one wave
    assert best_kernel(8192, 50304, 768) == (5, {})  # wide N, short K: clusters share B
    assert best_kernel(8192, 2304, 768) == (4, {})  # 576 tiles: 4.4 waves; of 192, 87% against 97% full
    # 128 x 256 tiles leaving SMs idle that 128 x 192 tiles would fill (tiles of 256 / of 192 on 132 SMs)
    assert best_kernel(8192, 768, 3072) == (4, gemm_bf16.NARROW_TILE)  # 192 tiles (1.45 waves) / 256 (1.94)
    assert best_kernel(512, 6144, 4096) == (4, gemm_bf16.NARROW_TILE)  # 96 / 128
    assert best_kernel(768, 4096, 4096) == (4, gemm_bf16.NARROW_TILE)  # 96 / 132
    assert best_kernel(1024, 4096, 4096) == (4, {})  # 128 / 176: 256 already fills one wave
    assert best_kernel(3072, 1024, 4096) == (6, {})  # 96 / 144: 192 leaves 1.09 waves, no better
    assert best_kernel(12608, 1024, 4096) == (4, {})  # 396 tiles: 3.0 waves
    assert best_kernel(16, 4096, 4096, sms=8) == (4, {})  # a smaller GPU fills up sooner


def test_bench_covers_squares_and_llama_projections_and_summarises_ratios():
    shapes = gemm_shapes()
    assert [s.label for s in shapes[:4]] == ["1024^3", "2048^3", "4096^3", "8192^3"]
    assert len(shapes) == 4 + 2 * 4 * 3 and {s.m for s in shapes[4:]} == {16, 128, 4096}
    assert all(s.b_layout == "nk" for s in shapes[4:])

    def record(method, ms, ref_ms, status="slower"):
        return {"candidate": {"name": method}, "status": status, "problem": {"name": "linear_bf16",
                "size": "M=16,N=4096,K=4096"}, "roofline": {"flops": 2e12},
                "gate2": {"stats": {"candidate": {"median_ms": ms}, "reference": {"median_ms": ref_ms}}}}

    rows = bench_rows([record("ours", 4.0, 2.0), record("triton", 1.0, 2.0, "passed"), record("ours", 2.0, 3.0)],
                      "cuBLAS", gemm_label)
    assert len(rows) == 1 and rows[0].shape == "linear M=16 N=4096 K=4096"
    assert rows[0].vs_baseline == {"ours": 1.5, "triton": 2.0}  # the latest record of each method wins
    assert rows[0].tflops["ours"] == pytest.approx(1000.0) and rows[0].tflops["cuBLAS"] == pytest.approx(1000.0)
    assert geomean([1.5, 2.0, None]) == pytest.approx(math.sqrt(3.0))


# --- on the GPU ------------------------------------------------------------------------


def _operands(m, n, k, b_layout):
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(*((k, n) if b_layout == "kn" else (n, k)), device="cuda", dtype=torch.bfloat16)
    return a, b, a.double() @ (b.double() if b_layout == "kn" else b.double().t())


def _assert_close(got, expected):
    assert not got.isnan().any(), "an element was never written"
    err = ((got.double() - expected).abs().max() / expected.abs().max()).item()
    assert err < 1e-2, f"max error {err:.2e} of the largest entry"


@pytest.mark.gpu
@pytest.mark.parametrize("b_layout", gemm_bf16.B_LAYOUTS)
@pytest.mark.parametrize("step", RUNGS, ids=lambda r: r.label)
def test_rungs_are_correct_on_odd_shapes(step, b_layout):
    torch.manual_seed(0)
    for m, n, k in ODD_SHAPES:
        a, b, expected = _operands(m, n, k, b_layout)
        torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")  # freed: the output reuses it
        _assert_close(gemm(a, b, step, b_layout=b_layout), expected)


@pytest.mark.gpu
@pytest.mark.parametrize("b_layout", gemm_bf16.B_LAYOUTS)
@pytest.mark.parametrize("number, defines", [(4, {}), (5, {}), (4, gemm_bf16.NARROW_TILE), (4, {
    "BN": 192, "EPI_OVERLAP": 0})], ids=["rung4", "rung5", "rung4-128x192", "rung4-128x192-after-kloop"])
def test_overlapped_epilogue_stores_every_tile_of_a_cta_with_several(number, defines, b_layout):
    """Rungs 4 and 5 store a tile's results under the next tile's k-loop, one 64-column slice
    every EPI_SPREAD (2) k-tiles: more tiles than SMs, so CTAs run several in turn, with K of 2
    and 3 k-tiles (room for one slice: the others go out after the k-loop) and of 9 (all
    under it), into a NaN-poisoned output. 128 x 192 tiles have 3 slices, an odd number for
    the two slice buffers: a tile's first slice must not take the buffer of the previous
    tile's last (short K: that store is still reading it), under the k-loop or after it."""
    torch.manual_seed(3)
    for m, n, k in ((2000, 2056, 72), (4000, 4104, 136), (3000, 2056, 520), (2000, 2056, 136)):
        a, b, expected = _operands(m, n, k, b_layout)
        torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")  # freed: the output reuses it
        for _ in range(3):
            _assert_close(gemm(a, b, number, b_layout=b_layout, defines=defines), expected)


@pytest.mark.gpu
@pytest.mark.parametrize("step", RUNGS, ids=lambda r: r.label)
def test_back_to_back_calls_each_read_their_own_operands(step):
    """The lean launch path rewrites one plan's tensor maps and arguments on every call: calls
    queued without a synchronize between them must still each see their own buffers."""
    torch.manual_seed(2)
    operands = [_operands(200, 264, 520, "nk") for _ in range(4)]
    results = [gemm(a, b, step, b_layout="nk") for a, b, _ in operands]
    for got, (_, _, expected) in zip(results, operands):
        _assert_close(got, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("b_layout", gemm_bf16.B_LAYOUTS)
@pytest.mark.parametrize("m, n, k, split_k", [
    (16, 512, 4096, 8), (1, 136, 1032, 3), (130, 264, 520, 2), (67, 128, 72, 3),  # 2 k-tiles, 3 splits: one empty
    (300, 1024, 2048, None),  # auto
])
def test_split_k_sums_every_split_once_and_leaves_the_counters_ready(m, n, k, split_k, b_layout):
    torch.manual_seed(4)
    for _ in range(3):  # the counters must be back at zero for the next launch of the same plan
        a, b, expected = _operands(m, n, k, b_layout)
        got = gemm(a, b, 4, b_layout=b_layout, defines=gemm_bf16.SPLIT_K_VARIANT, split_k=split_k)
        _assert_close(got, expected)
    plan = next(p for key, p in gemm_bf16._PLANS.items() if key[3:6] == (m, n, k) and key[-1] == split_k
                and key[1] == b_layout)
    assert plan.splits == (split_k or plan.splits) and (plan.splits > 1) == bool(plan.workspace)
    if plan.workspace:
        assert int(plan.workspace[1].abs().sum()) == 0
    with pytest.raises(LaunchError, match="SPLIT_K=1"):
        gemm(a, b, 4, b_layout=b_layout, split_k=2)


@pytest.mark.gpu
@pytest.mark.parametrize("number, defines", [(4, {}), (4, gemm_bf16.SPLIT_K_VARIANT), (6, {}),
                                             (4, gemm_bf16.NARROW_TILE)],
                         ids=["rung4", "rung4-split-k", "rung6", "rung4-128x192"])
@pytest.mark.parametrize("activation", list(gemm_bf16.ACTIVATIONS))
def test_fused_epilogue_matches_float64_on_odd_shapes(number, defines, activation):
    """act(a @ b + bias) [+ residual] against float64, outputs ~N(0, 1) so every activation's
    curve is exercised, with and without the bias and the residual, both layouts; rows and
    columns past C read no bias or residual. 2000 x 2056: CTAs with several tiles, whose
    epilogue (bias, tanh-GELU, SiLU) rung 4 runs under the next tile's k-loop."""
    torch.manual_seed(5)
    for b_layout in gemm_bf16.B_LAYOUTS:
        for m, n, k in [(67, 48, 72), (257, 264, 4104), (300, 1032, 520), (2000, 2056, 136)]:
            a, b, product = _operands(m, n, k, b_layout)
            a, product = a / k**0.5, product / k**0.5  # (a power of two apart only when k is: rescale exactly)
            a = a.to(torch.bfloat16)
            product = a.double() @ (b.double() if b_layout == "kn" else b.double().t())
            residual = torch.randn(m, n, device="cuda").to(torch.bfloat16)
            for bias, res in ((None, None), (torch.randn(n, device="cuda").to(torch.bfloat16), None),
                              (torch.randn(n, device="cuda").to(torch.bfloat16), residual), (None, residual)):
                got = gemm(a, b, number, b_layout=b_layout, defines=defines, bias=bias, activation=activation,
                           residual=res)
                want = gemm_bf16.epilogue_reference(product, bias, activation, res)
                assert not got.isnan().any()
                err = ((got.double() - want).abs() / (1 + want.abs())).max().item()
                assert err < 1e-2, (b_layout, (m, n, k), bias is not None, res is not None, err)


@pytest.mark.gpu
@pytest.mark.parametrize("number, width", [(4, 256), (5, 256), (4, 192)])
def test_norm_a_is_rmsnorm_of_a_before_the_product(number, width):
    """rmsnorm(a; gamma, eps) @ b against float64 (the normed rows rounded to bf16 as the
    kernel rounds a * gamma); K tails (TMA's zero fill adds no squares), rows past M, several
    tiles a CTA, twice (each plan's row sums start from zero); 128 x 256 and 128 x 192 tiles."""
    torch.manual_seed(6)
    for b_layout in gemm_bf16.B_LAYOUTS:
        for m, n, k in [(67, 48, 72), (300, 1032, 520), (2000, 2056, 136)]:
            a, b, _ = _operands(m, n, k, b_layout)
            a = a * torch.linspace(0.1, 10, m, device="cuda")[:, None].to(torch.bfloat16)  # rows of different rms
            gamma = (torch.rand(k, device="cuda") + 0.5).to(torch.bfloat16)
            r = torch.rsqrt(a.double().pow(2).mean(-1, keepdim=True) + 1e-5)
            normed = (a.double() * gamma.double()).to(torch.bfloat16).double() * r
            product = normed @ (b.double() if b_layout == "kn" else b.double().t())
            for _ in range(2):
                _assert_close(gemm(a, b, number, b_layout=b_layout, defines={"BN": width}, norm_weight=gamma,
                                   norm_eps=1e-5), product)


@pytest.mark.gpu
def test_threads_launching_the_same_shape_get_their_own_plans():
    from concurrent.futures import ThreadPoolExecutor

    torch.manual_seed(3)
    operands = [_operands(300, 256, 512, "kn") for _ in range(8)]

    def one(i):
        a, b, _ = operands[i]
        return gemm(a, b, 4)

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(8)))
    torch.cuda.synchronize()
    for got, (_, _, expected) in zip(results, operands):
        _assert_close(got, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("number, defines", gemm_bf16.SWEEP)
def test_sweep_variants_are_correct(number, defines):
    torch.manual_seed(1)
    for b_layout in gemm_bf16.B_LAYOUTS:
        a, b, expected = _operands(333, 520, 1096, b_layout)
        _assert_close(gemm(a, b, number, b_layout=b_layout, defines=defines), expected)


@pytest.mark.gpu
@pytest.mark.parametrize("b_layout", gemm_bf16.B_LAYOUTS)
@pytest.mark.parametrize("m, n, k", [(1100, 4104, 4000), (2048, 8192, 1000)])
def test_stream_k_shares_add_up_to_the_product_bit_for_bit_on_every_call(m, n, k, b_layout):
    """Rung 4's stream-K tail on shapes whose last wave it shares out (a tile split among up to
    seven CTAs at 1100 x 4104 x 4000, two at 2048 x 8192 x 1000, a K tail in the first): right,
    with a fused epilogue too, and the same bits on every call (the shares are added in CTA order,
    and the per-tile counters reset for the next launch)."""
    ctas = torch.cuda.get_device_properties(0).multi_processor_count
    tiles, k_tiles = -(-m // 128) * -(-n // 256), -(-k // 64)
    assert (tiles % ctas) * k_tiles >= 8 * ctas, "the shape must reach the stream-K path"
    torch.manual_seed(5)
    a, b, expected = _operands(m, n, k, b_layout)
    first = gemm(a, b, 4, b_layout=b_layout, defines=gemm_bf16.STREAM_K_VARIANT)
    _assert_close(first, expected)
    for _ in range(3):
        assert torch.equal(gemm(a, b, 4, b_layout=b_layout, defines=gemm_bf16.STREAM_K_VARIANT), first)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    got = gemm(a, b, 4, b_layout=b_layout, defines=gemm_bf16.STREAM_K_VARIANT, bias=bias, activation="gelu")
    _assert_close(got, torch.nn.functional.gelu(expected + bias.double()))


_TRITON_SHARED_BYTES = """
import json, os
os.environ["TRITON_INTERPRET"] = "0"  # compile for sm_90, even on a machine with no GPU
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kforge.kernels.gemm_bf16 import triton_matmul

fn, found = triton_matmul.matmul_persistent, []
for c in triton_matmul.CONFIGS:
    bm, bn, bk = (c.kwargs[key] for key in ("BM", "BN", "BK"))
    types = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32"}
    source = ASTSource(fn=fn, signature={name: types.get(name, "constexpr") for name in fn.arg_names},
                       constexprs=dict(c.kwargs, NUM_PROGRAMS=132, B_KMAJOR=0),
                       attrs={(i,): [["tt.divisibility", 16]] for i in range(3)})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": c.num_warps, "num_stages": c.num_stages})
    found.append([dict(c.kwargs, num_stages=c.num_stages), compiled.metadata.shared])
print(json.dumps(found))
"""


@pytest.mark.slow
def test_every_triton_config_fits_the_shared_memory_of_an_h100():
    # Compiled for sm_90 on any machine: a config over the limit would be skipped by the
    # autotuner without a word, and fail when asked for by name.
    done = subprocess.run([sys.executable, "-c", _TRITON_SHARED_BYTES], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(found) == len(triton_matmul.CONFIGS)
    for config, shared in found:
        assert 0 < shared <= 227 * 1024, (config, shared)


@pytest.mark.gpu
@pytest.mark.parametrize("b_layout", ["kn", "nk"])
def test_triton_kernel_on_the_gpu(b_layout):
    torch.manual_seed(2)
    for m, n, k in [(67, 48, 72), (1000, 520, 1032)]:
        a, b, expected = _operands(m, n, k, b_layout)
        _assert_close(triton_matmul.matmul(a, b, b_layout=b_layout), expected)
        for config in triton_matmul.CONFIGS:  # every tile the autotuner may pick, flattened loops included
            tiles = dict(config.kwargs, num_stages=config.num_stages, num_warps=config.num_warps)
            _assert_close(triton_matmul.matmul(a, b, b_layout=b_layout, config=tiles), expected)


@pytest.mark.gpu
def test_ops_matmul_uses_our_kernel_for_both_layouts_and_compiles():
    torch.manual_seed(3)
    a, w, expected = _operands(300, 264, 520, "nk")
    _assert_close(matmul(a, w.t()), expected)  # a linear layer's weight, read as it lies
    _assert_close(matmul(a, w.t().contiguous()), expected)
    odd = torch.randn(300, 513, device="cuda", dtype=torch.bfloat16)  # K = 513: the torch fallback
    torch.testing.assert_close(matmul(odd, torch.ones(513, 8, device="cuda", dtype=torch.bfloat16)),
                               odd @ torch.ones(513, 8, device="cuda", dtype=torch.bfloat16))
    compiled = torch.compile(lambda x, y: matmul(x, y).relu(), fullgraph=True)
    _assert_close(compiled(a, w.t()), expected.relu())

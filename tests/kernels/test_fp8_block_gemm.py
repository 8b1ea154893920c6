"""The block-scaled FP8 GEMM in CUDA (`kernels/quant/fp8_block_gemm.cu`).

On any machine: the source compiled for sm_90a has the fp8 tensor-core instruction (QGMMA
on e4m3) four times a half (one 128-deep K block), one wgmma wait a half, no spills, no
wgmma serialized by ptxas, and no global loads between the chains (the scales come through
shared memory); the ring fits shared memory; bad inputs are refused with one
line. On a GPU: odd shapes and tails against float64 into NaN-poisoned outputs, every ring
depth, DeepGEMM's M-major and broadcast scales, the DeepGEMM shape, and the speed against
torch._scaled_mm rowwise (printed). The GROUPED build (MoE's contiguous grouped GEMM): compiled,
its rows stored from registers, clusters refused; its GPU tests are in test_moe_grouped_gemm.py.
"""

from __future__ import annotations

import re

import pytest
import torch

from kforge.kernels.quant.fp8_block_gemm import (DEEPEST, SOURCE, check_fp8_block_gemm_inputs,
                                                 check_fp8_grouped_inputs, fp8_block_gemm, shared_bytes)
from kforge.kernels.quant.fp8_gemm import fp8_gemm_flops
from test_fp8_gemm import BF16_STEP, GPU_PROMOTED, assert_close, exact, quantized


@pytest.mark.parametrize("cluster", [1, 2])
@pytest.mark.parametrize("block_n", [128, 256])
@pytest.mark.slow
def test_the_kernel_compiles_to_fp8_wgmma_without_serialization_or_spills(block_n, cluster):
    from kforge.runtime.cuda import compile_cuda, resources, sass

    defines = {"BN": block_n, "STAGES": DEEPEST[block_n], "CLUSTER_M": cluster}
    cubin = compile_cuda(SOURCE, arch="sm_90a", defines=defines)
    used = resources(cubin)["fp8_block_gemm"]
    assert (used.spill_stores, used.spill_loads, used.stack_bytes) == (0, 0, 0)
    # C7514/C7517: ptxas found accumulator registers read while a wgmma may still write them,
    # and waited after every instruction
    assert "C7514" not in cubin.ptxas_log and "C7517" not in cubin.ptxas_log, cubin.ptxas_log
    code = sass(cubin)
    halves = block_n // 128
    assert len(re.findall(r"\bQGMMA\.64x128x32\.F32\.E4M3\.E4M3\b", code)) == 4 * halves, "a K block: 4 x k32 a half"
    assert re.findall(r"\bWARPGROUP\.DEPBAR\.LE gsb0, (0x[01])", code) == ["0x0"] * halves, \
        "one wait for all a half, before its promotion"
    assert len(re.findall(r"\bFFMA\b", code)) >= 64 * halves, "the promotion: acc += partial * scale"
    # the consumers read their scales from the stage's slot; only the producer's loaders go to global
    # memory (ptxas lays the consumers' branch out first: everything up to the last chain is theirs)
    consumers = code[:code.rindex("QGMMA")]
    assert "LDG" not in consumers and "LD.E" not in consumers, "no global loads in the consumers"
    assert re.search(r"\bLDS\b", consumers), "the scales from shared memory"
    assert "LDG.E.CONSTANT" in code[code.rindex("QGMMA"):], "the loaders' scale loads"


@pytest.mark.parametrize("block_n", [128, 256])
@pytest.mark.slow
def test_the_grouped_build_keeps_the_mainloop_and_stores_padded_slabs_from_registers(block_n, monkeypatch):
    """GROUPED: the same chains (QGMMA four times a half) with no spills and its promotion rewritten;
    a slab of 64 rows all the expert's stores through TMA as the plain build does, the others from
    registers, 4-byte stores, two rows of 16 pairs a half per thread (padding rows must stay
    unwritten), the choice one warp vote; with clusters it does not compile."""
    from kforge.kernels.quant import fp8_block_gemm as module
    from kforge.runtime.cuda import CudaCompileError, compile_cuda, resources, sass

    defines = {"BN": block_n, "STAGES": DEEPEST[block_n], "CLUSTER_M": 1}
    plain, grouped = (compile_cuda(SOURCE, arch="sm_90a", defines={**defines, **extra})
                      for extra in ({}, {"GROUPED": 1}))
    used = resources(grouped)["fp8_block_gemm"]
    assert (used.spill_stores, used.spill_loads, used.stack_bytes) == (0, 0, 0)
    halves = block_n // 128
    count = lambda pattern, cubin: len(re.findall(pattern, sass(cubin)))
    assert count(r"\bQGMMA\.64x128x32\.F32\.E4M3\.E4M3\b", grouped) == 4 * halves
    assert count(r"\bSTG\.E\b", grouped) == 2 * 16 * halves and count(r"\bVOTE\.ALL\b", grouped) == 1
    assert count(r"\bUTMASTG\b", grouped) == count(r"\bUTMASTG\b", plain) == 2 * halves
    assert count(r"\bSTG\.E\b", plain) == 0
    monkeypatch.setattr(module, "compile_cuda", lambda source, defines: compile_cuda(source, arch="sm_90a",
                                                                                     defines=defines))
    monkeypatch.setattr(module, "_KERNELS", {})
    kernel = module.compiled_kernel(DEEPEST[block_n], block_n, 1, grouped=True)
    assert kernel.cubin.key.endswith(f"+promotion-{module.PROMOTION}"), "the promotion rewritten as ungrouped"
    with pytest.raises(CudaCompileError, match="no shared B"):
        compile_cuda(SOURCE, arch="sm_90a", defines={**defines, "GROUPED": 1, "CLUSTER_M": 2})


def test_the_grouped_kernel_refuses_what_it_cannot_take_with_one_line():
    x, w, sa, sb = quantized(256, 64, 256, "block")
    experts_w, experts_sb = w[None].expand(2, -1, -1).contiguous(), sb[None].expand(2, -1, -1).contiguous()
    m_indices = torch.zeros(256, dtype=torch.int32)
    with pytest.raises(ValueError, match="align must be a multiple of 128, got 64"):
        check_fp8_grouped_inputs(x, experts_w, m_indices, sa, experts_sb, 64)
    with pytest.raises(ValueError, match="N = 60: .* multiple of 8"):
        check_fp8_grouped_inputs(x, experts_w[:, :60], m_indices, sa, experts_sb, 128)
    with pytest.raises(ValueError, match="needs a Hopper GPU"):
        check_fp8_grouped_inputs(x, experts_w, m_indices, sa, experts_sb, 128)


def test_the_default_ring_is_the_deepest_that_fits_and_deeper_is_refused():
    assert DEEPEST == {128: 6, 256: 4}
    for block_n, stages in DEEPEST.items():
        assert shared_bytes(stages, block_n) <= 227 * 1024 < shared_bytes(stages + 1, block_n)
    a, b, sa, sb = quantized(64, 128, 256, "block")
    with pytest.raises(ValueError, match="must be one of"):
        fp8_block_gemm(a, b, sa, sb, block_n=192)
    with pytest.raises(ValueError, match="bytes of shared memory; at most"):
        fp8_block_gemm(a, b, sa, sb, block_n=256, stages=5)


def test_inputs_the_kernel_cannot_take_are_refused_with_one_line():
    a, b, sa, sb = quantized(64, 128, 256, "block")
    with pytest.raises(ValueError, match="needs a Hopper GPU"):
        check_fp8_block_gemm_inputs(a, b, sa, sb)
    with pytest.raises(ValueError, match="multiple of 128"):
        check_fp8_block_gemm_inputs(a[:, :200], b[:, :200], sa, sb)
    with pytest.raises(ValueError, match="promotion must be one of"):
        fp8_block_gemm(a, b, sa, sb, promotion="fastest")


@pytest.mark.slow
def test_the_kernel_is_loaded_with_its_promotion_rewritten_or_as_compiled_with_a_warning(monkeypatch):
    """fp8_block_gemm's kernel: the compiled cubin with PROMOTION's scheduling bits; where the
    rewrite cannot run (no cuobjdump), the compiled cubin itself, and a warning says so."""
    from kforge.errors import KforgeError
    from kforge.kernels.quant import fp8_block_gemm as module
    from kforge.runtime import sass_control
    from kforge.runtime.cuda import compile_cuda

    monkeypatch.setattr(module, "compile_cuda", lambda source, defines: compile_cuda(source, arch="sm_90a",
                                                                                     defines=defines))
    monkeypatch.setattr(module, "_KERNELS", {})
    rewritten = module.compiled_kernel(4, 256, 2)
    assert rewritten.cubin.key.endswith(f"+promotion-{module.PROMOTION}")
    assert module.compiled_kernel(4, 256, 2) is rewritten, "kept per variant"
    assert module.compiled_kernel(4, 256, 2, "ptxas").cubin.key == rewritten.cubin.key.split("+")[0]

    def unavailable(*args, **kwargs):
        raise KforgeError("cuobjdump not found")

    monkeypatch.setattr(sass_control, "rewrite_promotion", unavailable)
    with pytest.warns(UserWarning, match="runs as compiled .*cuobjdump not found"):
        fallback = module.compiled_kernel(4, 128, 2)
    assert "+" not in fallback.cubin.key


# --- on the GPU ----------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("block_n, stages, cluster", [(128, 4, 1), (128, 5, 1), (128, 6, 1), (256, 3, 1), (256, 4, 1),
                                                     (128, 6, 2), (256, 3, 2), (256, 4, 2)])
@pytest.mark.parametrize("m, n, k", [(1, 8, 128), (67, 520, 1152), (333, 200, 4096), (256, 384, 256),
                                     (1000, 1032, 2048)])
def test_matches_float64_on_odd_shapes(m, n, k, block_n, stages, cluster, nan_outputs):
    """M and N tails inside a tile (1, 67, 333, 1000 rows; 8, 200, 520, 1032 columns), a single
    K block, more tiles than SMs (1000 x 1032: 8 x 9 = 72 tiles, fewer; 2048 K: 16 blocks); ring
    depths with 1, 2 and 3 scale loaders (5, 4 and 3 or 6 stages)."""
    a, b, sa, sb = quantized(m, n, k, "block", device="cuda", seed=m + n)
    got = fp8_block_gemm(a, b, sa, sb, block_n=block_n, stages=stages, cluster=cluster)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    assert_close(got, exact(a, b, sa, sb, "block"), BF16_STEP + GPU_PROMOTED, GPU_PROMOTED)


@pytest.mark.gpu
def test_many_tiles_and_every_scale_layout(nan_outputs):
    """2900 x 4104: 23 x 33 tiles of 128 x 128 (759, ~six a CTA); 2900 = 22.7 x 128, so the last
    row tile is partial and, in clusters of two, the 24th CTA lies wholly past M (it reads
    zeros, stores nothing, and still multicasts its share of B to its peer). M-major a_scale
    (DeepGEMM's), and scales broadcast from rows (stride 0 along K, as the bench's problem
    passes them)."""
    m, n, k = 2900, 4104, 1024
    a, b, sa, sb = quantized(m, n, k, "block", device="cuda")
    want = exact(a, b, sa, sb, "block")
    row_a, row_b = sa[:, :1].expand(-1, k // 128), sb[:, :1].expand(-1, k // 128)
    assert row_a.stride(1) == 0
    for block_n, cluster in ((128, 1), (256, 1), (256, 2), (128, 2)):
        tile = dict(block_n=block_n, cluster=cluster)
        assert_close(fp8_block_gemm(a, b, sa, sb, **tile), want, BF16_STEP + GPU_PROMOTED, GPU_PROMOTED)
        m_major = sa.t().contiguous().t()
        assert_close(fp8_block_gemm(a, b, m_major, sb, **tile), want, BF16_STEP + GPU_PROMOTED, GPU_PROMOTED)
        assert_close(fp8_block_gemm(a, b, row_a, row_b, **tile), exact(a, b, row_a, row_b, "block"),
                     BF16_STEP + GPU_PROMOTED, GPU_PROMOTED)


@pytest.mark.gpu
@pytest.mark.parametrize("block_n", [128, 256])
def test_every_promotion_schedule_computes_the_same_bits(block_n):
    """runtime/sass_control.py's rewrites of the promotion's yield and reuse bits (the default,
    PROMOTION, and the others the variants script times) change the schedule, never the numbers:
    bit for bit the kernel as ptxas compiled it, and float64's within the usual bound, on tails
    and 16 K blocks."""
    from kforge.kernels.quant.fp8_block_gemm import PROMOTION
    from kforge.runtime.sass_control import STYLES

    m, n, k = 1000, 1032, 2048
    a, b, sa, sb = quantized(m, n, k, "block", device="cuda", seed=7)
    compiled = fp8_block_gemm(a, b, sa, sb, block_n=block_n, promotion="ptxas")
    assert_close(compiled, exact(a, b, sa, sb, "block"), BF16_STEP + GPU_PROMOTED, GPU_PROMOTED)
    assert PROMOTION != "ptxas"
    for style in STYLES:
        assert torch.equal(fp8_block_gemm(a, b, sa, sb, block_n=block_n, promotion=style), compiled), style


@pytest.mark.gpu
def test_at_the_deepgemm_shape_matches_float64_and_its_speed_is_printed():
    import triton

    from kforge.kernels.quant.fp8_gemm import fp8_gemm

    m, n, k = 4096, 7168, 16384
    a, b, sa, sb = quantized(m, n, k, "block", device="cuda")
    want = exact(a, b, sa, sb, "block")
    for block_n, cluster in ((128, 1), (256, 1), (256, 2)):
        assert_close(fp8_block_gemm(a, b, sa, sb, block_n=block_n, cluster=cluster), want, BF16_STEP + GPU_PROMOTED,
                     GPU_PROMOTED)
    ra, rb, rsa, rsb = quantized(m, n, k, "row", device="cuda")
    runs = {"CUDA block 128": lambda: fp8_block_gemm(a, b, sa, sb, block_n=128, cluster=1),
            "CUDA block 256": lambda: fp8_block_gemm(a, b, sa, sb, cluster=1),
            "CUDA block 256 x2": lambda: fp8_block_gemm(a, b, sa, sb),
            "Triton block": lambda: fp8_gemm(a, b, sa, sb, prefer_cuda=False),
            "_scaled_mm row": lambda: torch._scaled_mm(ra, rb.t(), scale_a=rsa, scale_b=rsb.reshape(1, n),
                                                       out_dtype=torch.bfloat16)}
    for run in runs.values():
        run()
    tflops = {name: fp8_gemm_flops(m, n, k) / triton.testing.do_bench(run, warmup=100, rep=500) / 1e9
              for name, run in runs.items()}
    print("\n" + "\n".join(f"{name:>16}: {value:7.1f} TFLOP/s" for name, value in tflops.items()))
    # the fp8 tensor cores run; the targets are the bench's to judge
    assert min(tflops[name] for name in tflops if name.startswith("CUDA")) > 400, tflops

"""The Blackwell (sm_100a) kernels of kernels/blackwell: tcgen05_gemm.cu (1-CTA and 2-CTA) and
nvfp4_gemm.cu (GEMM and batched GEMV). None of them has run on a GPU yet (docs/blackwell.md).

On any machine: each variant compiled by NVRTC for sm_100a has the machine code of its design
(tcgen05 MMAs with the instruction descriptor of its shape, commits, TMA loads, TMEM allocation
and loads, scale-factor copies for NVFP4, the 2-CTA forms for the pair), no spills, a register
budget; for sm_90a each compiles to a trap. The host side: the scale-factor packing against its
formula, the float64 reference, the argument checks and the refusal of any GPU but an sm_100.
On an sm_100 GPU (compute capability 10.0) only: every kernel against float64 into NaN-poisoned
outputs, edges and tails included.
"""

from __future__ import annotations

import re
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from kforge.errors import KforgeError
from kforge.kernels import blackwell
from kforge.kernels.blackwell import nvfp4_gemm as nvfp4
from kforge.kernels.blackwell import tcgen05_gemm as bf16
from kforge.kernels.quant.formats import quantize_nvfp4
from kforge.runtime.cuda import compile_cuda, resources, sass

# --- machine code for sm_100a, compiled on any machine ---------------------------------------

# (source, kernel, defines) of every variant the launchers use
VARIANTS = {
    "bf16-1cta": (bf16.SOURCE, "tcgen05_gemm", bf16.VARIANTS[False]),
    "bf16-2cta": (bf16.SOURCE, "tcgen05_gemm", bf16.VARIANTS[True]),
    "nvfp4-gemm": (nvfp4.SOURCE, "nvfp4_gemm", nvfp4.GEMM),
    "nvfp4-gemv": (nvfp4.SOURCE, "nvfp4_gemm", nvfp4.GEMV),
}
_COMPILED: dict[str, tuple] = {}


def compiled(variant: str):
    """(resources, sass text, opcode counts) of a variant for sm_100a, compiled once per session."""
    if variant not in _COMPILED:
        source, name, defines = VARIANTS[variant]
        cubin = compile_cuda(source, arch=blackwell.ARCH, defines=defines, cache=False)
        code = sass(cubin)
        lines = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][^;]*);", code)
        opcodes = Counter(line.split()[0] for line in lines)
        _COMPILED[variant] = (resources(cubin)[name], code, opcodes)
    return _COMPILED[variant]


def instruction_descriptor(code: str) -> int:
    """The 32-bit instruction descriptor the MMAs name (idesc[URx]), from the UMOV that sets URx."""
    (register,) = set(re.findall(r"idesc\[(UR\d+)\]", code))
    (value,) = set(re.findall(rf"UMOV {register}, (0x[0-9a-f]+)", code))
    return int(value, 16)


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_compiles_for_sm100a_without_spills_within_its_register_budget(variant):
    used, code, _ = compiled(variant)
    assert (used.spill_stores, used.spill_loads, used.local_bytes, used.stack_bytes) == (0, 0, 0, 0), used
    assert not re.search(r"\b(STL|LDL)\b", code), "local memory traffic"
    # 128 threads, one CTA an SM (shared memory): registers are not the limit, but the accumulator is
    # in TMEM, so a count near 255 would mean it leaked into registers
    assert 0 < used.registers <= 64, used


@pytest.mark.parametrize("pair", [False, True], ids=["1cta", "2cta"])
def test_the_bf16_gemm_is_tcgen05_mma_on_a_tma_ring(pair):
    _, code, ops = compiled("bf16-2cta" if pair else "bf16-1cta")
    suffix = ".2CTA" if pair else ""
    # in the order of the code, every copy of the K-block body (ptxas unrolls it) issues the 4 MMAs of
    # K = 16 that make a K block of 64, then its commit (the ring slot's release); one more commit
    # after the loop fires `done`
    commit = "UTCBAR.2CTA.MULTICAST" if pair else "UTCBAR"
    assert re.fullmatch(r"(M{4}C)+C", tcgen05_issue_order(code, {f"UTCHMMA{suffix}": "M", commit: "C"})), \
        tcgen05_issue_order(code, {f"UTCHMMA{suffix}": "M", commit: "C"})
    assert not any(op.startswith("UTCHMMA") and op != f"UTCHMMA{suffix}" for op in ops), ops
    # bf16 x bf16 -> fp32, both K-major, N = 256, M = 128 (256 for the pair)
    umma_m = 256 if pair else 128
    assert instruction_descriptor(code) == (1 << 4) | (1 << 7) | (1 << 10) | (256 >> 3 << 17) | (umma_m >> 4 << 24)
    # TMA loads (a pair's count on the leader's barrier), the TMEM allocation, the accumulator read back
    # 32 columns at a time, 8 bf16 packs and 16-byte stores per 32 columns
    assert ops[f"UTMALDG.2D{suffix}"] >= 2 and not ops["UTMALDG.2D" if pair else "UTMALDG.2D.2CTA"], ops
    assert ops[f"UTCATOMSWS{suffix}.FIND_AND_SET.ALIGN"] >= 1, ops
    assert ops["LDTM.x32"] == 1 and ops["F2FP.BF16.F32.PACK_AB"] == 16 and ops["STG.E.128"] == 4, ops
    # the roles' loops run warp-wide with one elected lane issuing: no per-lane loops around the issue
    assert not ops["BRA.U.ANY"], "a tcgen05 or TMA instruction wrapped in a loop over lanes"
    if pair:  # the cluster barrier around the 2-CTA allocation and release; the commits multicast
        assert ops["UCGABAR_ARV"] >= 2 and ops["UCGABAR_WAIT"] >= 2 and not ops["UTCBAR"], ops


def tcgen05_issue_order(code: str, letters: dict[str, str]) -> str:
    """The tcgen05 issue instructions (MMAs, commits, copies) in the order of the code, one letter
    each (`letters`: opcode -> letter); any other tcgen05 issue opcode is an "?"."""
    found = re.findall(r"\b(UTC(?:HMMA|OMMA|BAR|CP)[.\w]*)", code)
    return "".join(letters.get(op, "?") for op in found)


@pytest.mark.parametrize("variant", ["nvfp4-gemm", "nvfp4-gemv"])
def test_the_nvfp4_kernel_is_block_scaled_tcgen05_mma_with_scales_copied_into_tmem(variant):
    _, code, ops = compiled(variant)
    block_n = VARIANTS[variant][2]["BN"]
    # per K block of 256 codes: 8 copies of 512 bytes of scale factors into TMEM (4 for A, 4 for B),
    # then 4 block-scaled MMAs of K = 64 with 4 scales a row each (".4X": block16), then the commit
    order = tcgen05_issue_order(code, {"UTCCP.T.S.4x32dp128bit": "S", "UTCOMMA.4X": "M", "UTCBAR": "C"})
    assert re.fullmatch(r"(S{8}M{4}C)+C", order), order
    # E2M1 x E2M1 with UE4M3 scales, K-major, N = BN, M = 128
    assert instruction_descriptor(code) == (1 << 7) | (1 << 10) | (block_n >> 3 << 17) | (128 >> 4 << 24)
    # the producer: TMA for the codes, 1-D bulk copies for the packed scale factors, 2 of each a K block
    assert ops["UTMALDG.2D"] == ops["UBLKCP.S.G"] >= 2 and ops["UTMALDG.2D"] % 2 == 0, ops
    out = "F2FP.F16.F32.PACK_AB" if VARIANTS[variant][2]["OUT_FP16"] else "F2FP.BF16.F32.PACK_AB"
    assert ops["LDTM.x32"] == 1 and ops[out] == 16 and ops["UTCATOMSWS.FIND_AND_SET.ALIGN"] >= 1, ops
    assert not ops["BRA.U.ANY"], ops


def test_for_sm90a_every_blackwell_kernel_is_a_trap():
    """kforge compiles every .cu for sm_90a (tests/runtime, `kforge resources`): there the kernels
    must compile, and do nothing but trap."""
    for source, name, defines in VARIANTS.values():
        cubin = compile_cuda(source, arch="sm_90a", defines=defines, cache=False)
        code = sass(cubin)
        assert resources(cubin)[name].registers > 0 and "BPT.TRAP" in code, name
        assert not re.search(r"\bUTC|\bUTMALDG|\bLDTM", code), name


def test_every_variant_fits_shared_memory_and_tensor_memory():
    for cta_pair, defines in bf16.VARIANTS.items():
        assert bf16.shared_bytes(cta_pair, defines["BN"], defines["STAGES"]) <= blackwell.SHARED_LIMIT
    for defines in (nvfp4.GEMM, nvfp4.GEMV):
        assert nvfp4.shared_bytes(defines["BN"], defines["STAGES"]) <= blackwell.SHARED_LIMIT
        # the accumulator (at least 32 columns) and 32 scale-factor columns a slot, of 512
        assert max(32, defines["BN"]) + 32 * defines["STAGES"] <= 512


# --- the host side ---------------------------------------------------------------------------

def test_scale_factors_are_packed_in_the_tensor_cores_chunk_layout():
    """Every scale of a [2, 200, 40] tensor (rows: one full tile and a partial one; 40 scales: two and
    a half K blocks) lands at tile r // 128, block s // 16, byte 512 (s % 16 // 4) + 16 (r % 32) +
    4 (r % 128 // 32) + s % 4; everything else is zero. Bytes 1..255 name their position."""
    batches, rows, columns = 2, 200, 40
    values = (torch.arange(batches * rows * columns) % 255 + 1).to(torch.uint8).view(batches, rows, columns)
    packed = nvfp4.pack_scale_factors(values.view(torch.float8_e4m3fn))
    assert packed.shape == (2, 2, 3, 2048) and packed.dtype == torch.uint8
    l, r, s = torch.meshgrid(torch.arange(batches), torch.arange(rows), torch.arange(columns), indexing="ij")
    byte = 512 * (s % 16 // 4) + 16 * (r % 32) + 4 * (r % 128 // 32) + s % 4
    assert torch.equal(packed[l, r // 128, s // 16, byte], values)
    assert packed.count_nonzero() == values.numel(), "the padding is zeros"


def test_the_reference_is_the_float64_product_of_the_dequantized_operands():
    """Operands whose every value is exact (codes 2.0 and 0.5, power-of-two scales): the reference
    is a plain product, and so is what quantize_nvfp4 gives back."""
    a_values = torch.full((3, 64), 2.0)
    a_values[1, :16] = 0.5
    b_values = torch.full((5, 64), -0.5)
    a, b = quantize_nvfp4(a_values), quantize_nvfp4(b_values)
    ref = nvfp4.nvfp4_reference(*a, *b)
    assert ref.dtype == torch.float64 and ref.shape == (3, 5)
    torch.testing.assert_close(ref, (a_values @ b_values.T).double(), rtol=0, atol=0)
    batched = nvfp4.nvfp4_reference(*(t.expand(2, *t.shape) if t.dim() else t for t in (*a, *b)))
    assert batched.shape == (2, 3, 5) and torch.equal(batched[1], ref)


def _nvfp4_operands(m, n, k, batches=None):
    shape = (batches,) if batches else ()
    a = quantize_nvfp4(torch.randn(*shape, m, k))
    b = quantize_nvfp4(torch.randn(*shape, n, k))
    return (*a, *b)


def _bad_nvfp4_cases():
    a, sa, ga, b, sb, gb = _nvfp4_operands(8, 16, 64)
    return [
        ((a.view(torch.int8), sa, ga, b, sb, gb), "a must be a 2-D torch.uint8"),
        ((a, sa.float(), ga, b, sb, gb), "a_scales must be a 2-D torch.float8_e4m3fn"),
        ((a[None], sa, ga, b, sb, gb), "a must be a 2-D"),
        ((a, sa, ga.double(), b, sb, gb), "a_gs must be a one-element float32"),
        ((a[:, :8], sa[:, :1], ga, b[:, :8], sb[:, :1], gb), "K = 16 must be a positive multiple of 32"),
        ((a, sa, ga, b[:, :16].contiguous(), sb, gb), r"b must be \(N, 32\)"),
        ((a, sa[:, :2], ga, b, sb, gb), r"a_scales must be \(8, 4\)"),
        ((a, sa, ga, b[:12], sb[:12], gb), "N = 12 must be a multiple of 8"),
        ((torch.zeros(8, 64, dtype=torch.uint8)[:, ::2], sa, ga, b, sb, gb), "a must be contiguous"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_nvfp4_cases())))
def test_nvfp4_gemm_refuses_bad_operands_with_one_line(case):
    args, message = _bad_nvfp4_cases()[case]
    with pytest.raises(ValueError, match=message):
        nvfp4.nvfp4_gemm(*args)


def test_the_batched_gemv_takes_one_b_row_a_batch():
    a, sa, ga, b, sb, gb = _nvfp4_operands(8, 1, 64, batches=3)
    nvfp4.check_nvfp4_inputs(a, sa, ga, b, sb, gb, gemv=True)
    with pytest.raises(ValueError, match=r"b must be \(3, 1, 32\)"):
        nvfp4.nvfp4_batched_gemv(a, sa, ga, torch.cat((b, b), 1), torch.cat((sb, sb), 1), gb)
    with pytest.raises(ValueError, match=r"b must be \(3, 1, 32\)"):
        nvfp4.nvfp4_batched_gemv(a, sa, ga, b[:2], sb[:2], gb)


def test_bf16_gemm_refuses_bad_operands_with_one_line():
    def zeros(*shape):
        return torch.zeros(shape, dtype=torch.bfloat16)

    a, b = zeros(16, 64), zeros(32, 64)
    for args, message in (((a.float(), b), "a must be a 2-D torch.bfloat16"), ((a, zeros(32, 32)), "must share K"),
                          ((a, zeros(20, 64)), "N and K must be multiples of 8"),
                          ((zeros(16, 60), zeros(32, 60)), "N and K must be multiples of 8"),
                          ((a, zeros(64, 32).t()), "b must be contiguous")):
        with pytest.raises(ValueError, match=message):
            bf16.tcgen05_gemm(*args)


def test_the_launchers_refuse_cpu_tensors_with_a_kforge_error():
    with pytest.raises(KforgeError, match=r"^tcgen05_gemm runs on an sm_100 GPU \(B200/GB200\); got tensors on cpu$"):
        bf16.tcgen05_gemm(torch.zeros(16, 64, dtype=torch.bfloat16), torch.zeros(32, 64, dtype=torch.bfloat16))
    with pytest.raises(KforgeError, match="^nvfp4_gemm runs on an sm_100 GPU"):
        nvfp4.nvfp4_gemm(*_nvfp4_operands(8, 16, 64))
    with pytest.raises(KforgeError, match="^nvfp4_batched_gemv runs on an sm_100 GPU"):
        nvfp4.nvfp4_batched_gemv(*_nvfp4_operands(8, 1, 64, batches=2))


@pytest.mark.parametrize("capability, name", [((9, 0), "NVIDIA H100 80GB HBM3"), ((10, 3), "NVIDIA B300"),
                                              ((12, 0), "NVIDIA GeForce RTX 5090")])
def test_any_gpu_but_an_sm100_is_refused_in_one_line(monkeypatch, capability, name):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: name)
    on_gpu = SimpleNamespace(device=torch.device("cuda", 0))
    with pytest.raises(KforgeError) as refused:
        blackwell.require_sm100(on_gpu, "tcgen05_gemm")
    reason = refused.value.reason
    assert reason == (f"tcgen05_gemm needs an sm_100 GPU (B200/GB200, compute capability 10.0); {name} is "
                      f"{capability[0]}.{capability[1]}") and "\n" not in reason


def test_an_sm100_is_accepted(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (10, 0))
    assert blackwell.require_sm100(SimpleNamespace(device=torch.device("cuda", 3)), "tcgen05_gemm") == 3


# --- on an sm_100 GPU ------------------------------------------------------------------------

def _is_sm100() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (10, 0)


sm100 = pytest.mark.skipif(not _is_sm100(), reason="needs an sm_100 GPU (compute capability 10.0)")


def assert_within_rounding(c: torch.Tensor, exact: torch.Tensor, magnitude: torch.Tensor, unit: float) -> None:
    """c is `exact` rounded once to c's dtype (half an ulp: `unit` relative), give or take fp32 sums
    in any order (2^-20 of the sum of |terms|); every element written (NaN poison) and finite."""
    assert c.shape == exact.shape and torch.isfinite(c).all(), "an output was not written or overflowed"
    excess = (c.double() - exact).abs() - (unit * exact.abs() + 2**-20 * magnitude)
    assert excess.max().item() <= 0, f"off by more than a rounding: {excess.max().item():.3g}"


# (M, N, K): whole tiles; M, N and K tails (M = 300: a pair's second CTA half past M; K = 72: one
# K block and 8 more); N of one 8-column group
BF16_SHAPES = [(256, 512, 1024), (300, 264, 72), (129, 8, 64), (1024, 768, 4096)]


@pytest.mark.gpu
@sm100
@pytest.mark.parametrize("pair", [False, True], ids=["1cta", "2cta"])
@pytest.mark.parametrize("m, n, k", BF16_SHAPES, ids=str)
def test_the_bf16_gemm_matches_float64_on_an_sm100(m, n, k, pair, nan_outputs):
    g = torch.Generator(device="cuda").manual_seed(m + n + k)
    a = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    b = torch.randn(n, k, device="cuda", generator=g).bfloat16()
    c = bf16.tcgen05_gemm(a, b, cta_pair=pair)
    assert c.dtype == torch.bfloat16
    assert_within_rounding(c, a.double() @ b.double().T, a.double().abs() @ b.double().abs().T, 2**-8)


# (M, N, K): whole tiles; M, N tails; K = 288: one K block and 32 more codes (a partial SF tile)
NVFP4_SHAPES = [(256, 256, 1024), (200, 136, 288), (128, 8, 32), (1024, 512, 7168)]


@pytest.mark.gpu
@sm100
@pytest.mark.parametrize("m, n, k", NVFP4_SHAPES, ids=str)
def test_the_nvfp4_gemm_matches_float64_on_an_sm100(m, n, k, nan_outputs):
    torch.manual_seed(m + n + k)
    a = quantize_nvfp4(torch.randn(m, k, device="cuda"))
    b = quantize_nvfp4(torch.randn(n, k, device="cuda") / k**0.5)
    c = nvfp4.nvfp4_gemm(*a, *b)
    assert c.dtype == torch.bfloat16
    from kforge.kernels.quant.formats import dequantize_nvfp4
    magnitude = dequantize_nvfp4(*a).double().abs() @ dequantize_nvfp4(*b).double().abs().T
    assert_within_rounding(c, nvfp4.nvfp4_reference(*a, *b), magnitude, 2**-8)


@pytest.mark.gpu
@sm100
@pytest.mark.parametrize("m, k, batches", [(7168, 16384, 1), (4096, 7168, 8), (7168, 2048, 4), (777, 96, 3)], ids=str)
def test_the_batched_gemv_matches_float64_on_an_sm100(m, k, batches, nan_outputs):
    torch.manual_seed(m + k)
    a = quantize_nvfp4(torch.randn(batches, m, k, device="cuda"))
    b = quantize_nvfp4(torch.randn(batches, 1, k, device="cuda") / k**0.5)
    c = nvfp4.nvfp4_batched_gemv(*a, *b)
    assert c.dtype == torch.float16 and c.shape == (batches, m, 1)
    from kforge.kernels.quant.formats import dequantize_nvfp4
    magnitude = dequantize_nvfp4(*a).double().abs() @ dequantize_nvfp4(*b).double().abs().transpose(1, 2)
    assert_within_rounding(c, nvfp4.nvfp4_reference(*a, *b), magnitude, 2**-11)

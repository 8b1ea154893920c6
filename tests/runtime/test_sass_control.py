"""Rewriting a kernel's scheduling control bits (`runtime/sass_control.py`), on a machine with no GPU.

The block-scaled FP8 GEMM, compiled for sm_90a, is rewritten in each promotion style and
disassembled again: exactly the FFMAs' yield and reuse bits change, every other bit of every
instruction stays. That the rewritten kernels still compute the right numbers is checked on a
GPU (tests/kernels/test_fp8_block_gemm.py).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from kforge.errors import KforgeError
from kforge.kernels.quant.fp8_block_gemm import SOURCE
from kforge.runtime import sass_control
from kforge.runtime.cuda import compile_cuda

KERNEL = "fp8_block_gemm"
CONTROL = (1 << 45) | (0xF << 58)  # the yield bit and the four reuse flags of the high word


@pytest.fixture(scope="module")
def cubin():
    return compile_cuda(SOURCE, arch="sm_90a", defines={"STAGES": 4, "BN": 256, "CLUSTER_M": 2})


@pytest.fixture(scope="module")
def listing(cubin):
    return sass_control.instructions(cubin, KERNEL)


@pytest.mark.slow
def test_the_dump_matches_the_kernels_bytes_in_the_elf(cubin, listing):
    offset, size = sass_control.text_section(cubin.code, KERNEL)
    assert len(listing) * 16 == size
    first, last = listing[0], listing[-1]
    assert cubin.code[offset:offset + 16] == first.low.to_bytes(8, "little") + first.high.to_bytes(8, "little")
    assert last.address == size - 16
    assert sass_control.rewrite(cubin, KERNEL, [], "nothing").code == cubin.code


def test_the_promotion_is_four_runs_of_ffmas_on_one_factor_each(listing):
    """BN 256: two halves a K block, each 32 FFMAs on its upper row's factor and 32 on the lower's
    (ptxas may interleave other instructions, which splits a run: a run shares one factor, in one
    operand slot, with nothing between)."""
    runs = sass_control.promotion_runs(listing)
    assert sum(len(run) for _, run in runs) == 128
    factors = {sass_control._multiplicands(run[0])[slot] for slot, run in runs}
    assert len(factors) == 4
    for slot, run in runs:
        assert len({sass_control._multiplicands(i)[slot] for i in run}) == 1
    assert max(len(run) for _, run in runs) == 32


@pytest.mark.parametrize("style, every", [("reuse", None), ("yield", 1), ("yield-every-4", 4)])
@pytest.mark.slow
def test_a_rewrite_changes_only_the_ffmas_yield_and_reuse_bits(cubin, listing, style, every):
    rewritten = sass_control.instructions(sass_control.rewrite_promotion(cubin, KERNEL, style), KERNEL)
    assert len(rewritten) == len(listing)
    changed = 0
    for before, after in zip(listing, rewritten):
        assert (before.address, before.low, before.high & ~CONTROL) == (after.address, after.low, after.high & ~CONTROL)
        if before.opcode != "FFMA":
            assert before.high == after.high, before.text
        changed += before.high != after.high
    assert changed >= 30, "ptxas leaves about half the FFMAs the other way"
    for slot, run in sass_control.promotion_runs(rewritten):
        yields = [every is not None and i % every == every - 1 for i in range(len(run))]
        assert [i.yields for i in run] == yields, [i.text for i in run]
        kept = [0 if y or i == len(run) - 1 else 1 << slot for i, y in enumerate(yields)]
        assert [i.reuse for i in run] == kept, [i.text for i in run]
        assert [".reuse" in i.text for i in run] == [k != 0 for k in kept], "cuobjdump reads the flags back"


def _ffma(address: int, text: str) -> sass_control.Instruction:
    return sass_control.Instruction(address, text, 0, 1 << 45)


def test_runs_stop_at_branch_targets_predicates_and_immediates():
    """The reuse cache may only chain between instructions that always run one after the other:
    a branch landing on an FFMA starts a new run, a predicated FFMA is in none, and a shared
    immediate is not a factor (no reuse flag for an immediate)."""
    listing = [_ffma(0x00, "FFMA R10, R24, R200, R10 ;"), _ffma(0x10, "FFMA R11, R25, R200, R11 ;"),
               _ffma(0x20, "FFMA R12, R26, R200, R12 ;"), _ffma(0x30, "FFMA R13, R27, R200, R13 ;"),
               _ffma(0x40, "@P0 FFMA R14, R28, R200, R14 ;"), _ffma(0x50, "FFMA R15, R29, R200, R15 ;"),
               _ffma(0x60, "FFMA R16, R30, R200, R16 ;"), _ffma(0x70, "FFMA R17, R31, 1.5, R17 ;"),
               _ffma(0x80, "FFMA R18, R32, 1.5, R18 ;"), _ffma(0x90, "BRA 0x20 ;")]
    runs = sass_control.promotion_runs(listing)
    assert [(slot, [i.address for i in run]) for slot, run in runs] == [(1, [0x00, 0x10]), (1, [0x20, 0x30]),
                                                                       (1, [0x50, 0x60])]
    listing[-1] = _ffma(0x90, "EXIT ;")
    assert [len(run) for _, run in sass_control.promotion_runs(listing)] == [4, 2]
    listing[-1] = _ffma(0x90, "@P0 BREAK B2 ;")  # leaves a convergence barrier, lands nowhere
    assert [len(run) for _, run in sass_control.promotion_runs(listing)] == [4, 2]
    listing[-1] = _ffma(0x90, "BRX R4 -0x90 ;")  # an indirect jump could land anywhere
    with pytest.raises(KforgeError, match="where every branch lands"):
        sass_control.promotion_runs(listing)


@pytest.mark.slow
def test_the_timing_only_build_has_no_promotion_to_rewrite():
    """PROMOTE_TIMING=3 multiplies by an immediate: nothing for the reuse cache to keep."""
    timing = compile_cuda(SOURCE, arch="sm_90a", defines={"STAGES": 4, "BN": 256, "CLUSTER_M": 2, "PROMOTE_TIMING": 3})
    assert sass_control.promotion_runs(sass_control.instructions(timing, KERNEL)) == []


@pytest.mark.slow
def test_a_rewrite_is_cached_on_disk_until_the_rewriter_changes(cubin, monkeypatch):
    first = sass_control.rewrite_promotion(cubin, KERNEL, "yield-every-8")
    again = sass_control.rewrite_promotion(cubin, KERNEL, "yield-every-8")
    assert not first.from_cache and again.from_cache and again.code == first.code and again.key == first.key
    monkeypatch.setattr(sass_control, "_own_source", lambda: b"a later version of the rewriter")
    assert not sass_control.rewrite_promotion(cubin, KERNEL, "yield-every-8").from_cache


def test_ptxas_style_is_the_cubin_itself_and_unknown_styles_are_refused(cubin):
    assert sass_control.rewrite_promotion(cubin, KERNEL, "ptxas") is cubin
    with pytest.raises(KforgeError, match="promotion style"):
        sass_control.rewrite_promotion(cubin, KERNEL, "fast")


@pytest.mark.slow
def test_a_rewritten_cubin_has_its_own_cache_key(cubin):
    rewritten = sass_control.rewrite_promotion(cubin, KERNEL, "reuse")
    assert rewritten.key != cubin.key and rewritten.code != cubin.code


def test_an_instruction_that_yields_keeps_no_operand(listing):
    ffma = next(i for i in listing if i.opcode == "FFMA")
    with pytest.raises(KforgeError, match="cannot keep operands"):
        ffma.with_control(yields=True, reuse=0b0010)
    assert ffma.with_control(yields=False, reuse=0b0010).reuse == 0b0010


@pytest.mark.slow
def test_wrong_kernels_and_files_and_stale_dumps_are_refused(cubin, listing):
    with pytest.raises(KforgeError, match="no kernel named"):
        sass_control.instructions(cubin, "no_such_kernel")
    with pytest.raises(KforgeError, match="no section"):
        sass_control.text_section(cubin.code, "no_such_kernel")
    with pytest.raises(KforgeError, match="ELF"):
        sass_control.text_section(b"not an elf" * 8, KERNEL)
    # an edit at an address past the kernel's end would land outside its code
    outside = replace(listing[-1], address=listing[-1].address + 16)
    with pytest.raises(KforgeError, match="outside"):
        sass_control.rewrite(cubin, KERNEL, [outside], "outside")
    # an edit of anything but the hints (here the stall count) is refused
    stalled = replace(listing[5], high=listing[5].high ^ (1 << 41))
    with pytest.raises(KforgeError, match="changes more than"):
        sass_control.rewrite(cubin, KERNEL, [stalled], "stall")

"""MLA decode's CUDA kernel for Hopper (kernels/mla/decode_hopper.cu and .py). On any machine: every
build (bf16/fp16, causal or not, pages of 64 and 256) compiled for sm_90a without spills, the register
split between producer and consumers, one tile's products in the machine code (36 64x32 score wgmmas
and 4 64x256 value wgmmas a tile, the two exchange barriers), the shared memory the launcher asks for,
the split plan, and the refusals. On a Hopper GPU: against float64 on ragged lengths (0, 1, a page
-1, +1, a tail) over a NaN-filled pool, s_q 1 and 2, causal or not, 16 to 128 heads (row blocks with
a tail), one split and many, pages of 128, fp16, into NaN-poisoned buffers."""

from __future__ import annotations

import math
import re

import pytest
import torch
from test_mla_decode import _assert_close, _latent, _query

from kforge.kernels.mla import decode as decode_module
from kforge.kernels.mla import decode_hopper
from kforge.kernels.mla.decode import mla_decode, mla_decode_reference
from kforge.kernels.mla.decode_hopper import (hopper_unsupported, kernel_defines, mla_decode_hopper, plan_splits,
                                              schedule_chunks, shared_bytes)
from kforge.runtime.cuda import compile_cuda, resources, sass, sass_loop_instructions

BUILDS = [(causal, dtype, page, scheduled) for causal in (False, True) for dtype in (torch.bfloat16, torch.float16)
          for page in (64, 256) for scheduled in (False, True)]


def _build_id(build):
    causal, dtype, page, scheduled = build
    return (f"{'causal' if causal else 'full'}-{str(dtype).removeprefix('torch.')}-page{page}"
            f"{'-scheduled' if scheduled else ''}")


@pytest.fixture(scope="module")
def compiled():
    """{build: (resources, sass text, ptxas log)}, compiled once for the module."""
    found = {}
    for build in BUILDS:
        cubin = compile_cuda(decode_hopper.SOURCE, arch="sm_90a", defines=kernel_defines(*build),
                             options=decode_hopper.OPTIONS)
        found[build] = (resources(cubin)[decode_hopper.KERNEL], sass(cubin), cubin.ptxas_log)
    return found


# --- the compiled kernel, on any machine ------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("build", BUILDS, ids=_build_id)
def test_every_build_fits_without_spills_and_moves_registers_to_the_consumers(build, compiled):
    used, code, log = compiled[build]
    assert (used.spill_stores, used.spill_loads, used.stack_bytes, used.local_bytes) == (0, 0, 0, 0)
    assert not re.search(r"\b(STL|LDL)\b", code), "local memory in the machine code"
    assert used.registers <= 65536 // decode_hopper.THREADS // 8 * 8  # __launch_bounds__(384, 1)
    assert 128 * 24 + 256 * 240 <= used.registers * decode_hopper.THREADS
    assert "USETMAXREG.DEALLOC.CTAPOOL 0x18" in code and "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xf0" in code
    assert "serialized" not in log, "ptxas serialized the wgmmas"
    assert shared_bytes(kernel_defines(*build)) <= 227 * 1024


@pytest.mark.slow
@pytest.mark.parametrize("build", [BUILDS[0], BUILDS[3], BUILDS[5]], ids=_build_id)
def test_the_tile_loop_splits_both_products_between_the_consumers(build, compiled):
    """Each consumer has its own tile loop, unrolled by the two stages (so the consumer and the stage
    are constants in every wgmma descriptor). A pass holds two tiles of one consumer's share: per
    tile, S over 32 tokens as 36 64x32x16 wgmmas (576 / 16), P V over its 256 value columns as 4
    64x256x16 wgmmas (64 tokens / 16), the two 256-thread barriers (the row max, then P whole),
    stmatrix for its P half, and two waits: S's before the softmax's exp2s, P V's after them."""
    _, code, _ = compiled[build]
    # the two shortest: the other loops holding them are the spin waits' out-of-line retries branching back
    loops = sorted((body for body in sass_loop_instructions(code) if any(t.startswith("HGMMA") for t in body)),
                   key=len)[:2]
    kind = "F32" if build[1] == torch.float16 else "F32.BF16"  # (fp16 operands carry no suffix)
    for body in loops:
        assert sum(t.split()[0] == f"HGMMA.64x32x16.{kind}" for t in body) == 2 * 36
        assert sum(t.split()[0] == f"HGMMA.64x256x16.{kind}" for t in body) == 2 * 4
        assert sum(t.startswith("BAR.SYNC") and "0x1, 0x100" in t for t in body) == 2 * 2
        assert sum(t.startswith("STSM") for t in body) == 2 * 2
        # a wait a group, not one a wgmma (ptxas serializes wgmmas it cannot prove apart: C7514)
        waits = [i for i, t in enumerate(body) if t.startswith("WARPGROUP.DEPBAR")]
        exps = [i for i, t in enumerate(body) if t.startswith("MUFU.EX2")]
        assert len(waits) == 4
        for first, second in ((0, 1), (2, 3)):  # 16 scores a thread and a rescale a row, between a tile's waits
            assert sum(waits[first] < i < waits[second] for i in exps) == 16 + 2
        assert len(body) < 2 * 750, "descriptor arithmetic back in the loop (823 a tile before the constants)"


def _source_shared_bytes(stages: int) -> int:
    """The .cu's SHARED_BYTES expression, its macros expanded and evaluated (what check_launch tests)."""
    macros = dict(re.findall(r"^#define (\w+) (.+?)(?:\s*//.*)?$", decode_hopper.SOURCE.read_text(), re.MULTILINE))
    macros["STAGES"] = str(stages)
    expression = "SHARED_BYTES"
    while re.search(r"[A-Z_]{2,}", expression):
        expression = re.sub(r"\b([A-Z_][A-Z0-9_]+)\b", lambda m: f"({macros[m.group(1)]})", expression)
    return eval(expression)  # integers and + - * / only


def test_shared_bytes_follow_the_source():
    defines = kernel_defines(False, torch.bfloat16, 64)
    tile = 64 * 576 * 2
    assert shared_bytes(defines) == _source_shared_bytes(2) == 3 * tile + 16 * 64 + 8 * 5 + 1024
    assert shared_bytes({**defines, "STAGES": 1}) == _source_shared_bytes(1) == shared_bytes(defines) - tile - 16


def test_splits_fill_whole_waves_of_one_cta_an_sm():
    assert plan_splits(128, 16, 8192, 132) == (8192, 1)  # 128 CTAs: one wave already
    size, splits = plan_splits(32, 16, 8192, 132)
    assert splits * 32 <= 132 and size % 64 == 0 and splits >= 4
    assert plan_splits(128, 128, 8192, 132)[1] == 1  # 256 CTAs: two waves whatever the split
    assert plan_splits(1, 16, 100, 132) == (128, 1)  # never shorter than MIN_SPLIT_TOKENS but the whole


def test_schedule_leaves_room_for_shorter_requests_and_none_where_one_split_is_all():
    assert schedule_chunks(128, 16, 8192, 132) == 5  # the host's 1 split, up to 4 waves' worth of CTAs
    assert schedule_chunks(32, 16, 8192, 132) == max(plan_splits(32, 16, 8192, 132)[1], 17)
    assert schedule_chunks(4, 16, 1 << 20, 132) == 64  # capped
    assert schedule_chunks(128, 16, 256, 132) == 0  # no split is ever shorter than 256 tokens
    assert schedule_chunks(5000, 16, 8192, 132) == 0  # past MAX_SCHEDULED_BATCH: the host plan


def test_what_the_kernel_does_not_take_is_named():
    q = torch.zeros(1, 1, 16, 576, dtype=torch.bfloat16)
    cache = torch.zeros(4, 64, 1, 576, dtype=torch.bfloat16)
    assert hopper_unsupported(q, cache, 512, 0.1) == "needs a Hopper GPU (sm_90: wgmma and TMA)"  # the rest fits
    reasons = {
        "takes bfloat16 or float16": (q.float(), cache.float(), 512, 0.1),
        "takes head dims 576 / 512": (q[..., :320], cache[..., :320], 256, 0.1),
        "takes pages of 64, 128, 256 tokens, not 32": (q, cache.view(8, 32, 1, 576), 512, 0.1),
        "needs pages of packed": (q, torch.zeros(8, 64, 1, 576, dtype=torch.bfloat16)[::2], 512, 0.1),  # every 2nd
        "needs q to start on 16 bytes": (torch.zeros(16 * 576 + 1, dtype=torch.bfloat16)[1:].view(1, 1, 16, 576),
                                         cache, 512, 0.1),
        "takes a softmax scale above 0": (q, cache, 512, 0.0),
    }
    for reason, args in reasons.items():
        assert hopper_unsupported(*args).startswith(reason), reason
    # rows padded past 576 values are fine: TMA takes any 16-byte row stride
    padded = torch.zeros(4, 64, 1, 640, dtype=torch.bfloat16)[..., :576]
    assert hopper_unsupported(q, padded, 512, 0.1).startswith("needs a Hopper GPU")
    table, lens = torch.zeros(1, 4, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="^mla_decode_hopper needs a Hopper GPU"):
        mla_decode_hopper(q, cache, table, lens)
    with pytest.raises(ValueError, match="^backend must be"):
        mla_decode(q, cache, table, lens, backend="cudnn")


# --- on a Hopper GPU -----------------------------------------------------------------------------

hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                            reason="needs a Hopper GPU")


@pytest.fixture
def nan_buffers(monkeypatch):
    """out, lse and the split partials start as NaN; the schedule (int32) as -2^31."""
    monkeypatch.setattr(decode_module, "_empty", lambda shape, dtype, device: torch.full(
        shape, float("nan") if dtype.is_floating_point else -2 ** 31, dtype=dtype, device=device))
    monkeypatch.setattr(decode_hopper, "_empty", decode_module._empty)


LENGTHS = [4096, 1, 63, 64, 65, 1000, 0, 2049, 17, 128, 777, 2]


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("h_q, s_q, causal", [(16, 1, False), (16, 2, True), (64, 1, False), (128, 2, True),
                                              (40, 2, False)])
@pytest.mark.parametrize("split_size", [None, 64, 256], ids=["scheduled", "split64", "split256"])
def test_gpu_matches_float64_on_ragged_lengths(h_q, s_q, causal, split_size, nan_buffers):
    latent = _latent(LENGTHS, torch.bfloat16, seed=h_q + s_q, device="cuda")
    q = _query(len(LENGTHS), s_q, h_q, torch.bfloat16, seed=7, device="cuda")
    scale = 1 / math.sqrt(192)
    out, lse = mla_decode_hopper(q, latent.cache, latent.table, latent.seqlens, softmax_scale=scale, causal=causal,
                                 split_size=split_size)
    expected = mla_decode_reference(q.double(), latent.cache.double(), latent.table, latent.seqlens,
                                    softmax_scale=scale, causal=causal)
    _assert_close(out, lse, expected[0].cpu(), expected[1].double().cpu(), torch.bfloat16)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("page", [128, 256])
@pytest.mark.parametrize("split_size", [None, 128, 1 << 16], ids=["scheduled", "split128", "one-split"])
def test_gpu_larger_pages_and_fp16(page, split_size, nan_buffers):
    """Pages of 128 and 256 tokens in fp16, every slot past a request's length NaN (the tail's V rows are
    zeroed in shared memory); the device schedule, several host splits, and one split (kernel 1 writes
    out and lse itself, the empty request included)."""
    g = torch.Generator().manual_seed(page)
    lengths = [1000, 5, 0, 513]
    pages_each = max(math.ceil(n / page) for n in lengths)
    pool = torch.randn(len(lengths) * pages_each + 1, page, 1, 576, generator=g).half()
    table = torch.randperm(len(pool), generator=g)[:len(lengths) * pages_each].view(len(lengths), -1).int()
    for b, n in enumerate(lengths):  # NaN in every slot no request holds
        slots = pool[table[b].long()].view(-1, 576)
        slots[n:] = float("nan")
        pool[table[b].long()] = slots.view(-1, page, 1, 576)
    pool, table = pool.cuda(), table.cuda()
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    q = torch.randn(len(lengths), 2, 16, 576, generator=g).half().cuda()
    out, lse = mla_decode_hopper(q, pool, table, lens, causal=True, split_size=split_size)
    expected = mla_decode_reference(q.double(), pool.double(), table, lens, causal=True)
    assert out.dtype == torch.float16
    assert (out.double() - expected[0].double()).abs().max() / expected[0].abs().max() < 2e-3
    finite = expected[1].isfinite()
    torch.testing.assert_close(lse[finite].double(), expected[1][finite].double(), rtol=2e-3, atol=2e-3)
    assert (lse[~finite] == float("-inf")).all()


@pytest.mark.gpu
@hopper
def test_gpu_auto_backend_equals_the_cuda_kernel():
    latent = _latent([3000, 70], torch.bfloat16, seed=3, device="cuda")
    q = _query(2, 1, 16, torch.bfloat16, seed=4, device="cuda")
    auto = mla_decode(q, latent.cache, latent.table, latent.seqlens)
    cuda = mla_decode_hopper(q, latent.cache, latent.table, latent.seqlens)
    assert torch.equal(auto[0], cuda[0]) and torch.equal(auto[1], cuda[1])

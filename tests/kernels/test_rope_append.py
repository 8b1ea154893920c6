"""RoPE fused with the paged KV-cache append: the Triton kernel under the interpreter (fp16, bf16
with the interpreter's casts mended to round as the GPU does, fp32) against the two kernels it
replaces, apply_rope_ then paged_kv_append, bit for bit (q, k and v in their fused QKV buffer,
and both caches), and against the float64 rotation; one decode token per request and several,
GQA 4x and odd head counts, head dims 64 and 128, full and partial rotary, page sizes 8-64,
both pair layouts; tokens on the first slot of a fresh page and the last slot of a page;
positions outside the table (NaN) and writes past a block-table row (dropped), over caches
poisoned with NaN wherever nothing may be written; separate q, k, v and caches interleaved in
one buffer; refusals; kforge.ops.rope_paged_kv_append as a mutating custom op on the CPU (the
eager pair) and under torch.compile; the sm_90 build. On a GPU: Llama-3-8B decode (batch 1
and 8) against the two kernels, bit for bit."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
import torch

from kforge.kernels.serving.paged_kv import paged_kv_append, paged_kv_append_reference
from kforge.kernels.serving.rope import apply_rope_, cos_sin_table, rope_reference_
from kforge.kernels.serving.rope_append import rope_append_
from kforge.ops.rope_append import rope_paged_kv_append
from kforge.runtime.interpreter import mend_bf16_casts

TOLERANCE = {  # one rounding of an fp32 result, as in test_rope.py
    torch.float16: dict(rtol=1e-3, atol=1e-5), torch.float32: dict(rtol=1e-5, atol=2e-6),
    torch.bfloat16: dict(rtol=4e-3, atol=1e-5)}
MAX_POSITION = 128


@pytest.fixture(autouse=True)
def bf16_rounding():
    """The interpreter's fp32 -> bf16 casts round to nearest even, as the GPU's do (unmended they
    truncate: a whole bf16 step, and no longer the eager reference's bits)."""
    mend_bf16_casts()


@dataclass
class Step:
    """One layer's inputs: q, k, v as views into a fused QKV buffer (batch, [new_tokens,] width),
    as the Llama decode step makes them, and a paged cache filled with NaN."""
    qkv: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    cos_sin: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor

    def args(self):
        return (self.q, self.k, self.v, self.positions, self.cos_sin, self.k_cache, self.v_cache, self.block_tables,
                self.context_lens)

    def clone(self) -> Step:
        """The same step on copies of the buffer and caches (tables shared: nothing writes them)."""
        qkv = self.qkv.clone()
        return replace(self, qkv=qkv, **_views(qkv, self.q.shape[-2], self.k.shape[-2], self.q.shape[-1]),
                       k_cache=self.k_cache.clone(), v_cache=self.v_cache.clone())


def _views(qkv, q_heads, kv_heads, head_dim):
    q_dim, kv_dim = q_heads * head_dim, kv_heads * head_dim
    lead = qkv.shape[:-1]
    return dict(q=qkv[..., :q_dim].view(*lead, q_heads, head_dim),
                k=qkv[..., q_dim:q_dim + kv_dim].view(*lead, kv_heads, head_dim),
                v=qkv[..., q_dim + kv_dim:].view(*lead, kv_heads, head_dim))


def _step(lengths, new_tokens, q_heads, kv_heads, head_dim, page_size, dtype, *, rotary_dim=None, positions=None,
          max_pages=None, seed=0, device="cpu") -> Step:
    """Requests of `lengths` cached tokens, each with pages for its new tokens, in a shuffled pool
    with spare pages; block-table entries past a request's pages name spare pages, so a write to
    a wrong entry shows. new_tokens None: one decode token per request, q (batch, heads, d).
    positions default to the cache positions (as at a plain decode step)."""
    g = torch.Generator().manual_seed(seed)
    batch, tokens = len(lengths), new_tokens or 1
    held = [math.ceil((n + tokens) / page_size) for n in lengths]
    max_pages = max_pages or max(held)
    num_pages = sum(held) + 3
    order = torch.randperm(num_pages, generator=g)
    spare = order[sum(held):]
    block_tables = spare[torch.randint(len(spare), (batch, max_pages), generator=g)]
    first = 0
    for b, n in enumerate(held):
        block_tables[b, :min(n, max_pages)] = order[first:first + n][:max_pages]
        first += n
    lead = (batch,) if new_tokens is None else (batch, new_tokens)
    qkv = torch.randn(*lead, (q_heads + 2 * kv_heads) * head_dim, generator=g).to(dtype=dtype, device=device)
    context_lens = torch.tensor(lengths, dtype=torch.int32)
    if positions is None:
        positions = context_lens.long()[:, None] + torch.arange(tokens)
    positions = torch.as_tensor(positions).reshape(lead)
    cache = torch.full((num_pages, kv_heads, page_size, head_dim), float("nan"), dtype=dtype, device=device)
    return Step(qkv, **_views(qkv, q_heads, kv_heads, head_dim), positions=positions.to(device),
                cos_sin=cos_sin_table(MAX_POSITION, rotary_dim or head_dim, device=device), k_cache=cache,
                v_cache=cache.clone(), block_tables=block_tables.int().to(device), context_lens=context_lens.to(device))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t's bits as integers: equality that holds for NaN and tells -0 from 0."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _assert_same_bits(got: Step, want: Step):
    for name in ("qkv", "k_cache", "v_cache"):
        a, b = getattr(got, name), getattr(want, name)
        assert torch.equal(_bits(a), _bits(b)), f"{name}: {int((_bits(a) != _bits(b)).sum())} elements differ"


def _two_kernels(step: Step, interleaved: bool) -> Step:
    """What the fused kernel replaces, run on copies: apply_rope_ then paged_kv_append."""
    pair = step.clone()
    apply_rope_(pair.q, pair.k, pair.positions, pair.cos_sin, interleaved=interleaved)
    paged_kv_append(pair.k, pair.v, pair.k_cache, pair.v_cache, pair.block_tables, pair.context_lens,
                    validate=False)
    return pair


def _slots(step: Step):
    """{(page, slot): (request, token)} of every new token whose position fits its block-table row."""
    page_size, max_pages = step.k_cache.shape[2], step.block_tables.shape[1]
    new_tokens = step.k.shape[1] if step.k.dim() == 4 else 1
    found = {}
    for b, length in enumerate(step.context_lens.tolist()):
        for j in range(new_tokens):
            position = length + j
            if 0 <= position < max_pages * page_size:
                found[int(step.block_tables[b, position // page_size]), position % page_size] = (b, j)
    return found


def _assert_matches_float64(got: Step, before: Step, interleaved: bool, dtype):
    """q and k rotated in float64 (from the same fp32 table) and v as it was, at their tokens'
    slots; every other slot of the caches still NaN; v and the dims past rotary_dim untouched."""
    rotary_dim = before.cos_sin.shape[1]
    q64, k64 = before.q.double(), before.k.double()
    rope_reference_(q64, k64, before.positions.to(got.q.device), before.cos_sin.double(), interleaved=interleaved)
    torch.testing.assert_close(got.q.double(), q64, **TOLERANCE[dtype])
    torch.testing.assert_close(got.k.double(), k64, **TOLERANCE[dtype])
    for rotated, untouched in ((got.q, before.q), (got.k, before.k), (got.v, before.v)):
        assert torch.equal(_bits(rotated[..., rotary_dim:]), _bits(untouched[..., rotary_dim:]))
    assert torch.equal(_bits(got.v), _bits(before.v))
    k64, v = (k64, before.v) if k64.dim() == 4 else (k64[:, None], before.v[:, None])
    written = torch.zeros(got.k_cache.shape[0], got.k_cache.shape[2], dtype=torch.bool)
    for (page, slot), (b, j) in _slots(got).items():
        written[page, slot] = True
        torch.testing.assert_close(got.k_cache[page, :, slot].double(), k64[b, j], **TOLERANCE[dtype])
        assert torch.equal(_bits(got.v_cache[page, :, slot]), _bits(v[b, j]))
    for cache in (got.k_cache, got.v_cache):
        assert cache.transpose(1, 2)[~written.to(cache.device)].isnan().all()


# (lengths, new_tokens, q_heads, kv_heads, head_dim, rotary_dim, page_size): decode with GQA 4x over
# 3 head blocks a token (2 of q, 1 of kv), tokens on a fresh page's first slot (16), a page's last
# (15), slot 1 and mid-page; decode with odd heads 15 / 5 at head_dim 64 in pages of 8; 5 new tokens
# a request crossing a page (30..34 in pages of 32) or starting an empty one, partial rotary;
# 3 new tokens of 7 / 7 heads, half of head_dim 128 rotated, into pages of 64 (62, 63 | 64).
CASES = {
    "decode-gqa4": ([16, 15, 1, 40], None, 32, 8, 128, 128, 16),
    "decode-odd-heads-d64": ([8, 7, 23], None, 15, 5, 64, 64, 8),
    "chunk-partial": ([30, 0], 5, 20, 5, 64, 32, 32),
    "chunk-odd-heads-d128": ([62], 3, 7, 7, 128, 64, 64),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("interleaved", [False, True], ids=["half-split", "interleaved"])
@pytest.mark.parametrize("case", CASES)
def test_fused_kernel_writes_the_bits_of_rope_then_append_and_matches_float64(case, interleaved, dtype):
    lengths, new_tokens, q_heads, kv_heads, head_dim, rotary_dim, page_size = CASES[case]
    step = _step(lengths, new_tokens, q_heads, kv_heads, head_dim, page_size, dtype, rotary_dim=rotary_dim)
    before, pair = step.clone(), _two_kernels(step, interleaved)
    rope_append_(*step.args(), interleaved=interleaved)
    _assert_same_bits(step, pair)
    _assert_matches_float64(step, before, interleaved, dtype)


def test_tokens_land_on_the_first_slot_of_a_fresh_page_and_the_last_slot_of_a_page():
    step = _step([8, 7], None, 4, 1, 64, 8, torch.float32)
    rope_append_(*step.args())
    fresh, last = int(step.block_tables[0, 1]), int(step.block_tables[1, 0])
    assert torch.equal(step.k_cache[fresh, :, 0], step.k[0]) and torch.equal(step.v_cache[fresh, :, 0], step.v[0])
    assert torch.equal(step.k_cache[last, :, 7], step.k[1]) and torch.equal(step.v_cache[last, :, 7], step.v[1])
    written = torch.zeros(step.k_cache.shape[0], 8, dtype=torch.bool)
    written[fresh, 0] = written[last, 7] = True
    assert step.k_cache.transpose(1, 2)[~written].isnan().all() and not step.k_cache[fresh, :, 0].isnan().any()


@pytest.mark.parametrize("interleaved", [False, True], ids=["half-split", "interleaved"])
def test_positions_outside_the_table_read_nan_into_q_k_and_the_cache(interleaved):
    step = _step([3, 20, 9], None, 6, 2, 64, 16, torch.bfloat16, rotary_dim=32,
                 positions=[MAX_POSITION, -1, 9])
    pair = _two_kernels(step, interleaved)
    rope_append_(*step.args(), interleaved=interleaved)
    _assert_same_bits(step, pair)
    assert step.q[:2, :, :32].isnan().all() and step.k[:2, :, :32].isnan().all()
    assert not step.q[:, :, 32:].isnan().any() and not step.q[2].isnan().any() and not step.k[2].isnan().any()
    for (page, slot), (b, _) in _slots(step).items():
        rotated = step.k_cache[page, :, slot, :32]  # NaN from the table, for the first two tokens only
        assert rotated.isnan().all() if b < 2 else not rotated.isnan().any()
        assert not step.k_cache[page, :, slot, 32:].isnan().any()  # past rotary_dim: k as it was
        assert not step.v_cache[page, :, slot].isnan().any()


def test_writes_past_the_block_table_row_are_dropped_without_validation():
    # rows of 2 pages of 8: request 0's tokens 14, 15 fit and 16, 17 do not; request 1 is past its row
    # altogether, request 2's length is negative (-2, -1 dropped; 0, 1 written)
    step = _step([14, 16, -2], 4, 8, 2, 64, 8, torch.float16, max_pages=2, positions=[[1, 2, 3, 4]] * 3)
    assert len(_slots(step)) == 4
    before, pair = step.clone(), _two_kernels(step, False)
    rope_append_(*step.args(), validate=False)
    _assert_same_bits(step, pair)
    _assert_matches_float64(step, before, False, torch.float16)  # q and k rotated all the same
    with pytest.raises(ValueError, match=r"context_lens\[2\] = -2: every length must be non-negative"):
        rope_append_(*before.args())
    fitting = before.context_lens.clamp(min=0)
    with pytest.raises(ValueError, match=r"context_lens\[0\] \+ 4 new tokens = 18 is longer than block_tables"):
        rope_append_(*replace(before, context_lens=fitting).args())
    _assert_same_bits(before, before.clone())


def test_separate_q_k_v_and_caches_interleaved_in_one_buffer():
    """Every stride differs from the fused buffer's: q (batch, heads, seq, d) storage seen as
    (batch, seq, heads, d), dense k and v, and the caches as halves of one (pages, 2, ...) pool."""
    step = _step([5, 31], 3, 4, 2, 64, 16, torch.float32)
    pool = torch.full((step.k_cache.shape[0], 2, *step.k_cache.shape[1:]), float("nan"))
    q = step.q.transpose(1, 2).contiguous().transpose(1, 2)
    step = replace(step, q=q, k=step.k.contiguous(), v=step.v.contiguous(), k_cache=pool[:, 0], v_cache=pool[:, 1])
    want_q, want_k = q.clone(), step.k.clone()
    want_kc, want_vc = step.k_cache.clone(), step.v_cache.clone()
    apply_rope_(want_q, want_k, step.positions, step.cos_sin, interleaved=True)
    paged_kv_append(want_k, step.v, want_kc, want_vc, step.block_tables, step.context_lens)
    rope_append_(*step.args(), interleaved=True)
    for got, want in ((step.q, want_q), (step.k, want_k), (step.k_cache, want_kc), (step.v_cache, want_vc)):
        assert torch.equal(_bits(got), _bits(want))
    assert int((~step.k_cache.isnan()).all(-1).sum()) == 2 * len(_slots(step)) == 2 * 6  # 2 kv heads a slot


def test_an_empty_batch_writes_nothing():
    step = _step([3], None, 2, 1, 16, 8, torch.float32)
    empty = replace(step, q=step.q[:0], k=step.k[:0], v=step.v[:0], positions=step.positions[:0],
                    block_tables=step.block_tables[:0], context_lens=step.context_lens[:0])
    rope_append_(*empty.args())
    rope_paged_kv_append(*empty.args())
    assert step.k_cache.isnan().all()


def test_bad_inputs_are_refused_before_anything_is_written():
    step = _step([3, 9], None, 4, 2, 16, 8, torch.float32)
    s = step
    wild = s.block_tables.clone()
    wild[1, 1] = 99
    cases = [
        (dict(cos_sin=s.cos_sin.double()), "float32 table"),
        (dict(cos_sin=cos_sin_table(MAX_POSITION, 32)), r"rotary_dim must be even, >= 2 and <= head_dim 16"),
        (dict(q=s.q.half()), "share one floating-point dtype"),
        (dict(q=s.q[:1]), "share the leading"),
        (dict(positions=s.positions[:, None]), "share the leading"),
        (dict(positions=s.positions.float()), "positions must be int32 or int64"),
        (dict(v=s.v[:, :1]), "new_k and new_v must be .* of one shape"),
        (dict(k_cache=s.k_cache.half(), v_cache=s.v_cache.half()), "must have the cache's dtype"),
        (dict(k_cache=s.k_cache[:, :1], v_cache=s.v_cache[:, :1]), r"new_k has \(2, 16\)"),
        (dict(k_cache=s.k_cache.double(), v_cache=s.v_cache.double()), "one dtype of float16, bfloat16, float32"),
        (dict(block_tables=s.block_tables[:1]), r"block_tables must be \(batch=2"),
        (dict(context_lens=s.context_lens.long()), "must be int32"),
        (dict(context_lens=s.context_lens + 8), r"context_lens\[1\] \+ 1 new tokens = 18 is longer than"),
        (dict(block_tables=wild), r"block_tables\[1, 1\] = 99 is not a page of the pool"),
    ]
    before = step.clone()
    for change, message in cases:
        bad = replace(step, **change)
        for run in (rope_append_, rope_paged_kv_append):
            with pytest.raises(ValueError, match=message):
                run(*bad.args())
    _assert_same_bits(step, before)


# --- the custom op -----------------------------------------------------------------------------

def test_op_on_the_cpu_is_the_eager_pair_bit_for_bit_as_the_kernel():
    step = _step([16, 15, 4], 2, 8, 2, 64, 16, torch.bfloat16)
    eager = step.clone()
    rope_reference_(eager.q, eager.k, eager.positions, eager.cos_sin, interleaved=True)
    paged_kv_append_reference(eager.k, eager.v, eager.k_cache, eager.v_cache, eager.block_tables, eager.context_lens)
    kernel = step.clone()
    rope_append_(*kernel.args(), interleaved=True)
    rope_paged_kv_append(*step.args(), interleaved=True)
    _assert_same_bits(step, eager)
    _assert_same_bits(step, kernel)  # the interpreter's fp32 arithmetic is the eager pair's, one op at a time


def test_op_passes_opcheck_and_compiles_into_one_graph_with_its_mutations():
    step = _step([3, 9], None, 4, 2, 16, 8, torch.float32)
    step.k_cache.nan_to_num_(0.0)  # opcheck compares runs with NaN != NaN
    step.v_cache.nan_to_num_(0.0)
    fresh = step.clone()
    torch.library.opcheck(torch.ops.kforge.rope_paged_kv_append.default,
                          (*(t.clone() for t in fresh.args()), False, True))

    def layer(q, k, v, positions, cos_sin, k_cache, v_cache, block_tables, context_lens):
        rope_paged_kv_append(q, k, v, positions, cos_sin, k_cache, v_cache, block_tables, context_lens,
                             validate=False)
        return q * 2, k_cache.sum()

    eager = step.clone()
    expected = layer(*eager.args())
    got = torch.compile(layer, backend="aot_eager", fullgraph=True)(*step.args())
    torch.testing.assert_close(got, expected)
    _assert_same_bits(step, eager)  # the mutations reached the caller's tensors, q and k in their buffer


# --- the sm_90 build ---------------------------------------------------------------------------

@pytest.mark.slow
def test_llama3_decode_tiles_compile_for_the_h100_without_spills():
    from triton_sm90 import compile_sm90, spec

    strides = ("q_batch_stride", "q_seq_stride", "q_head_stride", "k_batch_stride", "k_seq_stride", "k_head_stride",
               "v_batch_stride", "v_seq_stride", "v_head_stride", "stride_kp", "stride_kh", "stride_kt", "stride_vp",
               "stride_vh", "stride_vt")
    types = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "pos_ptr": "*i64", "table_ptr": "*fp32",
             "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "block_tables_ptr": "*i32", "context_lens_ptr": "*i32",
             **{name: "i32" for name in ("n_q_heads", "n_kv_heads", "new_tokens", "max_position", "half",
                                         "max_pages", "stride_table", *strides)}}
    aligned = ("q_ptr", "k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr", "table_ptr", "half", *strides)
    found = compile_sm90([spec(f"interleaved={interleaved}", "kforge.kernels.serving.rope_append",
                               "rope_append_kernel", types,
                               {"HEADS_BLOCK": 16, "HALF_BLOCK": 64, "HEAD_DIM": 128, "PAGE_SIZE": 16,
                                "PARTIAL": False, "INTERLEAVED": interleaved}, aligned=aligned, num_stages=1)
                          for interleaved in (False, True)])
    for label, kernel in found.items():
        # 16-byte accesses to q, k, v and the caches; rope_kernel's tiles take 40 registers
        assert kernel["spills"] == 0 and kernel["local"] == 0, (label, kernel)
        assert kernel["ldg128"] > 0 and kernel["stg128"] > 0 and kernel["registers"] <= 64, (label, kernel)


# --- on the GPU ------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [False, True], ids=["half-split", "interleaved"])
@pytest.mark.parametrize("batch", [1, 8])
def test_on_the_gpu_at_llama3_8b_decode_the_kernel_writes_the_bits_of_rope_then_append(batch, interleaved):
    lengths = [16, 15, 1, 4000, 33, 127, 128, 2047][:batch]  # fresh pages' first slots, pages' last
    step = _step(lengths, None, 32, 8, 128, 16, torch.bfloat16, seed=batch, device="cuda")
    step = replace(step, cos_sin=cos_sin_table(8192, 128, 500000.0, "cuda"))
    before, pair = step.clone(), _two_kernels(step, interleaved)
    rope_append_(*step.args(), interleaved=interleaved, validate=False)
    torch.cuda.synchronize()
    _assert_same_bits(step, pair)
    _assert_matches_float64(step, before, interleaved, torch.bfloat16)

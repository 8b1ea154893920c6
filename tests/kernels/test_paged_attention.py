"""Paged KV cache and paged decode attention: the Triton kernels under the interpreter (fp16,
fp32; bf16 for the append, which only copies) against per-request dense attention in
float64, on ragged lengths around page and partition boundaries, GQA 1-8, head dims
16-128, page sizes 8-256, shuffled block tables over a NaN-filled pool whose unused pages
and slots must never be read; the append (exactly the new slots change, and attention
over the result equals attention over the dense concatenation); a seeded property test
over random configurations; the checks; the custom ops and PagedKVCache. Every decode
through `_decode` / `_both_paths` runs both reduces, two kernels and fused, and asserts
the same bits; the fused reduce's own tests: GQA groups on ragged batches, any order of
the programs (the interpreter's grid permuted), other step sizes, an empty request, the
counters (zero after every call, allocated once, never during a capture), the sm_90 build.
On a GPU: bf16 at the issue's target shape, ragged batches in bf16, fp16 and fp32 with
head dims 64-256, page sizes 16-256 and groups 1-16, all against float64; the fused reduce
against two kernels bit for bit at llama3-8b decode shapes, eagerly and in a CUDA graph."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest
import torch
import triton
import triton.language as tl

from kforge.kernels.attention.naive import naive_attention
from kforge.kernels.serving import paged_decode as paged_decode_module
from kforge.kernels.serving.paged_decode import (MIN_COUNTERS, DecodePlan, paged_decode, paged_decode_min_bytes,
                                                 paged_decode_reference, plan_decode, reduce_counters)
from kforge.kernels.serving.paged_kv import (gather_pages, paged_kv_append, paged_kv_append_min_bytes,
                                             paged_kv_append_reference)
from kforge.ops.paged_attention import PagedKVCache
from kforge.ops.paged_attention import paged_decode_attention as paged_decode_op
from kforge.ops.paged_attention import paged_kv_append as paged_kv_append_op

# fp16: P is rounded to fp16 before P V and the output to fp16 (2^-11 relative each);
# fp32: ieee products, so only the order of the sums and exp2 differ from float64 (seen: 8e-7).
TOLERANCE = {torch.float16: 2e-3, torch.float32: 5e-6}
SPLIT = {"BLOCK_N": 16, "partition_size": 32}  # several partitions: both kernels run
WHOLE = {"BLOCK_N": 16, "partition_size": 1024}  # one partition: kernel 1 writes the output


@dataclass
class Paged:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    dense_k: list[torch.Tensor]  # per request (length, kv_heads, head_dim)
    dense_v: list[torch.Tensor]


def _paged(lengths, kv_heads, head_dim, page_size, dtype, *, seed=0, room=0, spare_pages=2, max_pages=None,
           device="cpu") -> Paged:
    """Requests of `lengths` tokens in shuffled pages of a pool, each holding pages for `room`
    more tokens; every slot not holding a token (spare pages, the tail of each last page) is
    NaN, and the block-table entries past each request's pages name spare pages, so reading
    anything not in use shows."""
    g = torch.Generator().manual_seed(seed)
    held = [math.ceil((n + room) / page_size) for n in lengths]
    max_pages = max_pages or max(1, *held)
    num_pages = sum(held) + spare_pages
    order = torch.randperm(num_pages, generator=g)
    spare = order[sum(held):]
    k_cache = torch.full((num_pages, kv_heads, page_size, head_dim), float("nan"), dtype=dtype, device=device)
    v_cache = torch.full_like(k_cache, float("nan"))
    block_tables = spare[torch.randint(len(spare), (len(lengths), max_pages), generator=g)].int()
    dense_k, dense_v = [], []
    first = 0
    for b, n in enumerate(lengths):
        pages = order[first:first + held[b]]
        first += held[b]
        block_tables[b, :held[b]] = pages.int()
        for dense, cache in ((dense_k, k_cache), (dense_v, v_cache)):
            tokens = torch.randn(n, kv_heads, head_dim, generator=g).to(dtype)
            dense.append(tokens.to(device))
            filled = torch.full((held[b] * page_size, kv_heads, head_dim), float("nan"), dtype=dtype)
            filled[:n] = tokens
            cache[pages.to(device)] = filled.view(held[b], page_size, kv_heads, head_dim).transpose(1, 2).to(device)
    return Paged(k_cache, v_cache, block_tables.to(device), torch.tensor(lengths, dtype=torch.int32, device=device),
                 dense_k, dense_v)


def _query(batch, q_heads, head_dim, dtype, seed=1, device="cpu", spread=1.0):
    g = torch.Generator().manual_seed(seed)
    return (spread * torch.randn(batch, q_heads, head_dim, generator=g)).to(dtype=dtype, device=device)


def _dense_attention(q, dense_k, dense_v, scale=None):
    """Each request on its own: dense K, V (tokens, kv_heads, d) through naive attention, float64."""
    rows = []
    for b, (k, v) in enumerate(zip(dense_k, dense_v)):
        k, v = (t.double().to(q.device).transpose(0, 1)[None] for t in (k, v))
        rows.append(naive_attention(q[b].double()[None, :, None], k, v, scale=scale)[0, :, 0])
    return torch.stack(rows)


def _bits(t):
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _assert_same_bits(out, expected):
    assert out.dtype == expected.dtype and out.shape == expected.shape
    differ = _bits(out) != _bits(expected)
    assert not differ.any(), f"{int(differ.sum())} of {differ.numel()} elements differ"


def _counters_at_rest(device):
    counters = paged_decode_module._counters.get(torch.device(device))
    return counters is None or not counters.any()


def _both_paths(q, k_cache, v_cache, block_tables, context_lens, **kwargs):
    """paged_decode with two kernels, then with the fused reduce: the same bits, and the
    counters back at zero. Returns the output."""
    two = paged_decode(q, k_cache, v_cache, block_tables, context_lens, fused_reduce=False, **kwargs)
    fused = paged_decode(q, k_cache, v_cache, block_tables, context_lens, fused_reduce=True, **kwargs)
    _assert_same_bits(fused, two)
    assert _counters_at_rest(q.device)
    return fused


def _decode(q, paged, **kwargs):
    return _both_paths(q, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens, **kwargs)


def _assert_matches(out, expected, dtype):
    tol = TOLERANCE[dtype]
    assert out.dtype == dtype and out.shape == expected.shape
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


@pytest.fixture
def nan_buffers(monkeypatch):
    """Every buffer the decode kernels write starts as NaN: an element not written shows."""
    monkeypatch.setattr(paged_decode_module, "_empty",
                        lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device))


# --- the cache and the reference -------------------------------------------------------------

def test_gather_pages_reads_each_request_back_in_token_order():
    paged = _paged([1, 15, 16, 17, 40], kv_heads=2, head_dim=16, page_size=16, dtype=torch.float32)
    for b, n in enumerate(paged.context_lens.tolist()):
        for cache, dense in ((paged.k_cache, paged.dense_k[b]), (paged.v_cache, paged.dense_v[b])):
            assert torch.equal(gather_pages(cache, paged.block_tables[b], n), dense)


def test_reference_matches_dense_attention_in_float64_and_ignores_unused_entries():
    paged = _paged([1, 7, 8, 9, 30], kv_heads=2, head_dim=16, page_size=8, dtype=torch.float64, max_pages=6)
    q = _query(5, 8, 16, torch.float64)
    expected = _dense_attention(q, paged.dense_k, paged.dense_v, scale=0.3)
    tables = paged.block_tables.clone()
    tables[0, 1:] = -1  # "no page" markers and ids far outside the pool, past each request's pages
    tables[4, 4:] = 2**30
    out = paged_decode_reference(q, paged.k_cache, paged.v_cache, tables, paged.context_lens, 0.3)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    # the benchmark's torch.compile baseline: one graph, no device reads
    compiled = torch.compile(paged_decode_reference, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, paged.k_cache, paged.v_cache, tables, paged.context_lens, 0.3), expected,
                               rtol=1e-12, atol=1e-12)


def test_min_bytes_count_k_and_v_once_plus_q_out_and_tables():
    target = paged_decode_min_bytes(64, 4096, 32, 8, 128, torch.bfloat16)
    assert target == 2 * 64 * 4096 * 8 * 128 * 2 + 2 * 64 * 32 * 128 * 2 + 4 * 64 + 4 * 64 * 256
    assert 2 * 64 * 4096 * 8 * 128 * 2 == 1_073_741_824  # the 1.07 GB
    ragged = paged_decode_min_bytes(2, [1, 17], 4, 2, 16, torch.float32, page_size=16)
    assert ragged == 2 * 18 * 2 * 16 * 4 + 2 * 2 * 4 * 16 * 4 + 4 * 2 + 4 * (1 + 2)
    with pytest.raises(ValueError, match="3 context lengths for a batch of 2"):
        paged_decode_min_bytes(2, [1, 2, 3], 4, 2, 16, torch.float32)
    assert paged_kv_append_min_bytes(64, 1, 8, 128, torch.bfloat16) == 4 * 64 * 8 * 128 * 2 + 4 * 64 + 4 * 64
    assert paged_kv_append_min_bytes(2, 40, 1, 16, torch.float32, page_size=16) == 4 * 80 * 16 * 4 + 8 + 8 * 3


# --- the plan --------------------------------------------------------------------------------

def test_plan_fills_the_h100_without_splitting_what_is_already_full():
    # the target: 64 x 8 = 512 programs already: no partitions, no second kernel
    assert plan_decode(64, 8, 4096, 128, 2) == DecodePlan(block_n=64, partition_size=4096, num_partitions=1)
    # batch 1: 8 programs per partition; 32 partitions of 128 tokens (the smallest) -> 256 programs,
    # each one 128-token tile (a second tile walked in turn is a second round of latency)
    assert plan_decode(1, 8, 4096, 128, 2) == DecodePlan(block_n=128, partition_size=128, num_partitions=32)
    assert plan_decode(1, 8, 4096, 128, 2, config={"partition_size": 128}).block_n == 64, "asked, not chosen"
    assert plan_decode(1, 8, 4096, 256, 2).block_n == 32, "a 128-token tile of head dim 256 is 64 KB: too big"
    assert plan_decode(64, 8, 128, 128, 2).block_n == 64, "512 programs fill the GPU: bytes, not latency"
    batch_8 = plan_decode(8, 8, 4096, 128, 2)
    assert batch_8.num_partitions == 5 and 8 * 8 * batch_8.num_partitions >= 2 * 132
    assert batch_8.partition_size % 64 == 0 and batch_8.partition_size * 5 >= 4096
    # tiles are 16 KB of K: wider for short heads and narrow elements, capped to 16..128 tokens
    assert [plan_decode(64, 8, 4096, d, 2).block_n for d in (16, 64, 128, 256)] == [128, 128, 64, 32]
    assert plan_decode(64, 8, 4096, 128, 4).block_n == 32 and plan_decode(1, 1, 5, 16, 2).num_partitions == 1
    assert plan_decode(1, 8, 4096, 128, 2, num_sms=16).num_partitions == 4  # fewer SMs, fewer partitions


def test_plan_config_overrides_are_checked():
    assert plan_decode(2, 2, 100, 16, 4, config=SPLIT) == DecodePlan(16, 32, 4)
    for config, message in (({"BLOCK_N": 24}, "power of two"), ({"BLOCK_N": 32, "partition_size": 48}, "multiple"),
                            ({"partition_size": 8}, "multiple"), ({"block_n": 16}, "unknown config keys"),
                            ({"BLOCK_N": 16, "partition_size": 16}, "65535")):
        with pytest.raises(ValueError, match=message):
            plan_decode(2, 2, 16 * 70_000 if "partition_size" in config else 100, 16, 4, config=config)


# --- the decode kernels under the interpreter ------------------------------------------------

@pytest.mark.parametrize("config", [SPLIT, WHOLE], ids=["split", "whole"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.slow
def test_decode_on_ragged_lengths_around_page_and_partition_boundaries(dtype, config, nan_buffers):
    # 1, page-1, page, page+1, several pages, and lengths not multiples of the partition (32)
    lengths = [1, 15, 16, 17, 50, 64, 77]
    paged = _paged(lengths, kv_heads=2, head_dim=32, page_size=16, dtype=dtype)
    q = _query(len(lengths), 8, 32, dtype, spread=2.0)
    _assert_matches(_decode(q, paged, config=config), _dense_attention(q, paged.dense_k, paged.dense_v), dtype)


@pytest.mark.parametrize("q_heads,kv_heads", [(2, 2), (4, 2), (8, 2), (8, 1)], ids=lambda x: str(x))
def test_decode_reads_each_kv_head_for_its_whole_query_group(q_heads, kv_heads):
    paged = _paged([9, 40], kv_heads=kv_heads, head_dim=16, page_size=8, dtype=torch.float32, seed=q_heads)
    q = _query(2, q_heads, 16, torch.float32, spread=2.0)
    expected = _dense_attention(q, paged.dense_k, paged.dense_v)
    _assert_matches(_decode(q, paged, config=SPLIT), expected, torch.float32)


@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_decode_head_dims(head_dim):
    paged = _paged([3, 33], kv_heads=1, head_dim=head_dim, page_size=16, dtype=torch.float16, seed=head_dim)
    q = _query(2, 4, head_dim, torch.float16)
    expected = _dense_attention(q, paged.dense_k, paged.dense_v)
    _assert_matches(_decode(q, paged, config=SPLIT), expected, torch.float16)


@pytest.mark.parametrize("page_size", [8, 32, 256])
def test_decode_page_sizes_smaller_and_larger_than_the_tile(page_size, nan_buffers):
    lengths = [1, page_size - 1, page_size + 3, 2 * page_size + 5] if page_size < 256 else [1, 40, 100]
    paged = _paged(lengths, kv_heads=1, head_dim=16, page_size=page_size, dtype=torch.float32, seed=page_size)
    q = _query(len(lengths), 2, 16, torch.float32)
    _assert_matches(_decode(q, paged, config={"BLOCK_N": 16, "partition_size": 48}),
                    _dense_attention(q, paged.dense_k, paged.dense_v), torch.float32)


def test_decode_default_plan_and_scale(nan_buffers):
    paged = _paged([5, 130, 300], kv_heads=2, head_dim=16, page_size=16, dtype=torch.float32, seed=3)
    q = _query(3, 4, 16, torch.float32, spread=2.0)
    plan = plan_decode(3, 2, paged.block_tables.shape[1] * 16, 16, 4)
    assert plan.num_partitions == 3  # the default plan splits this batch; short requests skip partitions
    for scale in (None, 0.05, -0.3):
        _assert_matches(_decode(q, paged, scale=scale), _dense_attention(q, paged.dense_k, paged.dense_v, scale),
                        torch.float32)


def test_decode_takes_strided_q_and_caches_with_different_strides():
    paged = _paged([20, 7], kv_heads=2, head_dim=16, page_size=8, dtype=torch.float32, seed=5)
    # q as a model hands it over: a slice of a fused (batch, q + k + v heads, d) projection
    fused = _query(2, 8, 16, torch.float32)
    q = fused[:, :4]
    # k as one half of a (pages, 2, ...) K/V buffer; v with padded rows (a token stride of 24)
    both = torch.stack([paged.k_cache, paged.v_cache], dim=1)
    padded = torch.full((*paged.v_cache.shape[:3], 24), float("nan"))
    padded[..., :16] = paged.v_cache
    k_cache, v_cache = both[:, 0], padded[..., :16]
    assert k_cache.stride() != v_cache.stride() and q.stride(1) == 16 and q.stride(0) == 128
    out = _both_paths(q, k_cache, v_cache, paged.block_tables, paged.context_lens, config=SPLIT)
    _assert_matches(out, _dense_attention(q, paged.dense_k, paged.dense_v), torch.float32)


def test_decode_never_reads_table_entries_past_a_request_pages():
    paged = _paged([3, 17], kv_heads=1, head_dim=16, page_size=8, dtype=torch.float32, max_pages=5, seed=6)
    tables = paged.block_tables.clone()
    tables[0, 1:] = -1
    tables[1, 3:] = 2**30  # a read there would fault or return garbage
    q = _query(2, 2, 16, torch.float32)
    out = _both_paths(q, paged.k_cache, paged.v_cache, tables, paged.context_lens, config=SPLIT)
    _assert_matches(out, _dense_attention(q, paged.dense_k, paged.dense_v), torch.float32)


def test_decode_without_validation_clamps_lengths_to_the_block_table():
    paged = _paged([16, 10], kv_heads=1, head_dim=16, page_size=8, dtype=torch.float32, seed=7)
    lens = torch.tensor([16 + 5, 10], dtype=torch.int32)  # past the 2 pages x 8 tokens of the row
    q = _query(2, 2, 16, torch.float32)
    out = _both_paths(q, paged.k_cache, paged.v_cache, paged.block_tables, lens, validate=False, config=SPLIT)
    _assert_matches(out, _dense_attention(q, paged.dense_k, paged.dense_v), torch.float32)


def test_decode_and_append_take_an_empty_batch():
    paged = _paged([5], kv_heads=2, head_dim=16, page_size=8, dtype=torch.float32)
    tables, lens = paged.block_tables[:0], paged.context_lens[:0]
    out = paged_decode(torch.empty(0, 4, 16), paged.k_cache, paged.v_cache, tables, lens)
    assert out.shape == (0, 4, 16)
    before = paged.k_cache.clone()
    paged_kv_append(torch.empty(0, 2, 16), torch.empty(0, 2, 16), paged.k_cache, paged.v_cache, tables, lens)
    torch.testing.assert_close(paged.k_cache, before, rtol=0, atol=0, equal_nan=True)


@pytest.mark.slow
def test_property_paged_decode_equals_dense_attention_on_random_configurations(nan_buffers):
    rng = random.Random(2024)
    for case in range(24):
        page_size = rng.choice([8, 16, 32])
        kv_heads, group = rng.choice([1, 2]), rng.choice([1, 2, 4, 8])
        head_dim = rng.choice([16, 32])
        lengths = [rng.randint(1, 4 * page_size + 3) for _ in range(rng.randint(1, 4))]
        dtype = rng.choice([torch.float16, torch.float32])
        block_n = rng.choice([16, 32])
        config = {"BLOCK_N": block_n, "partition_size": block_n * rng.randint(1, 4)}
        paged = _paged(lengths, kv_heads, head_dim, page_size, dtype, seed=case, spare_pages=rng.randint(1, 4),
                       max_pages=math.ceil(max(lengths) / page_size) + rng.randint(0, 2))
        q = _query(len(lengths), kv_heads * group, head_dim, dtype, seed=100 + case, spread=rng.uniform(0.5, 4))
        scale = rng.choice([None, rng.uniform(0.05, 0.5)])
        out = _decode(q, paged, scale=scale, config=config)
        expected = _dense_attention(q, paged.dense_k, paged.dense_v, scale)
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol, msg=lambda m: (
            f"case {case}: lengths {lengths} page {page_size} heads {kv_heads}x{group} d {head_dim} {dtype} "
            f"{config}: {m}"))


# --- the fused reduce ------------------------------------------------------------------------

@pytest.fixture
def reduce_launches(monkeypatch):
    """The grids kernel 2 is launched with, in order."""
    launched, kernel = [], paged_decode_module.paged_decode_reduce_kernel

    class Recorded:
        def __getitem__(self, grid):
            launched.append(grid)
            return kernel[grid]

    monkeypatch.setattr(paged_decode_module, "paged_decode_reduce_kernel", Recorded())
    return launched


@pytest.fixture
def program_order(monkeypatch):
    """program_order(order): from then on the interpreter runs each launch's programs in
    `order`, "reversed" or a seed to shuffle them with, not in the grid's row-major order;
    each still runs once. (On a GPU a group's programs finish in any order.)"""
    from triton.runtime.interpreter import interpreter_builder as builder

    set_dim, set_index = builder.set_grid_dim, builder.set_grid_idx
    cells = []

    def permuted_dim(nx, ny, nz):
        set_dim(nx, ny, nz)
        cells[:] = [(x, y, z) for x in range(nx) for y in range(ny) for z in range(nz)]
        if order == "reversed":
            cells.reverse()
        else:
            random.Random(order).shuffle(cells)

    def permuted_index(x, y, z):  # the interpreter's loop walks row-major: the k-th program runs as cells[k]
        _, ny, nz = builder.grid_dim
        set_index(*cells[(x * ny + y) * nz + z])

    def run_in(new_order):
        nonlocal order
        order = new_order
        monkeypatch.setattr(builder, "set_grid_dim", permuted_dim)
        monkeypatch.setattr(builder, "set_grid_idx", permuted_index)

    order = None
    return run_in


@triton.jit
def _tickets_kernel(counter_ptr, tickets_ptr):
    program = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    tl.store(tickets_ptr + program, tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu"))


def test_program_order_runs_every_program_once_in_the_order_given(program_order):
    counter, tickets = torch.zeros(1, dtype=torch.int32), torch.full((12,), -1, dtype=torch.int32)
    _tickets_kernel[(3, 4)](counter, tickets)
    assert tickets.tolist() == list(range(12))  # the grid's order: tickets in program order
    program_order("reversed")
    counter.zero_()
    _tickets_kernel[(3, 4)](counter, tickets)
    assert tickets.tolist() == list(range(11, -1, -1))
    program_order(5)
    counter.zero_()
    _tickets_kernel[(3, 4)](counter, tickets)
    assert sorted(tickets.tolist()) == list(range(12)) and tickets.tolist() != list(range(12))


@pytest.mark.parametrize("q_heads,kv_heads,dtype", [(2, 2, torch.float32), (4, 2, torch.float16), (8, 2, torch.float32),
                                                    (8, 1, torch.float16), (12, 4, torch.float32)], ids=str)
@pytest.mark.filterwarnings("ignore:invalid value encountered in divide")  # the tail's padded row, never stored
@pytest.mark.slow
def test_fused_reduce_writes_the_two_kernel_bits_in_one_launch(q_heads, kv_heads, dtype, nan_buffers,
                                                                reduce_launches):
    # up to 3 partitions of 32: the widest first, 1 token, page tails (15, 17), a partition's edge and
    # one past it (64, 33); a group of 3 (12 / 4) leaves a padded row in the tail's block of heads
    lengths = [77, 1, 15, 17, 64, 33]
    paged = _paged(lengths, kv_heads, 32, 16, dtype, seed=q_heads * kv_heads)
    q = _query(len(lengths), q_heads, 32, dtype, spread=2.0)
    args = (q, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens)
    two = paged_decode(*args, config=SPLIT, fused_reduce=False)
    assert len(reduce_launches) == 1
    fused = [paged_decode(*args, config=SPLIT, fused_reduce=True) for _ in range(2)]  # the second: counters reset
    assert len(reduce_launches) == 1 and _counters_at_rest("cpu")
    for out in fused:
        _assert_same_bits(out, two)
    _assert_matches(fused[0], _dense_attention(q, paged.dense_k, paged.dense_v), dtype)


@pytest.mark.parametrize("order", ["reversed", 1, 2])
def test_fused_reduce_does_not_depend_on_which_program_finishes_last(order, program_order, nan_buffers):
    # reversed: each group's partition 0 arrives last, after the programs past a short request's length
    lengths = [100, 1, 40, 96, 65]
    paged = _paged(lengths, kv_heads=2, head_dim=16, page_size=8, dtype=torch.float32, seed=21)
    q = _query(5, 8, 16, torch.float32, spread=2.0)
    args = (q, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens)
    two = paged_decode(*args, config=SPLIT, fused_reduce=False)
    program_order(order)
    _assert_same_bits(paged_decode(*args, config=SPLIT, fused_reduce=True), two)
    assert _counters_at_rest("cpu")


@pytest.mark.parametrize("elements", [32, 64, 128])
def test_fused_reduce_in_other_steps_than_kernel_2_gives_the_same_bits(elements, monkeypatch, nan_buffers):
    monkeypatch.setattr(paged_decode_module, "REDUCE_ELEMENTS", elements)
    # 7 partitions of 16; head dim 16, group 4: the tail's steps are 1, 1, 2 partitions, kernel 2's 2, 4, 8
    steps = paged_decode_module._reduce_block(7, 4, 16), paged_decode_module._reduce_block(7, 1, 16)
    assert steps == {32: (1, 2), 64: (1, 4), 128: (2, 8)}[elements]
    paged = _paged([112, 3, 50], kv_heads=2, head_dim=16, page_size=8, dtype=torch.float16, seed=22)
    q = _query(3, 8, 16, torch.float16, spread=2.0)
    out = _decode(q, paged, config={"BLOCK_N": 16, "partition_size": 16})
    _assert_matches(out, _dense_attention(q, paged.dense_k, paged.dense_v), torch.float16)


@pytest.mark.filterwarnings("ignore:invalid value encountered in divide")  # 0 / 0, on purpose
def test_fused_reduce_writes_an_empty_request_as_two_kernels_do(monkeypatch):
    monkeypatch.setattr(paged_decode_module, "_empty",  # 7, not NaN: an unwritten row shows
                        lambda shape, dtype, device: torch.full(shape, 7.0, dtype=dtype, device=device))
    paged = _paged([40, 1, 70], kv_heads=2, head_dim=16, page_size=8, dtype=torch.float32, seed=23)
    lens = paged.context_lens.clone()
    lens[1] = 0  # validate=False lets it through: 0 / 0
    q = _query(3, 4, 16, torch.float32)
    out = _both_paths(q, paged.k_cache, paged.v_cache, paged.block_tables, lens, validate=False, config=SPLIT)
    assert out[1].isnan().all() and not out[[0, 2]].isnan().any()
    _assert_matches(out[[0, 2]], _dense_attention(q, paged.dense_k, paged.dense_v)[[0, 2]], torch.float32)


@pytest.mark.parametrize("flag", [False, True])
def test_fused_reduce_defaults_to_the_module_flag_and_leaves_one_partition_alone(flag, monkeypatch,
                                                                                reduce_launches):
    monkeypatch.setattr(paged_decode_module, "FUSED_REDUCE", flag)
    monkeypatch.setattr(paged_decode_module, "_counters", {})
    paged = _paged([70, 9], kv_heads=1, head_dim=16, page_size=8, dtype=torch.float32, seed=24)
    q = _query(2, 2, 16, torch.float32)
    expected = _dense_attention(q, paged.dense_k, paged.dense_v)
    _assert_matches(paged_decode(q, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens,
                                 config=WHOLE, fused_reduce=True), expected, torch.float32)
    assert paged_decode_module._counters == {} and reduce_launches == []  # one partition: no counters, no kernel 2
    _assert_matches(paged_decode(q, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens,
                                 config=SPLIT), expected, torch.float32)
    assert len(reduce_launches) == (0 if flag else 1) and (torch.device("cpu") in paged_decode_module._counters) == flag


def test_fused_reduce_counters_are_allocated_once_and_outgrown_ones_kept(monkeypatch):
    monkeypatch.setattr(paged_decode_module, "_counters", {})
    monkeypatch.setattr(paged_decode_module, "_outgrown", [])
    first = reduce_counters("cpu", 3)
    assert first.dtype == torch.int32 and first.numel() == MIN_COUNTERS and not first.any()
    assert reduce_counters(torch.device("cpu"), MIN_COUNTERS) is first
    paged = _paged([50, 20, 7], kv_heads=2, head_dim=16, page_size=8, dtype=torch.float32, seed=25)
    _decode(_query(3, 4, 16, torch.float32), paged, config=SPLIT)
    assert paged_decode_module._counters[torch.device("cpu")] is first and not first.any()
    grown = reduce_counters("cpu", MIN_COUNTERS + 1)  # a captured graph may hold `first`: it stays allocated
    assert grown.numel() == MIN_COUNTERS + 1 and not grown.any()
    assert len(paged_decode_module._outgrown) == 1 and paged_decode_module._outgrown[0] is first


def test_fused_reduce_never_allocates_counters_while_capturing(monkeypatch, reduce_launches):
    monkeypatch.setattr(paged_decode_module, "_counters", {})
    paged = _paged([50, 20, 7], kv_heads=2, head_dim=16, page_size=8, dtype=torch.float32, seed=26)
    q = _query(3, 4, 16, torch.float32)
    args = (q, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens)
    two = paged_decode(*args, config=SPLIT, fused_reduce=False)
    monkeypatch.setattr(paged_decode_module, "_capturing", lambda device: True)
    with pytest.warns(RuntimeWarning, match="reduces with a second kernel"):
        _assert_same_bits(paged_decode(*args, config=SPLIT, fused_reduce=True), two)
    assert paged_decode_module._counters == {} and len(reduce_launches) == 2
    monkeypatch.setattr(paged_decode_module, "_capturing", lambda device: False)
    reserved = reduce_counters("cpu", 6)  # reserved ahead of the capture: fused, nothing allocated
    monkeypatch.setattr(paged_decode_module, "_capturing", lambda device: True)
    _assert_same_bits(paged_decode(*args, config=SPLIT, fused_reduce=True), two)
    assert len(reduce_launches) == 2 and paged_decode_module._counters[torch.device("cpu")] is reserved
    assert not reserved.any()


@pytest.mark.slow
def test_decode_kernels_compile_for_the_h100_without_spills_fused_or_not():
    from triton_sm90 import compile_sm90, spec

    module = "kforge.kernels.serving.paged_decode"
    ints = ("stride_qb", "stride_qh", "stride_kp", "stride_kh", "stride_kt", "stride_vp", "stride_vh", "stride_vt",
            "stride_table", "kv_heads", "max_pages", "num_partitions", "partition_size")
    types = {"q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "block_tables_ptr": "*i32",
             "context_lens_ptr": "*i32", "out_ptr": "*bf16", "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32",
             "part_acc_ptr": "*fp32", "counters_ptr": "*i32", "qk_scale": "fp32", **{name: "i32" for name in ints}}
    aligned = ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr", "part_max_ptr", "part_sum_ptr", "part_acc_ptr",
               "max_pages", "partition_size", *ints[:9])
    llama3_8b = {"GROUP": 4, "BLOCK_G": 16, "HEAD_DIM": 128, "PAGE_SIZE": 16, "BLOCK_N": 64, "DOT_PRECISION": "tf32"}
    # the unsplit build (SPLIT=False) is left out: it holds 128 registers and spills 8 bytes, fused reduce or not
    builds = {"split": {"SPLIT": True, "FUSED": False, "BLOCK_H": 1, "BLOCK_M": 1, "BLOCK_P": 1}}
    for group in (1, 2, 4, 8, 16):  # the tail's steps at 32 partitions (batch 1, context 4096), as paged_decode's
        builds[f"fused, group {group}"] = {"SPLIT": True, "FUSED": True, "GROUP": group, "BLOCK_H": group,
                                           "BLOCK_M": 32, "BLOCK_P": paged_decode_module._reduce_block(32, group, 128)}
    reduce_types = {"part_max_ptr": "*fp32", "part_sum_ptr": "*fp32", "part_acc_ptr": "*fp32",
                    "context_lens_ptr": "*i32", "out_ptr": "*bf16", "q_heads": "i32", "max_tokens": "i32",
                    "num_partitions": "i32", "partition_size": "i32"}
    found = compile_sm90([spec(label, module, "paged_decode_partition_kernel", types, {**llama3_8b, **build},
                               aligned=aligned) for label, build in builds.items()]
                         + [spec("reduce", module, "paged_decode_reduce_kernel", reduce_types,
                                 {"HEAD_DIM": 128, "BLOCK_M": 32, "BLOCK_P": 32}, aligned=("part_acc_ptr", "out_ptr"))])
    for label, kernel in found.items():
        assert kernel["spills"] == 0 and kernel["local"] == 0, (label, kernel)
        if label != "reduce":  # 4 programs an SM (module docstring), the tail's shared memory none of its own
            assert kernel["registers"] <= 128 and kernel["shared"] == found["split"]["shared"], (label, kernel)
    assert found["reduce"]["registers"] <= 64 and found["reduce"]["shared"] == 0, found["reduce"]


# --- the append ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("new_tokens", [None, 1, 3])  # None: one decode step, (batch, kv_heads, d)
def test_append_writes_exactly_the_new_slots(new_tokens, dtype):
    lengths = [0, 7, 8, 13, 22]  # empty, a page's last slot, a page boundary, crossing into a new page
    tokens = new_tokens or 1
    paged = _paged(lengths, kv_heads=3, head_dim=16, page_size=8, dtype=dtype, room=tokens, seed=8)
    g = torch.Generator().manual_seed(9)
    shape = (5, 3, 16) if new_tokens is None else (5, new_tokens, 3, 16)
    new_k, new_v = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
    expected_k, expected_v = paged.k_cache.clone(), paged.v_cache.clone()
    paged_kv_append_reference(new_k, new_v, expected_k, expected_v, paged.block_tables, paged.context_lens)
    paged_kv_append(new_k, new_v, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens)
    torch.testing.assert_close(paged.k_cache, expected_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(paged.v_cache, expected_v, rtol=0, atol=0, equal_nan=True)
    for b, n in enumerate(lengths):  # the new rows follow each request's old ones, where its table says
        for cache, new, dense in ((paged.k_cache, new_k, paged.dense_k), (paged.v_cache, new_v, paged.dense_v)):
            grown = gather_pages(cache, paged.block_tables[b], n + tokens)
            assert torch.equal(grown, torch.cat([dense[b], new[b].view(tokens, 3, 16)]))


def test_attention_over_the_appended_cache_equals_attention_over_the_concatenation(nan_buffers):
    lengths, new_tokens = [1, 15, 16, 30], 3
    paged = _paged(lengths, kv_heads=2, head_dim=16, page_size=8, dtype=torch.float32, room=new_tokens, seed=10)
    g = torch.Generator().manual_seed(11)
    new_k, new_v = (torch.randn(4, new_tokens, 2, 16, generator=g) for _ in range(2))
    paged_kv_append(new_k, new_v, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens)
    grown = paged.context_lens + new_tokens
    q = _query(4, 4, 16, torch.float32)
    out = _both_paths(q, paged.k_cache, paged.v_cache, paged.block_tables, grown, config=SPLIT)
    dense_k = [torch.cat([k, n]) for k, n in zip(paged.dense_k, new_k)]
    dense_v = [torch.cat([v, n]) for v, n in zip(paged.dense_v, new_v)]
    _assert_matches(out, _dense_attention(q, dense_k, dense_v), torch.float32)


def test_append_without_validation_drops_writes_past_the_block_table():
    paged = _paged([15, 3], kv_heads=1, head_dim=16, page_size=8, dtype=torch.float32, seed=12)
    before = paged.k_cache.clone()
    new = torch.randn(2, 3, 1, 16)
    paged_kv_append(new, new, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens, validate=False)
    # request 0's tokens 15, 16, 17: 15 fits its 2 pages, 16 and 17 do not
    assert torch.equal(gather_pages(paged.k_cache, paged.block_tables[0], 16)[15], new[0, 0])
    written = ~torch.isclose(paged.k_cache, before, equal_nan=True)
    assert written.sum() == 4 * 16  # 1 token of request 0 and 3 of request 1, nothing else


# --- bad input -------------------------------------------------------------------------------

def test_decode_refuses_bad_input_before_running():
    paged = _paged([5, 20], kv_heads=2, head_dim=16, page_size=8, dtype=torch.float32, seed=13)
    k, v, tables, lens = paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens
    q = _query(2, 4, 16, torch.float32)
    longer, empty, wild = lens.clone(), lens.clone(), tables.clone()
    longer[1] = 25
    empty[0] = 0
    wild[1, 2] = 99
    cases = [
        ((q[0], k, v, tables, lens), "q must be 3-D"),
        ((q.half(), k, v, tables, lens), "share one dtype"),
        ((q, k, v.half(), tables, lens), "k_cache and v_cache must share one dtype"),
        ((q, k, v[:-1], tables, lens), "of one shape"),
        ((q[:, :3], k, v, tables, lens), r"query heads \(3\) must be a positive multiple of kv heads \(2\)"),
        ((q[..., :8], k, v, tables, lens), "head_dim 8 differs"),
        ((q.to(torch.int32), k.to(torch.int32), v.to(torch.int32), tables, lens), "one dtype of float16"),
        ((q, k[:, :, :6], v[:, :, :6], tables, lens), "page_size 6 is not supported"),
        ((q[..., :12], k[..., :12], v[..., :12], tables, lens), "head_dim 12 is not supported"),
        ((q, *(t.transpose(2, 3).contiguous().transpose(2, 3) for t in (k, v)), tables, lens),
         "k_cache needs a contiguous head_dim"),
        ((q, k, v, tables.long(), lens), "must be int32"),
        ((q, k, v, tables, lens.long()), "must be int32"),
        ((q, k, v, tables[:1], lens), r"block_tables must be \(batch=2"),
        ((q, k, v, tables, lens[:1]), r"context_lens must be \(batch=2,\)"),
        ((q, k, v, tables.t().contiguous().t(), lens), "must be contiguous"),
        ((q.to("meta"), k, v, tables, lens), "different devices"),
        ((q, k, v, tables, longer), r"context_lens\[1\] = 25 is longer than block_tables covers: 3 pages x 8"),
        ((q, k, v, tables, empty), r"context_lens\[0\] = 0: every length must be at least 1"),
        ((q, k, v, wild, lens), r"block_tables\[1, 2\] = 99 is not a page of the pool \(0..5\)"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            paged_decode(*args, config=SPLIT)
    with pytest.raises(ValueError, match="scale must be finite"):
        paged_decode(q, k, v, tables, lens, scale=float("inf"))
    with pytest.raises(ValueError, match="unknown config keys"):
        paged_decode(q, k, v, tables, lens, config={"stages": 2})


def test_append_refuses_bad_input_and_leaves_the_cache_alone():
    paged = _paged([5, 16], kv_heads=2, head_dim=16, page_size=8, dtype=torch.float32, seed=14)
    k, v, tables, lens = paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens
    before = k.clone()
    new = torch.randn(2, 2, 16)
    negative, fitting, wild = lens.clone(), lens.clone(), tables.clone()
    negative[0] = -1
    fitting[1] = 15
    wild[0, 0] = -3
    cases = [
        ((new, new[:1], k, v, tables, lens), "of one shape"),
        ((new[0], new[0], k, v, tables, lens), r"\(batch, \[new_tokens,\] kv_heads, head_dim\)"),
        ((new[:, :1], new[:, :1], k, v, tables, lens), r"new_k has \(1, 16\)"),
        ((new.half(), new.half(), k, v, tables, lens), "cache's dtype"),
        ((new[:1], new[:1], k, v, tables, lens), r"block_tables must be \(batch=1"),
        ((new, new, k, v, tables, lens), r"context_lens\[1\] \+ 1 new tokens = 17 is longer than block_tables"),
        ((new, new, k, v, tables, negative), r"context_lens\[0\] = -1: every length must be non-negative"),
        ((new, new, k, v, wild, fitting), r"block_tables\[0, 0\] = -3 is not a page of the pool"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            paged_kv_append(*args)
    torch.testing.assert_close(k, before, rtol=0, atol=0, equal_nan=True)


# --- the custom ops and the page manager -----------------------------------------------------

def test_ops_pass_opcheck_and_run_the_eager_versions_on_cpu():
    paged = _paged([3, 12], kv_heads=2, head_dim=16, page_size=8, dtype=torch.float32, seed=15)
    paged.k_cache.nan_to_num_(0.0)  # opcheck compares runs with NaN != NaN
    paged.v_cache.nan_to_num_(0.0)
    q = _query(2, 4, 16, torch.float32)
    args = (q, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens)
    torch.library.opcheck(torch.ops.kforge.paged_decode_attention.default, (*args, 0.3, True))
    torch.library.opcheck(torch.ops.kforge.paged_decode_attention.default, (*args, 0.3, False, True))
    expected = _dense_attention(q, paged.dense_k, paged.dense_v, 0.3)
    for fused_reduce in (None, False, True):  # the Triton path's choice: the eager version ignores it
        torch.testing.assert_close(paged_decode_op(*args, 0.3, fused_reduce=fused_reduce).double(), expected,
                                   rtol=1e-6, atol=1e-6)
    new = torch.randn(2, 2, 16)
    torch.library.opcheck(torch.ops.kforge.paged_kv_append.default, (new, new, *args[1:], True))
    expected_k = paged.k_cache.clone()
    paged_kv_append_reference(new, new, expected_k, paged.v_cache.clone(), paged.block_tables, paged.context_lens)
    paged_kv_append_op(new, new, *args[1:])
    assert torch.equal(paged.k_cache, expected_k)
    with pytest.raises(ValueError, match="longer than block_tables covers"):
        paged_decode_op(q, *args[1:4], paged.context_lens + 20)


def test_op_step_compiles_into_one_graph():
    paged = _paged([4, 9], kv_heads=1, head_dim=16, page_size=8, dtype=torch.float32, max_pages=3, seed=16)

    def step(q, new_k, new_v, k_cache, v_cache, tables, lens):
        paged_kv_append_op(new_k, new_v, k_cache, v_cache, tables, lens, validate=False)
        return paged_decode_op(q, k_cache, v_cache, tables, lens + 1, validate=False) * 2

    q, new = _query(2, 2, 16, torch.float32), torch.randn(2, 1, 16)
    args = (q, new, new, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens)
    out = torch.compile(step, backend="aot_eager", fullgraph=True)(*args)
    dense_k = [torch.cat([k, n[None]]) for k, n in zip(paged.dense_k, new)]
    dense_v = [torch.cat([v, n[None]]) for v, n in zip(paged.dense_v, new)]
    torch.testing.assert_close(out.double(), 2 * _dense_attention(q, dense_k, dense_v), rtol=1e-6, atol=1e-6)


def test_paged_kv_cache_hands_out_reuses_and_refuses_pages():
    cache = PagedKVCache(6, 8, kv_heads=1, head_dim=16, max_requests=3, max_pages_per_request=3,
                         dtype=torch.float32)
    g = torch.Generator().manual_seed(17)
    dense = {0: torch.zeros(0, 1, 16), 1: torch.zeros(0, 1, 16), 2: torch.zeros(0, 1, 16)}

    def append(requests, tokens):
        new = torch.randn(len(requests), tokens, 1, 16, generator=g)
        cache.append(requests, new, new)
        for r, rows in zip(requests, new):
            dense[r] = torch.cat([dense[r], rows])

    append([0, 1], 6)
    append([1], 4)  # request 1 crosses into its second page
    append([0, 1], 2)
    assert cache.lengths == [8, 12, 0] and cache.pages(0) == [0] and cache.pages(1) == [1, 2]
    assert cache.free_pages == 3 and cache.block_tables[2].tolist() == [-1, -1, -1]
    q = torch.randn(2, 2, 16, generator=g)
    expected = _dense_attention(q, [dense[0], dense[1]], [dense[0], dense[1]])
    torch.testing.assert_close(cache.attend([0, 1], q).double(), expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cache.attend([1, 0], q.flip(0)).double(), expected.flip(0), rtol=1e-6, atol=1e-6)

    cache.free(1)
    assert cache.free_pages == 5 and cache.lengths[1] == 0
    dense[1] = torch.zeros(0, 1, 16)
    append([2], 17)  # takes request 1's old pages back
    assert sorted(cache.pages(2)) == [1, 2, 3]
    with pytest.raises(ValueError, match="block-table row holds 3"):
        cache.reserve(2, 25)
    append([0], 8)
    with pytest.raises(ValueError, match=r"out of pages: request 1 needs 2 more, 1 are free"):
        cache.reserve(1, 9)
    with pytest.raises(ValueError, match="page_size 4 is not supported"):
        PagedKVCache(6, 4, kv_heads=1, head_dim=16, max_requests=1, max_pages_per_request=1)
    with pytest.raises(ValueError, match="cannot attend"):
        cache.attend([1], q[:1])
    with pytest.raises(ValueError, match="distinct"):
        cache.append([0, 0], q, q)
    expected = _dense_attention(q, [dense[2], dense[0]], [dense[2], dense[0]])
    torch.testing.assert_close(cache.attend([2, 0], q).double(), expected, rtol=1e-6, atol=1e-6)


# --- on the GPU ------------------------------------------------------------------------------

@pytest.mark.gpu
def test_decode_on_the_gpu_at_the_target_shape_matches_float64():
    paged = _paged([4096] * 64, 8, 128, 16, torch.bfloat16, device="cuda")
    q = _query(64, 32, 128, torch.bfloat16, device="cuda")
    out = paged_decode(q, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens)
    expected = paged_decode_reference(q.double(), paged.k_cache.double(), paged.v_cache.double(),
                                      paged.block_tables, paged.context_lens)
    torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=1e-2)
    torch.testing.assert_close(out.double()[:2], _dense_attention(q[:2], paged.dense_k[:2], paged.dense_v[:2]),
                               rtol=2e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_decode_on_the_gpu_on_ragged_batches_matches_float64(head_dim, dtype):
    tol = {torch.bfloat16: (2e-2, 1e-2), torch.float16: (2e-3, 2e-3), torch.float32: (1e-4, 1e-4)}[dtype]
    for batch, kv_heads, group, page_size in ((1, 8, 4, 16), (7, 2, 8, 16), (33, 4, 1, 256), (5, 1, 16, 32)):
        lengths = torch.randint(1, 5000, (batch,), generator=torch.Generator().manual_seed(batch)).tolist()
        lengths[0] = 1
        paged = _paged(lengths, kv_heads, head_dim, page_size, dtype, seed=batch, device="cuda")
        q = _query(batch, kv_heads * group, head_dim, dtype, device="cuda", spread=2.0)
        out = paged_decode(q, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens)
        expected = _dense_attention(q, paged.dense_k, paged.dense_v)
        torch.testing.assert_close(out.double(), expected, rtol=tol[0], atol=tol[1],
                                   msg=lambda m: f"batch {batch} {kv_heads}x{group} page {page_size}: {m}")


@pytest.mark.gpu
def test_append_on_the_gpu_matches_the_reference_and_the_ops_compile_with_inductor():
    lengths = [1, 16, 100, 333]
    paged = _paged(lengths, 8, 128, 16, torch.bfloat16, room=21, device="cuda")
    g = torch.Generator().manual_seed(1)
    new_k, new_v = (torch.randn(4, 21, 8, 128, generator=g).bfloat16().cuda() for _ in range(2))
    expected_k, expected_v = paged.k_cache.clone(), paged.v_cache.clone()
    paged_kv_append_reference(new_k, new_v, expected_k, expected_v, paged.block_tables, paged.context_lens)
    paged_kv_append(new_k[:, :20], new_v[:, :20], paged.k_cache, paged.v_cache, paged.block_tables,
                    paged.context_lens)
    paged_kv_append(new_k[:, 20], new_v[:, 20], paged.k_cache, paged.v_cache, paged.block_tables,
                    paged.context_lens + 20)  # then one decode step, (batch, kv_heads, head_dim)
    torch.testing.assert_close(paged.k_cache, expected_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(paged.v_cache, expected_v, rtol=0, atol=0, equal_nan=True)

    def step(q, k_cache, v_cache, tables, lens):
        return paged_decode_op(q, k_cache, v_cache, tables, lens + 21, validate=False)

    q = _query(4, 32, 128, torch.bfloat16, device="cuda")
    out = torch.compile(step, fullgraph=True)(q, paged.k_cache, paged.v_cache, paged.block_tables,
                                              paged.context_lens)
    dense_k = [torch.cat([k, n]) for k, n in zip(paged.dense_k, new_k)]
    dense_v = [torch.cat([v, n]) for v, n in zip(paged.dense_v, new_v)]
    torch.testing.assert_close(out.double(), _dense_attention(q, dense_k, dense_v), rtol=2e-2, atol=1e-2)


@pytest.mark.gpu
def test_fused_reduce_on_the_gpu_writes_the_two_kernel_bits_eagerly_and_in_a_cuda_graph(reduce_launches):
    # llama3-8b decode: 32 query heads on 8 kv heads of 128, pages of 16, bf16; every case splits
    cases = {"batch 1, context 512": [512], "batch 1, context 4096": [4096],
             "batch 8, ragged": [4096, 1, 700, 2048, 33, 4000, 129, 3001]}
    for name, lengths in cases.items():
        paged = _paged(lengths, 8, 128, 16, torch.bfloat16, seed=len(lengths), device="cuda")
        q = _query(len(lengths), 32, 128, torch.bfloat16, device="cuda", spread=2.0)
        args = (q, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens)
        two = paged_decode(*args, validate=False, fused_reduce=False)
        assert len(reduce_launches) == 1, name
        fused = [paged_decode(*args, validate=False, fused_reduce=True) for _ in range(2)]
        torch.cuda.synchronize()
        assert len(reduce_launches) == 1 and _counters_at_rest(q.device), name
        for out in fused:
            _assert_same_bits(out, two)
        torch.testing.assert_close(fused[0].double(), _dense_attention(q, paged.dense_k, paged.dense_v),
                                   rtol=2e-2, atol=1e-2, msg=lambda m: f"{name}: {m}")
        reduce_launches.clear()

    # the batch-8 step as a CUDA graph, replayed with other lengths and queries: each replay finds the counters zero
    paged = _paged([4096] * 8, 8, 128, 16, torch.bfloat16, seed=9, device="cuda")  # any length <= 4096 is real
    q = _query(8, 32, 128, torch.bfloat16, device="cuda")
    lens = paged.context_lens.clone()

    def step():
        return paged_decode(q, paged.k_cache, paged.v_cache, paged.block_tables, lens, validate=False,
                            fused_reduce=True)

    step()  # compiles, and allocates the counters before the capture (as models/llama/graphs.py does)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    assert reduce_launches == []  # one kernel captured
    g = torch.Generator().manual_seed(10)
    for replay in range(3):
        lens.copy_(torch.randint(1, 4097, (8,), generator=g, dtype=torch.int32))
        q.copy_(_query(8, 32, 128, torch.bfloat16, seed=11 + replay, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        assert _counters_at_rest(q.device), replay
        _assert_same_bits(out, paged_decode(q, paged.k_cache, paged.v_cache, paged.block_tables, lens,
                                            validate=False, fused_reduce=False))

"""DeepSeek Sparse Attention at decode: the lightning indexer's Triton kernel against float64
(ragged lengths, causal s_q, shuffled pages over a NaN pool, the per-token scales), the top-k
selection against torch.topk of the float64 scores (selected scores compared, -1 padding), and
sparse MLA under the interpreter against float64 (padded and out-of-range indices, one split
and several, head blocks with a tail) and against dense MLA when every token is selected.
Outputs start as NaN. The checks; the sm_90 build of both kernels. On a GPU: FP8 index keys,
V3.2's shapes (64 index heads of 128, top 2048, 128 heads of 576)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from kforge.kernels.mla import decode as decode_module
from kforge.kernels.mla import sparse as sparse_module
from kforge.kernels.mla.decode import mla_decode_reference
from kforge.kernels.mla.sparse import (
    index_scores,
    index_scores_reference,
    indexer_flops,
    select_topk,
    sparse_mla_decode,
    sparse_mla_decode_reference,
    sparse_mla_flops,
)

D, DV, PAGE = 576, 512, 64
H_I, D_I = 16, 32  # index heads and dims in the interpreter tests (V3.2: 64 and 128)
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1e-2}


def _pool(lengths, width, dtype, *, seed=0, spare_pages=2):
    """(cache (num_pages, PAGE, width), block_table, seqlens): each request's tokens in shuffled
    pages; slots holding no token are NaN, and table entries past a request's pages name spare
    (NaN) pages."""
    g = torch.Generator().manual_seed(seed)
    held = [math.ceil(n / PAGE) for n in lengths]
    max_pages = max(1, *held)
    num_pages = sum(held) + spare_pages
    order = torch.randperm(num_pages, generator=g)
    spare = order[sum(held):]
    cache = torch.full((num_pages, PAGE, width), float("nan"), dtype=torch.float32)
    table = spare[torch.randint(len(spare), (len(lengths), max_pages), generator=g)].int()
    first = 0
    for b, n in enumerate(lengths):
        pages = order[first:first + held[b]]
        first += held[b]
        table[b, :held[b]] = pages.int()
        flat = cache[pages].reshape(-1, width)
        flat[:n] = torch.randn(n, width, generator=g)
        cache[pages] = flat.view(held[b], PAGE, width)
    return cache.to(dtype), table, torch.tensor(lengths, dtype=torch.int32)


def _indexer_inputs(lengths, s_q, dtype, seed=0):
    keys, table, seqlens = _pool(lengths, D_I, dtype, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    scale = torch.rand(keys.shape[:2], generator=g) + 0.5
    scale[keys[..., 0].float().isnan()] = float("nan")  # slots with no token: never read
    q = torch.randn(len(lengths), s_q, H_I, D_I, generator=g).to(dtype)
    weights = torch.randn(len(lengths), s_q, H_I, generator=g)  # signed, as a gate may be
    return q, weights, keys, scale, table, seqlens


@pytest.fixture
def nan_buffers(monkeypatch):
    """Every buffer the kernels write starts as NaN."""
    def nan_empty(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(sparse_module, "_empty", nan_empty)
    monkeypatch.setattr(decode_module, "_empty", nan_empty)


@pytest.fixture
def mended():
    from kforge.runtime.interpreter import mend_interpreter

    mend_interpreter()


# --- the indexer ---------------------------------------------------------------------------------

def test_reference_scores_by_hand():
    # one request, two tokens, one query token: I_t = k_scale_t * sum_j w_j relu(q_j . k_t)
    q = torch.zeros(1, 1, H_I, D_I, dtype=torch.float64)
    q[0, 0, 0, 0], q[0, 0, 1, 0] = 1.0, -1.0  # head 0 sees +k[0], head 1 sees -k[0]
    weights = torch.zeros(1, 1, H_I, dtype=torch.float64)
    weights[0, 0, :2] = torch.tensor([2.0, 3.0])
    keys = torch.zeros(1, PAGE, D_I, dtype=torch.float64)
    keys[0, 0, 0], keys[0, 1, 0] = 4.0, -5.0
    scale = torch.full((1, PAGE), 0.5, dtype=torch.float64)
    table, seqlens = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([2], dtype=torch.int32)
    scores = index_scores_reference(q, weights, keys, scale, table, seqlens)
    # token 0: relu(4) * 2 + relu(-4) * 3 = 8; token 1: relu(-5) * 2 + relu(5) * 3 = 15; x 0.5
    assert scores[0, 0, :2].tolist() == [4.0, 7.5]
    assert (scores[0, 0, 2:] == float("-inf")).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("s_q, causal", [(1, False), (2, True)])
def test_indexer_kernel_matches_float64(dtype, s_q, causal, nan_buffers, mended):
    # 0 tokens; 1 (causal s_q 2: the first query token sees nothing); a page + 1; two pages + 3
    inputs = _indexer_inputs([0, 1, 65, 131], s_q, dtype, seed=s_q)
    scores = index_scores(*inputs, causal=causal, block_n=32)
    expected = index_scores_reference(*inputs, causal=causal)
    assert scores.shape == expected.shape and scores.dtype == torch.float32
    hidden = expected == float("-inf")
    assert torch.equal(scores == float("-inf"), hidden), "exactly the invisible tokens score -inf"
    error = (scores[~hidden].double() - expected[~hidden]).abs().max() / expected[~hidden].abs().max()
    assert error < TOLERANCE[dtype], f"error {float(error):.2e} of the largest score"


def test_topk_selects_the_highest_visible_scores_and_pads_with_minus_one():
    inputs = _indexer_inputs([3, 100], 2, torch.float64, seed=5)
    scores = index_scores_reference(*inputs, causal=True)
    picked = select_topk(scores, 8)
    assert picked.shape == (2, 2, 8) and picked.dtype == torch.int32
    for b, n in enumerate([3, 100]):
        for i in range(2):
            seen = n - 2 + i + 1
            row = scores[b, i]
            chosen = picked[b, i][picked[b, i] >= 0].long()
            assert len(chosen) == min(8, seen) and (chosen < seen).all()
            assert (picked[b, i][len(chosen):] == -1).all(), "padding after the selected"
            # the selected scores are the top ones (ties broken as torch.topk does)
            assert torch.equal(row[chosen].sort(descending=True).values, row[:seen].topk(len(chosen)).values)
    wide = select_topk(scores, 500)  # more than the 128 token slots: padded to 500
    assert wide.shape == (2, 2, 500) and int((wide[1, 1] >= 0).sum()) == 100
    with pytest.raises(ValueError, match="topk must be >= 1"):
        select_topk(scores, 0)


@pytest.mark.parametrize("change, message", [
    (lambda q, w, k, s, t, n: (q[0], w, k, s, t, n), "q_idx must be 4-D"),
    (lambda q, w, k, s, t, n: (q, w, k[..., :16], s, t, n), "k_cache must be"),
    (lambda q, w, k, s, t, n: (q, w, k, s.double(), t, n), "k_scale must be fp32"),
    (lambda q, w, k, s, t, n: (q, w[..., :8], k, s, t, n), "weights must be fp32"),
    (lambda q, w, k, s, t, n: (q[:, :, :12], w[..., :12], k, s, t, n), "index_heads must be a power of two"),
    (lambda q, w, k, s, t, n: (q.bfloat16(), w, k, s, t, n), "share one dtype"),
    (lambda q, w, k, s, t, n: (q, w, k, s, t.long(), n), "must be int32"),
    (lambda q, w, k, s, t, n: (q, w, k, s, t, n + 200), r"outside \[0, 192\]"),
])
def test_indexer_bad_inputs_are_refused(change, message):
    inputs = _indexer_inputs([3, 130], 1, torch.float32)
    with pytest.raises(ValueError, match=message):
        index_scores(*change(*inputs))


# --- sparse MLA --------------------------------------------------------------------------------------

def _latent(lengths, dtype, seed=0):
    cache, table, seqlens = _pool(lengths, D, dtype, seed=seed)
    return cache.unsqueeze(2), table, seqlens


def _query(batch, s_q, h_q, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (2.0 * torch.randn(batch, s_q, h_q, D, generator=g)).to(dtype)


def _indices(lengths, s_q, topk, seed=2):
    """Random distinct visible tokens per query token, then -1 padding, one index past the
    length and a duplicate -1 mixed in: all must be skipped."""
    g = torch.Generator().manual_seed(seed)
    out = torch.full((len(lengths), s_q, topk), -1, dtype=torch.int32)
    for b, n in enumerate(lengths):
        for i in range(s_q):
            chosen = torch.randperm(n, generator=g)[:topk - 2].int() if n else torch.empty(0, dtype=torch.int32)
            out[b, i, :len(chosen)] = chosen
            if n and len(chosen) < topk:
                out[b, i, len(chosen)] = n + 7  # outside the request's tokens: read nothing
    return out


def _assert_close(out, lse, expected_out, expected_lse, dtype):
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert not out.isnan().any() and not lse.isnan().any()
    out, lse, expected_out = out.double(), lse.double(), expected_out.double()
    error = (out - expected_out).abs().max() / expected_out.abs().max()
    assert error < TOLERANCE[dtype], f"out: error {float(error):.2e} of the largest value"
    empty = expected_lse == float("-inf")
    assert torch.equal(lse == float("-inf"), empty), "query tokens with no valid index must have lse = -inf"
    assert (out.permute(0, 2, 1, 3)[empty] == 0).all()
    torch.testing.assert_close(lse[~empty], expected_lse[~empty].double(), rtol=TOLERANCE[dtype],
                               atol=TOLERANCE[dtype])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", [{"BLOCK_N": 16, "split_size": 16}, {"BLOCK_N": 32, "split_size": 64}],
                         ids=["split", "whole"])
def test_sparse_kernel_matches_float64(dtype, config, nan_buffers, mended):
    lengths = [0, 5, 70, 140]  # an empty request; fewer tokens than the list; more
    cache, table, seqlens = _latent(lengths, dtype)
    q = _query(4, 2, 3, dtype)
    indices = _indices(lengths, 2, 40)
    out, lse = sparse_mla_decode(q, cache, table, seqlens, indices, softmax_scale=0.06, config=config)
    expected = sparse_mla_decode_reference(q, cache, table, seqlens, indices, softmax_scale=0.06)
    _assert_close(out, lse, *expected, dtype)


@pytest.mark.slow
def test_sparse_over_every_token_is_dense_mla(nan_buffers, mended):
    # selecting each visible token once (in any order) is dense attention: the same out and lse
    lengths = [9, 70]
    cache, table, seqlens = _latent(lengths, torch.float32, seed=3)
    q = _query(2, 1, 20, torch.float32, seed=4)  # 20 heads: one block of 16 and a tail of 4
    indices = torch.full((2, 1, 80), -1, dtype=torch.int32)
    for b, n in enumerate(lengths):
        indices[b, 0, :n] = torch.randperm(n, generator=torch.Generator().manual_seed(b)).int()
    out, lse = sparse_mla_decode(q, cache, table, seqlens, indices, config={"BLOCK_M": 16, "BLOCK_N": 16,
                                                                           "split_size": 32})
    dense = mla_decode_reference(q.double(), cache.double(), table, seqlens)
    _assert_close(out, lse, dense[0], dense[1], torch.float32)


def test_sparse_reference_skips_padding_and_out_of_range_indices():
    lengths = [70]
    cache, table, seqlens = _latent(lengths, torch.float64)
    q = _query(1, 1, 2, torch.float64)
    clean = torch.tensor([[[3, 69, 0]]], dtype=torch.int32)
    noisy = torch.tensor([[[3, -1, 69, 70, 500, 0]]], dtype=torch.int32)
    a = sparse_mla_decode_reference(q, cache, table, seqlens, clean)
    b = sparse_mla_decode_reference(q, cache, table, seqlens, noisy)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not a[0].isnan().any(), "the NaN slots past the length were never read"


def test_flop_counts():
    indices = torch.tensor([[[0, 1, -1, 9]], [[2, -1, -1, -1]]], dtype=torch.int32)
    seqlens = torch.tensor([5, 3], dtype=torch.int32)
    # valid: (0, 1) of request 0 (9 is past 5), (2) of request 1: 3 tokens x 4 heads
    assert sparse_mla_flops(indices, seqlens, h_q=4) == 2 * (576 + 512) * 4 * 3
    assert indexer_flops([4, 2], s_q=2, causal=True) == 2 * 128 * 64 * ((3 + 4) + (1 + 2))
    assert indexer_flops([4], s_q=1) == 2 * 128 * 64 * 4


@pytest.mark.parametrize("change, message", [
    (lambda i: i[:, :, :0], r"topk >= 1"),
    (lambda i: i.long(), "int32"),
    (lambda i: i[:1], r"batch=2"),
])
def test_sparse_bad_indices_are_refused(change, message):
    cache, table, seqlens = _latent([3, 70], torch.float32)
    q = _query(2, 1, 2, torch.float32)
    with pytest.raises(ValueError, match=message):
        sparse_mla_decode(q, cache, table, seqlens, change(_indices([3, 70], 1, 8)))


# --- the sm_90 build, compiled offline ------------------------------------------------------------

@pytest.mark.slow
def test_both_kernels_compile_for_the_h100_without_spills():
    sys.path.insert(0, str(Path(__file__).parent))
    from triton_sm90 import compile_sm90, spec

    i32 = lambda *names: {name: "i32" for name in names}
    index_types = {"q_ptr": "*fp8e4nv", "w_ptr": "*fp32", "k_ptr": "*fp8e4nv", "k_scale_ptr": "*fp32",
                   "block_table_ptr": "*i32", "seqlens_ptr": "*i32", "scores_ptr": "*fp32",
                   **i32("stride_qb", "stride_qs", "stride_qh", "stride_wb", "stride_ws", "stride_kp", "stride_kt",
                         "stride_sp", "stride_table", "stride_out_b", "stride_out_s", "s_q", "max_pages",
                         "max_tokens")}
    sparse_types = {"q_ptr": "*bf16", "cache_ptr": "*bf16", "block_table_ptr": "*i32", "seqlens_ptr": "*i32",
                    "index_ptr": "*i32", "out_ptr": "*bf16", "lse_ptr": "*fp32", "part_out_ptr": "*fp32",
                    "part_lse_ptr": "*fp32", "qk_scale": "fp32",
                    **i32("stride_qb", "stride_qs", "stride_qh", "stride_cp", "stride_ct", "stride_table",
                          "stride_ib", "stride_is", "h_q", "s_q", "max_pages", "topk", "num_splits", "split_size")}
    found = compile_sm90([
        spec("indexer fp8", "kforge.kernels.mla.sparse", "indexer_kernel", index_types,
             dict(H_I=64, D_I=128, BLOCK_N=64, PAGE_SIZE=PAGE, CAUSAL=True, DOT_PRECISION="tf32"),
             aligned=("q_ptr", "w_ptr", "k_ptr", "k_scale_ptr", "block_table_ptr", "seqlens_ptr", "scores_ptr",
                      "stride_qb", "stride_qs", "stride_qh", "stride_kp", "stride_kt"), num_warps=4, num_stages=1),
        spec("sparse bf16", "kforge.kernels.mla.sparse", "sparse_decode_kernel", sparse_types,
             dict(BLOCK_M=64, BLOCK_N=32, D_V=DV, D_ROPE=D - DV, PAGE_SIZE=PAGE, SPLIT=True, DOT_PRECISION="tf32"),
             # as Triton specializes at launch: pointers and strides divisible by 16 (576-wide rows)
             aligned=("q_ptr", "cache_ptr", "block_table_ptr", "seqlens_ptr", "index_ptr", "out_ptr", "lse_ptr",
                      "part_out_ptr", "part_lse_ptr", "stride_qb", "stride_qs", "stride_qh", "stride_cp", "stride_ct"),
             num_warps=8, num_stages=2),
    ])
    for label, used in found.items():
        assert used["spills"] == 0 and used["local"] == 0, (label, used)
        assert used["shared"] <= 227 * 1024, (label, used)
    assert found["indexer fp8"]["qgmma"] > 0, "the FP8 q.k runs on wgmma (QGMMA)"
    assert found["sparse bf16"]["hgmma"] > 0


# --- on the GPU -----------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_v32_shapes_fp8_indexer_then_sparse_attention():
    torch.manual_seed(0)
    lengths = [4096, 777, 8192, 1]
    keys, table, seqlens = _pool(lengths, 128, torch.float32)
    keys, table, seqlens = keys.cuda(), table.cuda(), seqlens.cuda()
    scale = (torch.rand(keys.shape[:2], device="cuda") + 0.5)
    q_idx = torch.randn(4, 1, 64, 128, device="cuda")
    weights = torch.randn(4, 1, 64, device="cuda") / 8
    fp8 = torch.float8_e4m3fn
    scores = index_scores(q_idx.to(fp8), weights, keys.nan_to_num().to(fp8), scale, table, seqlens)
    expected = index_scores_reference(q_idx.to(fp8).float(), weights, keys.nan_to_num().to(fp8).float(), scale,
                                      table, seqlens)
    hidden = expected == float("-inf")
    assert torch.equal(scores == float("-inf"), hidden)
    error = (scores[~hidden].double() - expected[~hidden]).abs().max() / expected[~hidden].abs().max()
    assert error < sparse_module.FP8_INDEX_ERROR, float(error)
    indices = select_topk(scores, 2048)
    cache, _, _ = _pool(lengths, D, torch.bfloat16, seed=0)
    q = (2 * torch.randn(4, 1, 128, D, device="cuda")).bfloat16()
    out, lse = sparse_mla_decode(q, cache.unsqueeze(2).cuda(), table, seqlens, indices)
    reference = sparse_mla_decode_reference(q, cache.unsqueeze(2).cuda(), table, seqlens, indices)
    _assert_close(out.cpu(), lse.cpu(), reference[0].cpu(), reference[1].cpu(), torch.bfloat16)

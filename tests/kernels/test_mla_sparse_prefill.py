"""DeepSeek Sparse Attention at prefill: the prefill indexer's Triton kernel under the interpreter
against float64 (fp32, bf16, fp16 and FP8 index inputs; prompts and caches that are not whole
tiles; one key split and several; the causal limits, the default and given offsets), the top-k
over its scores against torch.topk of the float64 scores, sparse MLA prefill against float64
(fp32, bf16, fp16; -1 padding and out-of-range indices, a token with no valid index, head blocks
with a tail, one split of the lists and several, over a kv whose unselected rows and padding
columns are NaN) and bit for bit against sparse MLA decode over the same data paged. Outputs
start as NaN. The checks and the planner; the sm_90 build of both kernels at DeepSeek-V3.2's
shapes. On a GPU: V3.2's shapes, FP8 index, against float64 on sampled rows."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from kforge.kernels.mla import decode as decode_module
from kforge.kernels.mla import sparse as sparse_module
from kforge.kernels.mla import sparse_prefill as prefill_module
from kforge.kernels.mla.sparse import select_topk, sparse_mla_decode
from kforge.kernels.mla.sparse_prefill import (
    index_scores_prefill,
    index_scores_prefill_reference,
    plan_prefill_indexer,
    sparse_mla_prefill,
    sparse_mla_prefill_reference,
)

D, DV = 576, 512
H_I, D_I = 16, 32  # index heads and dims in the interpreter tests (V3.2: 64 and 128)
# error / max |reference|. The indexer's inputs are compared as rounded, so only the order of its
# fp32 sums differs. Attention rounds P to the input dtype before P V, and the output.
INDEX_TOLERANCE = 2e-5
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
SPLIT = {"BLOCK_N": 16, "split_size": 16}  # several splits of each list: the combine runs
WHOLE = {"BLOCK_N": 32, "split_size": 64}


@pytest.fixture
def nan_buffers(monkeypatch):
    """Every buffer the kernels write (scores, out, lse, the split partials) starts as NaN."""
    def nan_empty(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    for module in (prefill_module, sparse_module, decode_module):
        monkeypatch.setattr(module, "_empty", nan_empty)


@pytest.fixture
def mended():
    from kforge.runtime.interpreter import mend_interpreter

    mend_interpreter()


def _index_inputs(s_q, s_kv, dtype, seed=0, device="cpu", heads=H_I, dim=D_I):
    g = torch.Generator().manual_seed(seed)
    q_idx = torch.randn(s_q, heads, dim, generator=g).to(device=device, dtype=dtype)
    weights = torch.randn(s_q, heads, generator=g).to(device)  # signed, as a gate may be
    k = torch.randn(s_kv, dim, generator=g).to(device=device, dtype=dtype)
    k_scale = (torch.rand(s_kv, generator=g) + 0.5).to(device)
    return q_idx, weights, k, k_scale


def _relative_error(scores, expected):
    shown = expected != float("-inf")
    return float((scores[shown].double() - expected[shown]).abs().max() / expected[shown].abs().max())


# --- the indexer ---------------------------------------------------------------------------------

def test_reference_scores_by_hand():
    # I[i, t] = k_scale[t] * sum_j w[i, j] relu(q[i, j] . k[t]); 2 query tokens after 1 cached
    q = torch.zeros(2, H_I, D_I, dtype=torch.float64)
    q[:, 0, 0], q[:, 1, 0] = 1.0, -1.0  # head 0 sees +k[., 0], head 1 sees -k[., 0]
    weights = torch.zeros(2, H_I, dtype=torch.float64)
    weights[:, :2] = torch.tensor([2.0, 3.0])
    k = torch.zeros(3, D_I, dtype=torch.float64)
    k[:, 0] = torch.tensor([4.0, -5.0, 1.0])
    k_scale = torch.tensor([0.5, 0.5, 2.0], dtype=torch.float64)
    scores = index_scores_prefill_reference(q, weights, k, k_scale)
    # relu(4) 2 = 8; relu(5) 3 = 15; relu(1) 2 = 2; times the scales. Query 0 is token 1: sees 0 and 1
    inf = float("-inf")
    assert scores.tolist() == [[4.0, 7.5, inf], [4.0, 7.5, 4.0]]
    assert index_scores_prefill_reference(q, weights, k, k_scale, q_offset=0).tolist() == [[4.0, inf, inf],
                                                                                          [4.0, 7.5, inf]]
    assert index_scores_prefill_reference(q, weights, k, k_scale, causal=False).tolist() == [[4.0, 7.5, 4.0]] * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn])
@pytest.mark.parametrize("config", [{"BLOCK_Q": 4, "BLOCK_N": 32, "split_size": 32},
                                    {"BLOCK_Q": 2, "BLOCK_N": 16, "split_size": 96}], ids=["splits", "whole"])
def test_indexer_kernel_matches_float64(dtype, config, nan_buffers, mended):
    # 11 query tokens after 64 cached (75 keys): neither a whole number of query nor key tiles
    inputs = _index_inputs(11, 75, dtype, seed=3)
    scores = index_scores_prefill(*inputs, config=config)
    expected = index_scores_prefill_reference(*inputs)
    assert scores.shape == (11, 75) and scores.dtype == torch.float32
    assert torch.equal(scores == float("-inf"), expected == float("-inf")), "exactly the hidden keys score -inf"
    assert _relative_error(scores, expected) < INDEX_TOLERANCE


@pytest.mark.parametrize("s_q, s_kv, causal, q_offset, config", [
    (9, 9, True, None, {"BLOCK_Q": 4, "BLOCK_N": 16, "split_size": 16}),  # a prompt alone: a triangle
    (9, 200, True, 0, {"BLOCK_Q": 4, "BLOCK_N": 16, "split_size": 32}),  # whole splits past every limit
    (9, 200, True, 100, {"BLOCK_Q": 8, "BLOCK_N": 32, "split_size": 64}),  # a chunk in the middle of k
    (9, 200, True, None, None),  # the default plan: splits for ~2 programs an SM
    (5, 70, False, None, {"BLOCK_Q": 2, "BLOCK_N": 16, "split_size": 48}),
])
def test_indexer_causal_limits(s_q, s_kv, causal, q_offset, config, nan_buffers):
    inputs = _index_inputs(s_q, s_kv, torch.float32, seed=s_kv)
    offset = (s_kv - s_q if q_offset is None else q_offset) if causal else None
    if causal:  # the keys past the last limit are NaN: never read, or at least never shown
        inputs[2][offset + s_q:] = float("nan")
        inputs[3][offset + s_q:] = float("nan")
    scores = index_scores_prefill(*inputs, causal=causal, q_offset=q_offset, config=config)
    for i in range(s_q):
        limit = offset + i + 1 if causal else s_kv
        assert torch.isfinite(scores[i, :limit]).all(), f"query {i} sees its {limit} keys"
        assert (scores[i, limit:] == float("-inf")).all(), f"query {i} sees nothing from {limit} on"
    expected = index_scores_prefill_reference(*inputs, causal=causal, q_offset=q_offset)
    assert _relative_error(scores, expected) < INDEX_TOLERANCE


def test_topk_of_prefill_scores_against_torch_topk_of_float64():
    s_q, s_kv, topk = 6, 40, 7
    q_idx, weights, k, k_scale = _index_inputs(s_q, s_kv, torch.float32, seed=9)
    # ties: keys 2j and 2j + 1 are equal, so every score comes twice, and an odd k can cut through
    # a tied pair once more than k keys are visible (it does at 8: the fourth pair)
    k, k_scale = k[::2].repeat_interleave(2, 0), k_scale[::2].repeat_interleave(2)
    scores = index_scores_prefill(q_idx, weights, k, k_scale, q_offset=3)  # query i sees 4 + i keys
    expected = index_scores_prefill_reference(q_idx, weights, k, k_scale, q_offset=3)
    picked = select_topk(scores, topk)
    assert picked.shape == (s_q, topk) and picked.dtype == torch.int32
    for i in range(s_q):
        seen = 4 + i
        chosen = picked[i][picked[i] >= 0].long()
        assert len(chosen) == min(topk, seen) and (chosen < seen).all() and len(set(chosen.tolist())) == len(chosen)
        assert (picked[i, len(chosen):] == -1).all(), "-1 pads after the selected"
        # the selected scores are float64's top ones; of two tied keys, either may be the one taken
        best = expected[i, :seen].topk(len(chosen)).values
        torch.testing.assert_close(expected[i, chosen].sort(descending=True).values, best, rtol=1e-6, atol=0)


@pytest.mark.parametrize("causal, q_offset", [(True, None), (True, 2), (False, None)],
                         ids=["prompt-after-cache", "short-prefix", "not-causal"])
def test_topk_in_chunks_equals_the_topk_of_the_whole_matrix(causal, q_offset, mended):
    """select_topk_prefill with a budget of 3 rows of scores: the same lists as select_topk over the
    whole score matrix, -1 padding included (after a 2-token prefix the first tokens see fewer than k)."""
    s_q, s_kv, topk = 10, 37, 6
    q_idx, weights, k, k_scale = _index_inputs(s_q, s_kv, torch.float32, seed=21)
    whole = select_topk(index_scores_prefill(q_idx, weights, k, k_scale, causal=causal, q_offset=q_offset), topk)
    chunked = prefill_module.select_topk_prefill(q_idx, weights, k, k_scale, topk, causal=causal, q_offset=q_offset,
                                                 budget_bytes=3 * 4 * s_kv)
    assert chunked.dtype == torch.int32 and torch.equal(chunked, whole)
    if q_offset == 2:  # the first tokens see 3, 4, 5 keys: the lists are padded
        assert (whole[:3] == -1).any() and not (whole[3:] == -1).any()


def test_topk_in_chunks_scores_only_what_each_chunk_sees(monkeypatch):
    """Each chunk asks the indexer for at most the budget's rows, and under the causal rule only for the
    keys its last token sees, at that token's offset: the whole s_q x s_kv matrix is never made."""
    s_q, s_kv, offset = 10, 40, 25
    q_idx, weights, k, k_scale = _index_inputs(s_q, s_kv, torch.float32, seed=3)
    calls = []

    def recording(q, w, keys, scales, *, causal, q_offset, config):
        calls.append((q.shape[0], keys.shape[0], q_offset))
        return index_scores_prefill_reference(q, w, keys, scales, causal=causal, q_offset=q_offset).float()

    monkeypatch.setattr(prefill_module, "index_scores_prefill", recording)
    picked = prefill_module.select_topk_prefill(q_idx, weights, k, k_scale, 4, q_offset=offset,
                                                budget_bytes=4 * 4 * s_kv)
    assert calls == [(4, offset + 4, offset), (4, offset + 8, offset + 4), (2, offset + 10, offset + 8)]
    expected = select_topk(index_scores_prefill_reference(q_idx, weights, k, k_scale, q_offset=offset).float(), 4)
    assert torch.equal(picked, expected)


def test_indexer_plan():
    plan = plan_prefill_indexer(32768, 32768)
    assert (plan.block_q, plan.block_n, plan.num_splits) == (4, 64, 1)  # 8192 query tiles: no key splits
    short = plan_prefill_indexer(64, 131072)  # 16 query tiles over a long cache: ~264 programs
    assert short.num_splits == math.ceil(131072 / short.split_size) and 16 * short.num_splits >= 264
    assert short.split_size % 64 == 0
    assert plan_prefill_indexer(4, 10).num_splits == 1  # one key tile
    for config, message in (({"BLOCK_Q": 3}, "BLOCK_Q must be a power of two"),
                            ({"BLOCK_N": 8}, "BLOCK_N must be a power of two >= 16"),
                            ({"split_size": 40}, "multiple of BLOCK_N"), ({"warps": 4}, "unknown config keys")):
        with pytest.raises(ValueError, match=message):
            plan_prefill_indexer(16, 100, config=config)


@pytest.mark.parametrize("change, message", [
    (lambda q, w, k, s: (q[0], w, k, s, {}), "q_idx must be 3-D"),
    (lambda q, w, k, s: (q, w, k[:, :16], s, {}), r"k must be \(s_kv, index_dim=32\)"),
    (lambda q, w, k, s: (q, w, k, s.double(), {}), "k_scale must be fp32"),
    (lambda q, w, k, s: (q, w, k, s[:5], {}), "k_scale must be fp32"),
    (lambda q, w, k, s: (q, w[:, :8], k, s, {}), "weights must be fp32"),
    (lambda q, w, k, s: (q[:, :12], w[:, :12], k, s, {}), "index_heads must be a power of two"),
    (lambda q, w, k, s: (q.bfloat16(), w, k, s, {}), "share one dtype"),
    (lambda q, w, k, s: (q.int(), w, k.int(), s, {}), "share one dtype"),
    (lambda q, w, k, s: (q, w, k.t().contiguous().t(), s, {}), "contiguous last dim"),
    (lambda q, w, k, s: (q, w, k, s.to("meta"), {}), "different devices"),
    (lambda q, w, k, s: (q, w, k[:3], s[:3], {}), r"q_offset must be in \[0, s_kv - s_q = -2\]"),
    (lambda q, w, k, s: (q, w, k, s, {"q_offset": 6}), r"q_offset must be in \[0, s_kv - s_q = 5\]"),
    (lambda q, w, k, s: (q, w, k, s, {"q_offset": -1}), r"q_offset must be in \[0, s_kv - s_q = 5\]"),
    (lambda q, w, k, s: (q, w, k, s, {"q_offset": 0, "causal": False}), "pass it with causal=True"),
])
def test_indexer_bad_inputs_are_refused(change, message):
    *inputs, options = change(*_index_inputs(5, 10, torch.float32))
    with pytest.raises(ValueError, match=message):
        index_scores_prefill(*inputs, **options)


# --- sparse MLA ------------------------------------------------------------------------------------

def _prompt(s_q, s_kv, h_q, dtype, seed=0, unread=()):
    """(q (s_q, h_q, D), kv (s_kv, 1, D)): kv a view of wider rows whose extra columns are NaN, and
    the rows `unread` NaN: no index selects them."""
    g = torch.Generator().manual_seed(seed)
    q = (2.0 * torch.randn(s_q, h_q, D, generator=g)).to(dtype)
    rows = torch.full((s_kv, 1, D + 64), float("nan"))
    rows[:, :, :D] = torch.randn(s_kv, 1, D, generator=g)
    rows[list(unread)] = float("nan")
    return q, rows.to(dtype)[:, :, :D]


def _prompt_indices(s_q, s_kv, topk, unread=(), seed=1):
    """Distinct random read rows per query token, then one -5, one index of s_kv + 7 and -1
    padding; the last token lists only indices to skip (no valid one)."""
    g = torch.Generator().manual_seed(seed)
    readable = torch.tensor([t for t in range(s_kv) if t not in set(unread)], dtype=torch.int32)
    out = torch.full((s_q, 1, topk), -1, dtype=torch.int32)
    for i in range(s_q - 1):
        chosen = readable[torch.randperm(len(readable), generator=g)[:topk - 3]]
        out[i, 0, :len(chosen)] = chosen
        out[i, 0, len(chosen):len(chosen) + 2] = torch.tensor([-5, s_kv + 7])
    out[s_q - 1, 0, :3] = torch.tensor([s_kv, -2, 2**30])
    return out


def _assert_close(out, lse, expected_out, expected_lse, dtype):
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert out.shape == expected_out.shape and lse.shape == expected_lse.shape
    assert not out.isnan().any() and not lse.isnan().any()
    out, lse, expected_out = out.double(), lse.double(), expected_out.double()
    error = (out - expected_out).abs().max() / expected_out.abs().max()
    assert error < TOLERANCE[dtype], f"out: error {float(error):.2e} of the largest value"
    empty = expected_lse == float("-inf")
    assert torch.equal(lse == float("-inf"), empty), "tokens with no valid index must have lse = -inf"
    assert (out[empty] == 0).all(), "tokens with no valid index must be 0"
    torch.testing.assert_close(lse[~empty], expected_lse[~empty].double(), rtol=TOLERANCE[dtype],
                               atol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("config", [SPLIT, WHOLE], ids=["split", "whole"])
def test_sparse_prefill_matches_float64(dtype, config, nan_buffers, mended):
    s_q, s_kv, h_q, unread = 5, 75, 3, (0, 17, 74)
    q, kv = _prompt(s_q, s_kv, h_q, dtype, unread=unread)
    indices = _prompt_indices(s_q, s_kv, 40, unread=unread)
    out, lse = sparse_mla_prefill(q, kv, indices, softmax_scale=0.06, config=config)
    expected = sparse_mla_prefill_reference(q, kv, indices, softmax_scale=0.06)
    assert (expected[1][s_q - 1] == float("-inf")).all()  # the token with no valid index
    _assert_close(out, lse, *expected, dtype)


def test_sparse_prefill_head_blocks_with_a_tail(nan_buffers):
    # 20 heads: one block of 16 and a tail of 4; the default scale 1/sqrt(576)
    q, kv = _prompt(3, 50, 20, torch.float32, seed=4)
    indices = _prompt_indices(3, 50, 24, seed=5)
    out, lse = sparse_mla_prefill(q, kv, indices, config={"BLOCK_M": 16, "BLOCK_N": 16, "split_size": 16})
    _assert_close(out, lse, *sparse_mla_prefill_reference(q, kv, indices), torch.float32)


@pytest.mark.parametrize("config", [SPLIT, WHOLE], ids=["split", "whole"])
def test_sparse_prefill_equals_decode_over_the_same_tokens_paged(config, nan_buffers, mended):
    # the same rows in shuffled pages of 16 of a NaN pool, as one request: the same kernel reads
    # them through the block table, so out and lse agree bit for bit
    s_q, s_kv, h_q, page = 4, 70, 3, 16
    q, kv = _prompt(s_q, s_kv, h_q, torch.bfloat16, seed=6)
    indices = _prompt_indices(s_q, s_kv, 32, seed=7)
    held = math.ceil(s_kv / page)
    order = torch.randperm(held + 2, generator=torch.Generator().manual_seed(8))
    pool = torch.full((held + 2, page, 1, D), float("nan"), dtype=torch.bfloat16)
    flat = torch.full((held * page, 1, D), float("nan"), dtype=torch.bfloat16)
    flat[:s_kv] = kv
    pool[order[:held]] = flat.view(held, page, 1, D)
    table = order[None, :held].int()
    out, lse = sparse_mla_prefill(q, kv, indices, softmax_scale=0.07, config=config)
    paged_out, paged_lse = sparse_mla_decode(q[None], pool, table, torch.tensor([s_kv], dtype=torch.int32),
                                             indices.permute(1, 0, 2), softmax_scale=0.07, config=config)
    assert torch.equal(out, paged_out[0]) and torch.equal(lse, paged_lse[0].t())


def test_empty_prompt():
    q, kv = _prompt(0, 10, 2, torch.float32)
    out, lse = sparse_mla_prefill(q, kv, torch.zeros(0, 1, 4, dtype=torch.int32))
    assert out.shape == (0, 2, DV) and lse.shape == (0, 2)
    assert index_scores_prefill(*_index_inputs(0, 10, torch.float32)).shape == (0, 10)


@pytest.mark.parametrize("change, message", [
    (lambda q, kv, i: (q[None], kv, i, {}), r"q must be 3-D \(s_q, h_q, head_dim\)"),
    (lambda q, kv, i: (q, kv[:, 0], i, {}), r"kv must be \(s_kv, 1, head_dim=576\)"),
    (lambda q, kv, i: (q, kv.expand(-1, 2, -1), i, {}), "one latent head"),
    (lambda q, kv, i: (q, kv[..., :512], i, {}), r"head_dim=576"),
    (lambda q, kv, i: (q, kv[:0], i, {}), "nothing to attend with"),
    (lambda q, kv, i: (q[..., :560], kv[..., :560], i, {}), "head_dim - head_dim_v must be a power of two"),
    (lambda q, kv, i: (q, kv, i, {"head_dim_v": 500}), "head_dim_v must be a power of two"),
    (lambda q, kv, i: (q.half(), kv, i, {}), "share one dtype"),
    (lambda q, kv, i: (q.double(), kv.double(), i, {}), "share one dtype"),
    (lambda q, kv, i: (q, kv, i[:2], {}), r"indices must be \(s_q=3, 1, topk >= 1\)"),
    (lambda q, kv, i: (q, kv, i.expand(-1, 2, -1), {}), "one kv head"),
    (lambda q, kv, i: (q, kv, i[..., :0], {}), "topk >= 1"),
    (lambda q, kv, i: (q, kv, i.long(), {}), "indices must be int32"),
    (lambda q, kv, i: (q.transpose(1, 2).contiguous().transpose(1, 2), kv, i, {}), "contiguous last dim"),
    (lambda q, kv, i: (q, kv, i.to("meta"), {}), "different devices"),
    (lambda q, kv, i: (q, kv, i, {"softmax_scale": float("inf")}), "softmax_scale must be finite"),
])
def test_sparse_prefill_bad_inputs_are_refused(change, message):
    q, kv = _prompt(3, 20, 2, torch.float32)
    q, kv, indices, options = change(q, kv, _prompt_indices(3, 20, 8))
    with pytest.raises(ValueError, match=message):
        sparse_mla_prefill(q, kv, indices, **options)


# --- the sm_90 build, compiled offline ---------------------------------------------------------------

@pytest.mark.slow
def test_both_kernels_compile_for_the_h100_at_v32_shapes_without_spills():
    sys.path.insert(0, str(Path(__file__).parent))
    from triton_sm90 import compile_sm90, spec

    i32 = lambda *names: {name: "i32" for name in names}
    index_types = {"q_ptr": "*fp8e4nv", "w_ptr": "*fp32", "k_ptr": "*fp8e4nv", "k_scale_ptr": "*fp32",
                   "scores_ptr": "*fp32", **i32("stride_qs", "stride_qh", "stride_ws", "stride_kt", "stride_out",
                                                "s_q", "s_kv", "q_offset", "split_size")}
    plan = plan_prefill_indexer(32768, 32768)
    # as a launch specializes: V3.2's rows (64 x 128 FP8, 64 fp32 weights) are multiples of 16
    index_aligned = ("q_ptr", "w_ptr", "k_ptr", "k_scale_ptr", "scores_ptr", "stride_qs", "stride_qh", "stride_ws",
                     "stride_kt", "stride_out")
    sparse_types = {"q_ptr": "*bf16", "cache_ptr": "*bf16", "block_table_ptr": "*i32", "seqlens_ptr": "*i32",
                    "index_ptr": "*i32", "out_ptr": "*bf16", "lse_ptr": "*fp32", "part_out_ptr": "*fp32",
                    "part_lse_ptr": "*fp32", "qk_scale": "fp32",
                    **i32("stride_qb", "stride_qs", "stride_qh", "stride_cp", "stride_ct", "stride_table",
                          "stride_ib", "stride_is", "h_q", "max_pages", "topk", "num_splits", "split_size")}
    attention = decode_module.plan_mla_decode(32768, 128, 2048)  # the prefill's plan: a request a query token
    sparse_aligned = ("q_ptr", "cache_ptr", "block_table_ptr", "seqlens_ptr", "index_ptr", "out_ptr", "lse_ptr",
                      "part_out_ptr", "part_lse_ptr", "stride_qb", "stride_qs", "stride_qh", "stride_cp", "stride_ct",
                      "stride_ib", "stride_is")
    found = compile_sm90([
        spec("indexer fp8", "kforge.kernels.mla.sparse_prefill", "prefill_indexer_kernel", index_types,
             {"H_I": 64, "D_I": 128, "BLOCK_Q": plan.block_q, "BLOCK_N": plan.block_n, "CAUSAL": True,
              "DOT_PRECISION": "tf32"},
             aligned=index_aligned, num_warps=plan.num_warps, num_stages=plan.num_stages),
        *(spec(f"sparse bf16 {'split' if split else 'whole'}", "kforge.kernels.mla.sparse", "sparse_decode_kernel",
               sparse_types, {"s_q": 1, "BLOCK_M": attention.block_m, "BLOCK_N": attention.block_n, "D_V": DV,
                              "D_ROPE": D - DV, "PAGE_SIZE": 1, "SPLIT": split, "DOT_PRECISION": "tf32",
                              "PAGED": False},
               aligned=sparse_aligned, num_warps=attention.num_warps, num_stages=attention.num_stages)
          for split in (False, True)),
    ])
    assert not attention.split and attention.block_m == 64
    for label, used in found.items():
        assert used["spills"] == 0 and used["local"] == 0, (label, used)
        assert used["shared"] <= 227 * 1024, (label, used)
    assert found["indexer fp8"]["qgmma"] > 0, "the FP8 q.k runs on wgmma (QGMMA)"
    assert found["sparse bf16 whole"]["hgmma"] > 0 and found["sparse bf16 split"]["hgmma"] > 0


# --- on the GPU ---------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("s_q, s_kv", [(4096, 4096), (1000, 5000)], ids=["prompt", "after-a-cache"])
def test_gpu_v32_shapes_fp8_indexer_then_sparse_prefill(s_q, s_kv):
    fp8 = torch.float8_e4m3fn
    q_idx, weights, k, k_scale = _index_inputs(s_q, s_kv, torch.float32, seed=s_q, device="cuda", heads=64, dim=128)
    q_idx, k, weights = q_idx.to(fp8), k.to(fp8), weights / 8
    scores = index_scores_prefill(q_idx, weights, k, k_scale)
    for first in (0, s_q // 2, s_q - 2):  # float64 of two query tokens at a time, where they sit in k
        rows = slice(first, first + 2)
        expected = index_scores_prefill_reference(q_idx[rows].float(), weights[rows], k.float(), k_scale,
                                                  q_offset=s_kv - s_q + first)
        assert torch.equal(scores[rows] == float("-inf"), expected == float("-inf"))
        assert _relative_error(scores[rows], expected) < sparse_module.FP8_INDEX_ERROR
    indices = select_topk(scores, 2048)[:, None]
    g = torch.Generator(device="cuda").manual_seed(1)
    kv = torch.randn(s_kv, 1, D, device="cuda", generator=g).bfloat16()
    q = (2 * torch.randn(s_q, 128, D, device="cuda", generator=g)).bfloat16()
    scale = 1 / math.sqrt(192)  # DeepSeek's (128 + 64)^-1/2
    out, lse = sparse_mla_prefill(q, kv, indices, softmax_scale=scale)
    sample = torch.tensor([0, 1, s_q // 2, s_q - 1], device="cuda")
    expected = sparse_mla_prefill_reference(q[sample], kv, indices[sample], softmax_scale=scale)
    _assert_close(out[sample].cpu(), lse[sample].cpu(), expected[0].cpu(), expected[1].cpu(), torch.bfloat16)

"""Variable-length FlashAttention: the Triton kernel under the interpreter (fp16, fp32) on
packed ragged sequences (lengths 1, 0, tails, Nq != Nk, GQA 1/2/4, causal top-left or
bottom-right or not) against
naive attention per sequence in float64, writing every row of its sequence and nothing
else; packing changes no bit of any sequence's result; bad input refused; the custom op,
its fallback, the eager reference and the benchmark's FLOP and byte counts. On a GPU:
bf16/fp16/fp32 at serving sizes against float64."""

import pytest
import torch
import torch.nn.functional as F

from kforge.kernels.attention.flash_forward import CONFIGS
from kforge.kernels.attention.flash_varlen import default_config, flash_attention_varlen
from kforge.kernels.attention.naive import naive_attention
from kforge.ops.varlen_attention import (cumulative_seqlens, varlen_attention_flops, varlen_attention_min_bytes,
                                         varlen_attention_reference)
from kforge.ops.varlen_attention import flash_attention_varlen as varlen_op

SMALL = {"BLOCK_M": 16, "BLOCK_N": 16}

# (query lengths, key lengths, heads, kv_heads, head_dim)
CASES = {
    "self-attention, tails, length 1, GQA 2": ([1, 37, 16, 50], [1, 37, 16, 50], 4, 2, 32),
    "Nq != Nk both ways, GQA 4": ([5, 33, 1, 20], [40, 7, 20, 20], 4, 1, 16),
    "one key, one long key block, GQA 1": ([23, 9], [1, 64], 2, 2, 64),
}


def _packed(lens_q, lens_k, heads, kv_heads, dim, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), heads, dim, generator=g)
    k, v = (torch.randn(sum(lens_k), kv_heads, dim, generator=g) for _ in range(2))
    tensors = [t.to(dtype=dtype, device=device) for t in (q, k, v)]
    return (*tensors, cumulative_seqlens(lens_q, device), cumulative_seqlens(lens_k, device))


def _per_sequence_naive(q, k, v, cu_q, cu_k, causal, scale=None, bottom_right=False):
    """Float64 (out, lse) in the packed layout: naive attention on each sequence alone; a
    sequence without keys gives zeros and -inf."""
    q, k, v = q.double(), k.double(), v.double()
    out = torch.zeros_like(q)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float64, device=q.device)
    offsets_q, offsets_k = cu_q.tolist(), cu_k.tolist()
    for (q0, q1), (k0, k1) in zip(zip(offsets_q, offsets_q[1:]), zip(offsets_k, offsets_k[1:])):
        if q1 > q0 and k1 > k0:
            o, s = naive_attention(*(t.transpose(0, 1)[None] for t in (q[q0:q1], k[k0:k1], v[k0:k1])),
                                   causal=causal, scale=scale, return_lse=True, bottom_right=bottom_right)
            out[q0:q1], lse[:, q0:q1] = o[0].transpose(0, 1), s[0]
    return out, lse


def _tolerance(dtype):  # fp16: P rounded to fp16 before P V (2^-11 relative); fp32: exact products
    return 2e-3 if dtype == torch.float16 else 2e-6


def _guarded_nan_output(q, guard=2):
    """A NaN buffer with `guard` rows either side of the (total_q, heads, dim) output view."""
    whole = torch.full((q.shape[0] + 2 * guard, *q.shape[1:]), float("nan"), dtype=q.dtype)
    return whole, whole[guard:guard + q.shape[0]]


# --- the Triton kernel under the interpreter -------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
@pytest.mark.slow
def test_varlen_matches_per_sequence_float64_and_writes_exactly_its_rows(case, causal, dtype):
    lens_q, lens_k, *heads_dim = case
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, *heads_dim, dtype)
    whole, out = _guarded_nan_output(q)
    result, lse = flash_attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal, out=out,
                                         config=SMALL)
    assert result.data_ptr() == out.data_ptr() and lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32
    assert whole[:2].isnan().all() and whole[-2:].isnan().all(), "wrote outside the output's rows"
    assert not out.isnan().any(), "left rows unwritten"
    ref, ref_lse = _per_sequence_naive(q, k, v, cu_q, cu_k, causal)
    tol = _tolerance(dtype)
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.slow
def test_packing_changes_no_bit_of_any_sequence_even_beside_huge_values(causal):
    # The middle sequence's keys and values are huge: one key or value read across a
    # boundary would show in its neighbours. Each sequence run alone must give the same bits.
    lens_q, lens_k = [19, 40, 7], [25, 33, 18]
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, 4, 2, 32, torch.float32, seed=1)
    k[25:58] *= 30
    v[25:58] *= 1e4
    packed, packed_lse = flash_attention_varlen(q, k, v, cu_q, cu_k, 40, 33, causal=causal, config=SMALL)
    assert packed[19:59].abs().max() > 1e3 and packed[:19].abs().max() < 10 and packed[59:].abs().max() < 10
    for b in range(3):
        rows_q, rows_k = slice(*cu_q[b:b + 2].tolist()), slice(*cu_k[b:b + 2].tolist())
        alone, alone_lse = flash_attention_varlen(q[rows_q], k[rows_k], v[rows_k], cumulative_seqlens([lens_q[b]]),
                                                  cumulative_seqlens([lens_k[b]]), lens_q[b], lens_k[b],
                                                  causal=causal, config=SMALL)
        assert torch.equal(packed[rows_q], alone), f"sequence {b} differs when packed"
        assert torch.equal(packed_lse[:, rows_q], alone_lse), f"sequence {b}'s log-sum-exp differs when packed"


def test_causal_is_top_left_aligned_within_each_sequence_as_sdpa():
    lens_q, lens_k = [3, 6], [5, 2]
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, 2, 2, 16, torch.float32, seed=2)
    out, _ = flash_attention_varlen(q, k, v, cu_q, cu_k, 6, 5, causal=True, config=SMALL)
    assert torch.equal(out[0], v[0]) and torch.equal(out[3], v[5]), "a sequence's first query sees only its first key"
    full, _ = flash_attention_varlen(q, k, v, cu_q, cu_k, 6, 5, causal=False, config=SMALL)
    assert torch.equal(out[4:9], full[4:9]), "queries at or past the last key see every key"
    assert not torch.equal(out[:3], full[:3])
    for (q0, q1), (k0, k1) in (((0, 3), (0, 5)), ((3, 9), (5, 7))):
        expected = F.scaled_dot_product_attention(*(t.double().transpose(0, 1) for t in (q[q0:q1], k[k0:k1], v[k0:k1])),
                                                  is_causal=True)
        torch.testing.assert_close(out[q0:q1].double(), expected.transpose(0, 1), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_bottom_right_causal_matches_float64_with_more_and_fewer_keys_than_queries(dtype):
    # query i sees keys up to i + len_k - len_q: with 33 queries and 7 keys, the first 26 rows see none
    lens_q, lens_k = [5, 33, 1, 20, 16], [40, 7, 20, 20, 48]
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, 4, 2, 16, dtype, seed=5)
    whole, out = _guarded_nan_output(q)
    _, lse = flash_attention_varlen(q, k, v, cu_q, cu_k, 33, 48, causal=True, bottom_right=True, out=out,
                                    config=SMALL)
    assert whole[:2].isnan().all() and whole[-2:].isnan().all() and not out.isnan().any()
    ref, ref_lse = _per_sequence_naive(q, k, v, cu_q, cu_k, True, bottom_right=True)
    tol = _tolerance(dtype)
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[5:31], torch.zeros_like(out[5:31])) and lse[:, 5:31].eq(float("-inf")).all()


def test_bottom_right_causal_is_a_continued_chunk_of_causal_self_attention():
    # a prompt of 45 tokens whose last 13 come as a chunk after 32 cached ones: the chunk's rows
    # of top-left causal self-attention over all 45 tokens
    q, k, v, cu, _ = _packed([45], [45], 4, 1, 32, torch.float32, seed=6)
    whole, _ = flash_attention_varlen(q, k, v, cu, cu, 45, 45, causal=True, config=SMALL)
    chunk, _ = flash_attention_varlen(q[32:], k, v, cumulative_seqlens([13]), cu, 13, 45, causal=True,
                                      bottom_right=True, config=SMALL)
    torch.testing.assert_close(chunk, whole[32:], rtol=2e-6, atol=2e-6)
    top_left, _ = flash_attention_varlen(q[32:], k, v, cumulative_seqlens([13]), cu, 13, 45, causal=True,
                                         config=SMALL)
    assert not torch.allclose(top_left, whole[32:]), "top-left alignment would let the chunk see too little"
    same, _ = flash_attention_varlen(q, k, v, cu, cu, 45, 45, causal=True, bottom_right=True, config=SMALL)
    assert torch.equal(same, whole), "with as many keys as queries the two alignments are one mask"


@pytest.mark.slow
def test_tiles_larger_than_every_sequence_and_many_key_blocks_agree():
    lens_q, lens_k = [100, 3, 70], [130, 64, 1]
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, 2, 1, 32, torch.float32, seed=3)
    for causal in (False, True):
        ref, _ = _per_sequence_naive(q, k, v, cu_q, cu_k, causal)
        for blocks in ({"BLOCK_M": 32, "BLOCK_N": 16}, {"BLOCK_M": 64, "BLOCK_N": 32}, {"BLOCK_M": 128, "BLOCK_N": 64}):
            out, _ = flash_attention_varlen(q, k, v, cu_q, cu_k, 100, 130, causal=causal, config=blocks)
            torch.testing.assert_close(out.double(), ref, rtol=2e-6, atol=2e-6,
                                       msg=lambda m: f"{blocks} causal={causal}: {m}")


@pytest.mark.filterwarnings("ignore:divide by zero encountered in log2")  # log(0) = -inf is the point
def test_empty_sequences_give_zero_rows_and_minus_infinite_lse():
    # no queries (first), queries without keys (second), both empty at the end
    lens_q, lens_k = [0, 17, 3, 0], [9, 0, 21, 0]
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, 2, 2, 32, torch.float32, seed=4)
    whole, out = _guarded_nan_output(q)
    for causal in (False, True):
        _, lse = flash_attention_varlen(q, k, v, cu_q, cu_k, 17, 21, causal=causal, out=out, config=SMALL)
        assert whole[:2].isnan().all() and whole[-2:].isnan().all()
        assert torch.equal(out[:17], torch.zeros_like(out[:17])) and lse[:, :17].eq(float("-inf")).all()
        ref, ref_lse = _per_sequence_naive(q, k, v, cu_q, cu_k, causal)
        torch.testing.assert_close(out.double(), ref, rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
    no_keys = _packed([4, 2], [0, 0], 2, 1, 16, torch.float16)
    out, lse = flash_attention_varlen(*no_keys, 4, 0)
    assert torch.equal(out, torch.zeros_like(out)) and lse.eq(float("-inf")).all()
    no_queries = _packed([0, 0], [3, 5], 2, 1, 16, torch.float16)
    out, lse = flash_attention_varlen(*no_queries, 0, 5)
    assert out.shape == (0, 2, 16) and lse.shape == (2, 0)


def test_reads_the_heads_of_a_fused_qkv_projection_and_honours_the_scale():
    lens = [13, 30]
    qkv = torch.randn(43, 3, 4, 32)  # (tokens, q/k/v, heads, dim): q, k, v are strided views of it
    q, k, v = qkv.unbind(1)
    cu = cumulative_seqlens(lens)
    assert not q.is_contiguous()
    out, _ = flash_attention_varlen(q, k, v, cu, cu, 30, 30, causal=True, scale=0.05, config=SMALL)
    ref, _ = _per_sequence_naive(q, k, v, cu, cu, True, scale=0.05)
    torch.testing.assert_close(out.double(), ref, rtol=2e-6, atol=2e-6)
    assert out.is_contiguous()


def test_refuses_what_it_cannot_take_before_running():
    q, k, v, cu_q, cu_k = _packed([5, 3], [4, 6], 4, 2, 32, torch.float32)

    def call(**changes):
        args = {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "max_seqlen_q": 5,
                "max_seqlen_k": 6, **changes}
        flash_attention_varlen(**args)

    cases = [
        ({"q": q[None]}, "3-D"),
        ({"k": k.half()}, "one floating-point dtype"),
        ({"cu_seqlens_q": cu_q.long()}, "int32"),
        ({"cu_seqlens_q": cu_q[:1]}, "batch >= 1"),
        ({"cu_seqlens_k": cumulative_seqlens([4, 6, 0])}, "different batches"),
        ({"cu_seqlens_q": cu_q.to("meta")}, "one device"),
        ({"cu_seqlens_q": cu_q + 1}, "start at 0"),
        ({"cu_seqlens_k": torch.tensor([0, 11, 10], dtype=torch.int32)}, "non-decreasing; sequence 1 has length -1"),
        ({"cu_seqlens_q": cumulative_seqlens([5, 2])}, "ends at 7 but q has 8 rows"),
        ({"max_seqlen_q": 4}, "below the longest sequence in cu_seqlens_q"),
        ({"max_seqlen_k": 5.0}, "non-negative int"),
        ({"k": k[:, :1].expand(10, 3, 32), "v": v[:, :1].expand(10, 3, 32)}, "multiple of key/value heads"),
        ({"q": q[..., :24], "k": k[..., :24], "v": v[..., :24]}, "head_dim 24"),
        ({"q": q.double(), "k": k.double(), "v": v.double()}, "dtype torch.float64"),
        ({"q": torch.randn(8, 4, 33)[..., :32]}, "TMA"),
        ({"scale": -1.0}, "positive finite"),
        ({"out": torch.empty(8, 4, 32, dtype=torch.float16)}, "out must be"),
    ]
    for changes, message in cases:
        with pytest.raises(ValueError, match=message):
            call(**changes)


def test_default_tiles_are_the_dense_sweeps_and_fit_the_h100s_shared_memory():
    for dim in (16, 32, 64, 128, 256):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            tile = default_config(dim, dtype)
            buffers = tile["BLOCK_M"] + 2 * tile["num_stages"] * tile["BLOCK_N"]  # Q, then K and V per stage
            assert buffers * dim * dtype.itemsize <= 228 * 1024, (dim, dtype, tile)
    assert default_config(128, torch.bfloat16) == {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}
    assert default_config(256, torch.float16)["BLOCK_N"] == CONFIGS[256][0].kwargs["BLOCK_N"]


# --- the custom op, its fallback and the benchmark's helpers ---------------------------------

def test_op_passes_opcheck_and_its_fallback_matches_float64_per_sequence():
    q, k, v, cu_q, cu_k = _packed([0, 7, 1, 12], [3, 0, 9, 12], 4, 2, 16, torch.float64)
    for causal in (False, True):
        torch.library.opcheck(torch.ops.kforge.flash_attention_varlen.default,
                              (q, k, v, cu_q, cu_k, 12, 12, causal, 0.3, True, causal))
        out, lse = varlen_op(q, k, v, cu_q, cu_k, 12, 12, causal=causal, scale=0.3, return_lse=True)
        ref, ref_lse = _per_sequence_naive(q, k, v, cu_q, cu_k, causal, scale=0.3)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-6, atol=1e-6)  # the op's lse is fp32
    out = varlen_op(q, k, v, cu_q, cu_k, 12, 12, causal=True, scale=0.3, bottom_right=True)
    ref, _ = _per_sequence_naive(q, k, v, cu_q, cu_k, True, scale=0.3, bottom_right=True)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="non-decreasing"):
        varlen_op(q, k, v, torch.tensor([0, 7, 5, 8, 20], dtype=torch.int32), cu_k, 12, 12)


def test_op_compiles_into_one_graph():
    q, k, v, cu_q, cu_k = _packed([9, 16], [9, 16], 4, 2, 32, torch.float32)
    compiled = torch.compile(lambda *args: varlen_op(*args, 16, 16, causal=True) * 2, backend="aot_eager",
                             fullgraph=True)
    ref, _ = _per_sequence_naive(q, k, v, cu_q, cu_k, True)
    torch.testing.assert_close(compiled(q, k, v, cu_q, cu_k).double(), ref * 2, rtol=1e-5, atol=1e-5)


def test_eager_reference_matches_per_sequence_naive_in_float64():
    q, k, v, cu_q, cu_k = _packed([0, 7, 1, 12], [3, 0, 9, 12], 4, 1, 16, torch.float64)
    for causal in (False, True):
        ref, _ = _per_sequence_naive(q, k, v, cu_q, cu_k, causal)
        out = varlen_attention_reference(q, k, v, cu_q, cu_k, 12, 12, causal=causal)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


def test_flops_count_exactly_the_visible_pairs_and_bytes_count_q_k_v_and_out_once():
    lens_q, lens_k = [5, 3, 0, 7], [3, 6, 4, 7]
    for causal in (False, True):
        pairs = sum(int(torch.ones(a, b).tril().sum()) if causal else a * b for a, b in zip(lens_q, lens_k))
        assert varlen_attention_flops(lens_q, lens_k, 8, 64, causal) == 4 * 8 * 64 * pairs
    assert varlen_attention_flops([4096], [4096], 1, 128, True) == 4 * 128 * 4096 * 4097 // 2
    assert varlen_attention_min_bytes(lens_q, lens_k, 8, 2, 64) == 2 * 64 * (2 * 8 * 15 + 2 * 2 * 20)
    assert varlen_attention_min_bytes([10], [10], 4, 4, 128, element_size=4) == 4 * 128 * 4 * 10 * 4
    assert cumulative_seqlens([5, 0, 3]).tolist() == [0, 5, 5, 8] and cumulative_seqlens([1]).dtype == torch.int32


# --- on the GPU ------------------------------------------------------------------------------

SERVING = [100, 4000, 1, 777, 2048, 129, 3000, 513]  # 8 sequences, 10,568 tokens
CHUNKED = ([300, 1, 1000, 64], [1200, 50, 999, 4096])  # queries and keys of different lengths


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_on_the_gpu_matches_float64(head_dim, causal, dtype):
    for lens_q, lens_k in ((SERVING, SERVING), CHUNKED):
        q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, 32, 8, head_dim, dtype, "cuda")
        out, lse = flash_attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal)
        ref, ref_lse = _per_sequence_naive(q, k, v, cu_q, cu_k, causal)
        torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=1e-2 if dtype == torch.bfloat16 else 2e-3)
        torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_bottom_right_causal_on_the_gpu_matches_float64():
    q, k, v, cu_q, cu_k = _packed(*CHUNKED, 32, 8, 128, torch.bfloat16, "cuda")
    out, lse = flash_attention_varlen(q, k, v, cu_q, cu_k, max(CHUNKED[0]), max(CHUNKED[1]), causal=True,
                                      bottom_right=True)
    ref, ref_lse = _per_sequence_naive(q, k, v, cu_q, cu_k, True, bottom_right=True)
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=1e-2)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_on_the_gpu_in_float32_runs_exact_products(causal):
    q, k, v, cu_q, cu_k = _packed([70, 1000, 333], [70, 1000, 333], 8, 2, 128, torch.float32, "cuda")
    out, lse = flash_attention_varlen(q, k, v, cu_q, cu_k, 1000, 1000, causal=causal)
    ref, ref_lse = _per_sequence_naive(q, k, v, cu_q, cu_k, causal)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_packing_on_the_gpu_changes_no_bit_and_leaves_other_rows_alone(causal):
    q, k, v, cu_q, cu_k = _packed(SERVING, SERVING, 32, 8, 128, torch.bfloat16, "cuda")
    out = torch.full_like(q, float("nan"))
    packed, _ = flash_attention_varlen(q, k, v, cu_q, cu_k, 4000, 4000, causal=causal, out=out)
    assert not packed.isnan().any()
    for b, n in enumerate(SERVING):
        rows = slice(*cu_q[b:b + 2].tolist())
        cu = cumulative_seqlens([n], "cuda")
        alone, _ = flash_attention_varlen(q[rows], k[rows], v[rows], cu, cu, n, n, causal=causal)
        assert torch.equal(packed[rows], alone), f"sequence {b} (length {n}) differs when packed"


@pytest.mark.gpu
def test_op_on_the_gpu_runs_our_kernel_and_compiles_with_inductor():
    q, k, v, cu_q, cu_k = _packed(SERVING, SERVING, 32, 8, 128, torch.bfloat16, "cuda")
    kernel_out, _ = flash_attention_varlen(q, k, v, cu_q, cu_k, 4000, 4000, causal=True)
    assert torch.equal(varlen_op(q, k, v, cu_q, cu_k, 4000, 4000, causal=True), kernel_out)
    compiled = torch.compile(lambda *args: varlen_op(*args, 4000, 4000, causal=True), fullgraph=True)
    assert torch.equal(compiled(q, k, v, cu_q, cu_k), kernel_out)
    expected = varlen_attention_reference(q, k, v, cu_q, cu_k, 4000, 4000, causal=True)
    torch.testing.assert_close(kernel_out, expected, rtol=2e-2, atol=1e-2)

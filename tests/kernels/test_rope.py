"""RoPE: the cos/sin table against float64 trigonometry and its cache; the Triton kernel under the
interpreter (fp16, fp32) in place on q and k against the float64 reference, both layouts, full and
partial rotary dims, unsorted and repeated positions, several head blocks, (batch, seq) inputs,
views into a fused QKV buffer; both layouts against rotation as complex multiplication;
out-of-range positions; refusals; byte counts; kforge.ops.rope_ as a mutating custom op under
torch.compile. On a GPU: bf16/fp16/fp32 at Llama-3-8B sizes against float64."""

import pytest
import torch

from kforge.kernels.serving.rope import (apply_rope_, cos_sin_table, rope_min_bytes, rope_reference_, rope_tile)
from kforge.ops.rope import rope_

TOLERANCE = {  # one rounding of an fp32 result (half an ulp: 2^-11 fp16, 2^-9 bf16; rtol twice that)
    # plus, for results near 0, a few fp32 ulps of |x| ~ 4
    torch.float16: dict(rtol=1e-3, atol=1e-5), torch.float32: dict(rtol=1e-5, atol=2e-6),
    torch.bfloat16: dict(rtol=4e-3, atol=1e-5)}
MAX_POSITION = 64
POSITIONS = [5, 0, 63, 5, 17, 17, 2]  # unsorted, repeats, both ends of the table
# (q shape, kv heads, rotary_dim): full rotary; partial rotary with a half (12) that pads to 16
# in a (batch, seq) layout; rotary_dim 128 over 20 + 3 heads: two q head blocks of 16 and a k block
CASES = [((7, 5, 16), 2, 16), ((2, 3, 4, 32), 1, 24), ((2, 20, 128), 3, 128)]


def _qk(q_shape, kv_heads, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    k_shape = (*q_shape[:-2], kv_heads, q_shape[-1])
    q, k = (torch.randn(s, generator=g) for s in (q_shape, k_shape))
    return q.to(dtype=dtype, device=device), k.to(dtype=dtype, device=device)


def _positions(leading, device="cpu"):
    tokens = torch.tensor(POSITIONS * 2)[:torch.Size(leading).numel()]
    return tokens.reshape(leading).to(device)


def _check_against_reference(q, k, positions, rotary_dim, interleaved, tolerance):
    """Rotate q, k in place with our kernel; compare with the float64 reference on copies, and
    check that the dims past rotary_dim were not touched."""
    table = cos_sin_table(MAX_POSITION, rotary_dim, device=q.device)
    expected_q, expected_k = q.double(), k.double()
    rope_reference_(expected_q, expected_k, positions, table, interleaved=interleaved)
    before_q, before_k = q.clone(), k.clone()
    apply_rope_(q, k, positions, table, interleaved=interleaved)
    for got, want, before in ((q, expected_q, before_q), (k, expected_k, before_k)):
        torch.testing.assert_close(got.double(), want, **tolerance)
        assert torch.equal(got[..., rotary_dim:], before[..., rotary_dim:])


# --- the table ---------------------------------------------------------------------------------

def test_table_is_cos_then_sin_of_position_times_frequency_in_float64():
    table = cos_sin_table(5000, 8, base=500.0)
    assert table.shape == (5000, 8) and table.dtype == torch.float32
    positions = torch.tensor([0, 1, 4999], dtype=torch.float64)
    angles = positions[:, None] * 500.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    # fp32 rounding of cos/sin only (6e-8); angles taken in fp32 would be off by ~3e-4 at 4999
    torch.testing.assert_close(table[[0, 1, 4999]].double(), torch.cat((angles.cos(), angles.sin()), 1),
                               rtol=0, atol=1e-7)


def test_table_is_built_once_per_key_and_reused():
    cos_sin_table.cache_clear()
    first = cos_sin_table(128, 16, 10000.0, "cpu")
    assert cos_sin_table(128, 16, 10000, torch.device("cpu")) is first  # same key, spelled differently
    assert cos_sin_table.cache_info().misses == 1 and cos_sin_table.cache_info().hits == 1
    assert cos_sin_table(128, 16, 500000.0, "cpu") is not first  # another base: another table
    q, k = _qk((3, 2, 16), 1, torch.float32)
    rope_(q, k, torch.tensor([0, 1, 2]), max_position=128)
    rope_(q, k, torch.tensor([3, 4, 5]), max_position=128)
    info = cos_sin_table.cache_info()
    assert (info.misses, info.hits) == (2, 3)  # the op's two calls both reused the first table


# --- the kernel under the interpreter ----------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("interleaved", [False, True], ids=["half-split", "interleaved"])
@pytest.mark.parametrize("q_shape,kv_heads,rotary_dim", CASES, ids=str)
def test_rope_kernel_matches_float64_in_place(q_shape, kv_heads, rotary_dim, interleaved, dtype):
    q, k = _qk(q_shape, kv_heads, dtype)
    _check_against_reference(q, k, _positions(q_shape[:-2]), rotary_dim, interleaved, TOLERANCE[dtype])


@pytest.mark.parametrize("interleaved", [False, True], ids=["half-split", "interleaved"])
def test_both_layouts_rotate_their_pairs_as_complex_numbers(interleaved):
    """Independent of the reference: pair (x1, x2) as x1 + i x2, multiplied by e^(i p theta),
    theta_i = base^(-2i/d), with the pairs each layout defines."""
    q, k = _qk((4, 2, 8), 1, torch.float32, seed=3)
    positions = torch.tensor([3000, 0, 7, 3000])
    table = cos_sin_table(4096, 8, base=100.0)
    expected = []
    for x in (q, k):
        x = x.double()
        pairs = torch.complex(x[..., 0::2], x[..., 1::2]) if interleaved else torch.complex(x[..., :4], x[..., 4:])
        angles = positions[:, None, None].double() * 100.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
        rotated = pairs * torch.polar(torch.ones_like(angles), angles)
        parts = (rotated.real, rotated.imag)
        expected.append(torch.stack(parts, -1).flatten(-2) if interleaved else torch.cat(parts, -1))
    apply_rope_(q, k, positions, table, interleaved=interleaved)
    for got, want in zip((q, k), expected):  # the table's fp32 cos/sin, then fp32 arithmetic
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-6)


def test_views_into_a_fused_qkv_buffer_and_a_transposed_batch_are_rotated_where_they_lie():
    tokens, q_heads, kv_heads, dim = 5, 4, 2, 16
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * dim)
    v_before = qkv[:, (q_heads + kv_heads) * dim:].clone()
    q = qkv[:, :q_heads * dim].view(tokens, q_heads, dim)
    k = qkv[:, q_heads * dim:(q_heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    _check_against_reference(q, k, _positions((tokens,)), dim, False, TOLERANCE[torch.float32])
    assert torch.equal(qkv[:, (q_heads + kv_heads) * dim:], v_before)  # v, between and after, untouched
    # q: (batch, heads, seq, dim) storage seen as (batch, seq, heads, dim); k: dense, so every stride differs
    q, k = torch.randn(2, q_heads, 3, dim).transpose(1, 2), torch.randn(2, 3, kv_heads, dim)
    _check_against_reference(q, k, _positions((2, 3)), 8, True, TOLERANCE[torch.float32])


def test_out_of_range_positions_poison_their_token_only():
    q, k = _qk((3, 2, 8), 1, torch.float32)
    before_q = q.clone()
    apply_rope_(q, k, torch.tensor([1, MAX_POSITION, -1]), cos_sin_table(MAX_POSITION, 4), interleaved=False)
    assert q[1:, :, :4].isnan().all() and k[1:, :, :4].isnan().all()
    assert torch.equal(q[1:, :, 4:], before_q[1:, :, 4:])  # past rotary_dim: untouched even so
    assert not q[0].isnan().any() and not k[0].isnan().any()


def test_tiles_cover_rotary_rows_and_heads_up_to_2048_elements():
    assert rope_tile(32, 8, 128) == (16, 64)  # Llama-3-8B: 2 q blocks + 1 k block a token
    assert rope_tile(5, 2, 24) == (8, 16)  # no more heads than the larger tensor has, padded
    assert rope_tile(64, 8, 64) == (32, 32)


def test_bad_inputs_are_refused_before_any_kernel_runs():
    q, k = _qk((3, 4, 16), 2, torch.float32)
    pos = torch.arange(3)
    table = cos_sin_table(MAX_POSITION, 16)
    cases = [
        ((q[0], k[0], pos[0], 16), "both be"),
        ((q, k[:2], pos, 16), "share the leading"),
        ((q, k, pos[:2], 16), "share the leading"),
        ((q, k[..., :8], pos, 16), ">= 1 head and one head_dim"),
        ((q, k[:, :0], pos, 16), ">= 1 head and one head_dim"),
        ((q, k.half(), pos, 16), "share one floating-point dtype"),
        ((q, k, pos.float(), 16), "positions must be int32 or int64"),
        ((q, k, pos, 7), "rotary_dim must be even"),
        ((q, k, pos, 18), "rotary_dim must be even, >= 2 and <= head_dim 16"),
        ((torch.randn(3, 4, 32)[..., ::2], k, pos, 16), "contiguous last dimension"),
    ]
    for (a, b, p, rotary_dim), message in cases:
        with pytest.raises(ValueError, match=message):
            rope_(a, b, p, max_position=MAX_POSITION, rotary_dim=rotary_dim)
        if rotary_dim == 16:
            with pytest.raises(ValueError, match=message):
                apply_rope_(a, b, p, table)
    with pytest.raises(ValueError, match="float32 table"):
        apply_rope_(q, k, pos, table.double())
    with pytest.raises(ValueError, match="the kernel takes float16, bfloat16 or float32 q and k"):
        apply_rope_(q.double(), k.double(), pos, table)
    with pytest.raises(ValueError, match="max_position must be >= 1"):
        rope_(q, k, pos, max_position=0)
    with pytest.raises(ValueError, match="rotary_dim must be even and >= 2"):
        cos_sin_table(8, 3)


def test_min_bytes_read_and_write_the_rotated_dims_once():
    assert rope_min_bytes(4096, 32, 8, 128, torch.bfloat16) == 2 * 4096 * 40 * 128 * 2 + 4096 * 8
    assert rope_min_bytes(10, 16, 16, 64, torch.float32, torch.int32) == 2 * 10 * 32 * 64 * 4 + 10 * 4


# --- the custom op -----------------------------------------------------------------------------

def test_op_passes_opcheck_and_compiles_into_one_graph_with_its_mutations():
    q, k = _qk((6, 4, 16), 2, torch.float32)
    positions = _positions((6,))
    torch.library.opcheck(torch.ops.kforge.rope.default, (q.clone(), k.clone(), positions, MAX_POSITION, 16,
                                                          10000.0, True))

    def attention_inputs(q, k, positions):
        q, k = rope_(q, k, positions, max_position=MAX_POSITION, rotary_dim=8, interleaved=True)
        return q * 2, k.sum()

    compiled = torch.compile(attention_inputs, backend="aot_eager", fullgraph=True)
    eager_q, eager_k = q.clone(), k.clone()
    expected = attention_inputs(eager_q, eager_k, positions)
    got = compiled(q, k, positions)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close((q, k), (eager_q, eager_k))  # the mutations reached the caller's tensors


# --- on the GPU ------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("interleaved", [False, True], ids=["half-split", "interleaved"])
@pytest.mark.parametrize("q_heads,kv_heads,head_dim,rotary_dim", [(32, 8, 128, 128), (64, 8, 128, 128),
                                                                  (16, 16, 256, 64), (12, 4, 80, 32)])
def test_rope_kernel_on_the_gpu_matches_float64(q_heads, kv_heads, head_dim, rotary_dim, interleaved, dtype):
    tokens = 2048
    q, k = _qk((tokens, q_heads, head_dim), kv_heads, dtype, "cuda")
    positions = torch.randint(0, MAX_POSITION, (tokens,), device="cuda")
    _check_against_reference(q, k, positions, rotary_dim, interleaved, TOLERANCE[dtype])


@pytest.mark.gpu
def test_op_on_the_gpu_runs_our_kernel_and_compiles_with_inductor():
    q, k = _qk((4, 256, 32, 128), 8, torch.bfloat16, "cuda")
    positions = torch.arange(256, device="cuda").repeat(4, 1)
    expected_q, expected_k = q.double(), k.double()
    rope_reference_(expected_q, expected_k, positions, cos_sin_table(MAX_POSITION * 8, 128, device="cuda"))
    torch.compile(lambda a, b, p: rope_(a, b, p, max_position=MAX_POSITION * 8), fullgraph=True)(q, k, positions)
    torch.testing.assert_close((q.double(), k.double()), (expected_q, expected_k), **TOLERANCE[torch.bfloat16])

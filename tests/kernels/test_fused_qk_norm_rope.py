"""QK-norm and RoPE (`kernels/fused/qk_norm_rope.py`): under the interpreter, fp16 and fp32
against float64 with and without the norm, (batch, seq, heads, dim) and (tokens, heads,
dim), grouped heads, a head_dim whose half is not a power of two, views of a fused QKV
output; the inputs left untouched; a position past the table poisons only its token; the
rotation by hand; every output written (poisoned outputs); bad inputs refused. On a GPU:
bf16 at Qwen3-8B's heads."""

from __future__ import annotations

import pytest
import torch

from kforge.kernels.fused.qk_norm_rope import qk_norm_rope, qk_norm_rope_min_bytes, qk_norm_rope_reference
from kforge.kernels.serving.rope import cos_sin_table

# fp32 norm and rotation, one rounding (2^-11 relative in fp16); where x1 cos - x2 sin
# cancels, a few fp32 ulps of the terms
TOLERANCE = {torch.float16: dict(rtol=2e-3, atol=2e-3), torch.float32: dict(rtol=1e-5, atol=1e-5),
             torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}


def _operands(leading, q_heads, k_heads, dim, dtype, device="cpu", seed=0, max_position=64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*leading, q_heads, dim, generator=g)
    k = torch.randn(*leading, k_heads, dim, generator=g)
    positions = torch.randint(0, max_position, leading, generator=g)
    qw, kw = torch.rand(dim, generator=g) + 0.5, torch.rand(dim, generator=g) + 0.5
    cast = [t.to(dtype=dtype, device=device) for t in (q, k, qw, kw)]
    return (*cast, positions.to(device), cos_sin_table(max_position, dim, 10000.0, device))


def _check(q, k, qw, kw, positions, table, dtype, eps=1e-6):
    q_out, k_out = qk_norm_rope(q, k, positions, table, q_weight=qw, k_weight=kw, eps=eps)
    assert q_out.shape == q.shape and k_out.shape == k.shape and q_out.dtype == dtype and q_out.is_contiguous()
    torch.testing.assert_close(q_out.double(), qk_norm_rope_reference(q, positions, table, qw, eps), **TOLERANCE[dtype])
    torch.testing.assert_close(k_out.double(), qk_norm_rope_reference(k, positions, table, kw, eps), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "rope-only"])
@pytest.mark.parametrize("leading", [(2, 3), (5,)], ids=str)
def test_matches_float64(leading, norm, dtype, nan_outputs):
    q, k, qw, kw, positions, table = _operands(leading, 4, 2, 32, dtype)  # 4 heads a program: k's block has 2
    _check(q, k, qw if norm else None, kw if norm else None, positions, table, dtype, eps=0.1)


def test_a_head_dim_whose_half_is_not_a_power_of_two(nan_outputs):
    q, k, qw, kw, positions, table = _operands((3,), 5, 1, 40, torch.float32, seed=1)  # halves of 20 in blocks of 32
    _check(q, k, qw, kw, positions, table, torch.float32)


def test_views_of_a_fused_qkv_output_are_read_in_place_and_left_untouched(nan_outputs):
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(2, 3, 4 + 2 + 2, 32, generator=g).half()  # (batch, seq, q + k + v heads, dim)
    q, k = qkv[:, :, :4], qkv[:, :, 4:6]
    before = qkv.clone()
    _, _, qw, kw, positions, table = _operands((2, 3), 4, 2, 32, torch.float16, seed=3)
    _check(q, k, qw, kw, positions, table, torch.float16)
    assert torch.equal(qkv, before)


def test_the_rotation_by_hand():
    table = cos_sin_table(4, 2, 10000.0)  # head_dim 2: one pair, angle = position
    q = torch.tensor([[[1.0, 0.0]], [[0.0, 2.0]]])  # two tokens, one head
    q_out, _ = qk_norm_rope(q, q.clone(), torch.tensor([0, 1]), table)
    c, s = torch.cos(torch.tensor(1.0)), torch.sin(torch.tensor(1.0))
    torch.testing.assert_close(q_out, torch.tensor([[[1.0, 0.0]], [[-2 * s, 2 * c]]]))


def test_a_position_past_the_table_poisons_only_its_token():
    q, k, qw, kw, positions, table = _operands((4,), 2, 2, 16, torch.float32, seed=4, max_position=8)
    positions[2] = 8
    q_out, k_out = qk_norm_rope(q, k, positions, table, q_weight=qw, k_weight=kw)
    assert torch.isnan(q_out[2]).all() and torch.isnan(k_out[2]).all()
    assert torch.isfinite(q_out[[0, 1, 3]]).all() and torch.isfinite(k_out[[0, 1, 3]]).all()


def test_min_bytes_read_and_write_q_and_k_once():
    assert qk_norm_rope_min_bytes(16384, 32, 8, 128) == 2 * 16384 * 40 * 128 * 2 + 8 * 16384 + 2 * 128 * 2


def _bad_cases():
    q, k, qw, kw, positions, table = _operands((3,), 2, 1, 16, torch.float32)
    return [
        ((q[0], k[0], positions[0], table), {}, "must both be"),
        ((q, k[:2], positions, table), {}, "leading"),
        ((q, k[..., :8], positions, table), {}, "head_dim"),
        ((q, k.half(), positions, table), {}, "share one dtype"),
        ((q, k, positions.float(), table), {}, "int32 or int64"),
        ((q, k, positions, table[:, :8]), {}, "cos_sin must be"),
        ((q, k, positions, table), dict(q_weight=qw), "both q_weight and k_weight"),
        ((q, k, positions, table), dict(q_weight=qw[:8], k_weight=kw), "q_weight must be"),
        ((q, k, positions, table), dict(q_weight=qw, k_weight=kw, eps=-1.0), "eps must be"),
        ((torch.randn(3, 2, 32)[..., ::2], k, positions, table), {}, "contiguous last dimension"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_cases())))
def test_bad_inputs_are_refused_with_a_clear_error(case):
    args, kwargs, message = _bad_cases()[case]
    with pytest.raises(ValueError, match=message):
        qk_norm_rope(*args, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "rope-only"])
def test_qwen3_heads_on_the_gpu(norm):
    q, k, qw, kw, positions, table = _operands((2, 4096), 32, 8, 128, torch.bfloat16, "cuda", seed=5,
                                               max_position=40960)
    _check(q, k, qw if norm else None, kw if norm else None, positions, table, torch.bfloat16)

"""kforge.models.sampling: greedy, temperature, top-k, top-p, per-request seeds, validation."""

from __future__ import annotations

import math

import pytest
import torch

from kforge.models.sampling import SamplingParams, make_generator, sample


def logits_of(probs: list[float]) -> torch.Tensor:
    """One row of logits whose softmax is `probs`."""
    return torch.tensor(probs).log()[None, :]


def draws(row: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> torch.Tensor:
    """n independent draws from one row of logits, in one batched call."""
    torch.manual_seed(seed)
    return sample(row.expand(n, -1), [params] * n)


def chi_square(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    expected = expected_probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_greedy_is_argmax_in_any_float_dtype():
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        logits = torch.randn(16, 300).to(dtype)
        tokens = sample(logits, [SamplingParams()] * 16)
        assert tokens.dtype == torch.int64 and tokens.device == logits.device
        assert torch.equal(tokens, logits.argmax(dim=-1))


def test_greedy_ties_go_to_the_lowest_id():
    assert sample(torch.tensor([[1.0, 3.0, 3.0, 0.0]]), [SamplingParams()]).item() == 1


@pytest.mark.parametrize("temperature", [0.1, 1.0, 100.0])
def test_top_k_1_is_greedy_at_any_temperature(temperature):
    torch.manual_seed(1)
    logits = 3 * torch.randn(64, 50)
    tokens = sample(logits, [SamplingParams(temperature=temperature, top_k=1)] * 64)
    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_a_tiny_top_p_is_greedy():
    torch.manual_seed(2)
    logits = torch.randn(64, 50)
    tokens = sample(logits, [SamplingParams(temperature=2.0, top_p=1e-6)] * 64)
    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_tokens_outside_top_k_are_never_drawn():
    row = logits_of([0.05, 0.3, 0.1, 0.25, 0.2, 0.1])
    tokens = draws(row, SamplingParams(temperature=1.0, top_k=3), 2000)
    assert set(tokens.tolist()) == {1, 3, 4}  # the three most likely, each drawn at least once


def test_tokens_outside_the_nucleus_are_never_drawn_and_the_rest_keep_their_odds():
    row = logits_of([0.5, 0.3, 0.15, 0.05])  # 0.5 < 0.75 <= 0.5 + 0.3: the nucleus is {0, 1}
    tokens = draws(row, SamplingParams(temperature=1.0, top_p=0.75), 4000)
    counts = torch.bincount(tokens, minlength=4)
    assert counts[2:].sum() == 0
    assert abs(counts[0] / 4000 - 0.5 / 0.8) < 0.03


def test_the_nucleus_is_measured_after_top_k():
    # top-k keeps {0, 1}, renormalized to 4/7 and 3/7: the first alone reaches top_p = 0.5. Measured on
    # the whole distribution instead, the first (0.4) would not reach it, and token 1 would be drawn.
    row = logits_of([0.4, 0.3, 0.2, 0.1])
    tokens = draws(row, SamplingParams(temperature=1.0, top_k=2, top_p=0.5), 500)
    assert set(tokens.tolist()) == {0}


def test_top_p_1_and_top_k_at_least_vocab_keep_every_token():
    row = logits_of([0.7, 0.2, 0.06, 0.04])
    for params in (SamplingParams(temperature=1.0, top_p=1.0), SamplingParams(temperature=1.0, top_k=4),
                   SamplingParams(temperature=1.0, top_k=50)):
        assert set(draws(row, params, 2000).tolist()) == {0, 1, 2, 3}


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_draws_follow_softmax_of_logits_over_temperature(temperature):
    row = torch.tensor([[1.0, 0.5, 0.0, -0.5, -1.0]])
    counts = torch.bincount(draws(row, SamplingParams(temperature=temperature), 20_000), minlength=5).float()
    # 4 degrees of freedom: 30 is far beyond the 99.99th percentile (23.5), yet a wrong temperature misses by hundreds
    assert chi_square(counts, torch.softmax(row[0] / temperature, dim=-1)) < 30
    for wrong in {0.5, 1.0, 2.0} - {temperature}:
        assert chi_square(counts, torch.softmax(row[0] / wrong, dim=-1)) > 300


def test_a_seeded_request_draws_the_same_tokens_alone_or_in_any_batch_position():
    torch.manual_seed(3)
    vocab, steps = 1000, 20
    logits = torch.randn(steps, vocab)  # step t's logits for the seeded request
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
    others = [SamplingParams(temperature=0.7, top_k=20, seed=99), SamplingParams(temperature=1.3),
              SamplingParams()]

    alone_generator = make_generator(seeded.seed, "cpu")
    alone = [sample(logits[t : t + 1], [seeded], [alone_generator]).item() for t in range(steps)]

    params = [others[0], others[1], seeded, others[2]]
    generators = [make_generator(p.seed, "cpu") for p in params]
    in_batch = []
    for t in range(steps):
        batch_logits = torch.randn(4, vocab)
        batch_logits[2] = logits[t]
        in_batch.append(sample(batch_logits, params, generators)[2].item())

    assert in_batch == alone
    assert len(set(alone)) > 10  # really sampled, not stuck on one token


def test_different_seeds_draw_different_tokens():
    logits = torch.zeros(1, 1000)
    first, second = (sample(logits, [SamplingParams(temperature=1.0)], [make_generator(seed, "cpu")]).item()
                     for seed in (1, 2))
    assert first != second


def test_make_generator():
    assert make_generator(None, "cpu") is None
    one, two = make_generator(7, "cpu"), make_generator(7, "cpu")
    assert torch.equal(torch.rand(5, generator=one), torch.rand(5, generator=two))


def test_a_mixed_batch_in_one_call():
    torch.manual_seed(4)
    row = logits_of([0.05, 0.3, 0.1, 0.25, 0.2, 0.1])[0]
    params = [SamplingParams(), SamplingParams(temperature=5.0, top_k=1), SamplingParams(temperature=1.0, top_k=2),
              SamplingParams(temperature=0.8, top_p=0.5), SamplingParams(temperature=1.0)]
    n = 400
    tokens = sample(row.repeat(n * len(params), 1), params * n).view(n, len(params))
    assert (tokens[:, 0] == 1).all() and (tokens[:, 1] == 1).all()  # greedy, and top-k 1
    assert set(tokens[:, 2].tolist()) == {1, 3}
    # at T=0.8 the two most likely are ~0.37 and ~0.29 of the mass: both needed to reach 0.5
    assert set(tokens[:, 3].tolist()) == {1, 3}
    assert set(tokens[:, 4].tolist()) == set(range(6))


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", math.inf), ("temperature", math.nan),
    ("top_k", -1),
    ("top_p", 0.0), ("top_p", -0.5), ("top_p", 1.5), ("top_p", math.nan),
    ("max_tokens", 0),
    ("stop_token_ids", (2, -1)),
    ("seed", -1), ("seed", 2**64),
])
def test_a_bad_field_raises_one_clear_line(field, value):
    with pytest.raises(ValueError, match=rf"^SamplingParams\.{field} must be [^\n]+, got [^\n]+$"):
        SamplingParams(**{field: value})


def test_stop_token_ids_become_a_tuple():
    assert SamplingParams(stop_token_ids=[2, 3]).stop_token_ids == (2, 3)


@pytest.mark.parametrize("shape", [(8,), (2, 3, 8), (0,)])
def test_logits_that_are_not_batch_by_vocab_raise(shape):
    with pytest.raises(ValueError, match="logits must be a \\(batch, vocab\\)"):
        sample(torch.zeros(shape), [SamplingParams()] * 2)


def test_integer_logits_raise():
    with pytest.raises(ValueError, match="float tensor"):
        sample(torch.zeros(2, 8, dtype=torch.int64), [SamplingParams()] * 2)


def test_params_or_generators_of_the_wrong_length_raise():
    logits = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="as many params"):
        sample(logits, [SamplingParams()])
    with pytest.raises(ValueError, match="as many params"):
        sample(logits, [SamplingParams()] * 2, [None])

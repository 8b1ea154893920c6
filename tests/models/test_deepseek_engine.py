"""The DeepSeek model continuously batched on the scheduler (kforge.models.deepseek.engine), on
the CPU: more requests than slots, of different lengths, held to single-request `generate`
token for token: plain and speculative, greedy and seeded sampling (float64, all-dense, so
batching changes no rounding that could move a draw), the accepted-draft counts included;
stop tokens inside a speculative step; a seeded request alone and in a batch; the refusals."""

from dataclasses import replace

import pytest
import torch

from kforge.errors import ModelError
from kforge.models.deepseek import DeepSeekEngine, generate, preset, random_model
from kforge.models.sampling import SamplingParams

TINY = preset("tiny")
PROMPTS = [[5, 77, 301, 12, 9, 440, 23, 100], [3, 4, 5], list(range(10, 30)), [7] * 5, [100, 200]]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def model():
    """float64 and all-dense (the MoE's grouped GEMMs take fp32 at most), the MTP block too."""
    return random_model(replace(TINY, n_dense_layers=TINY.n_layers + 1), seed=3, dtype=torch.float64)


def _run(engine, params):
    requests = [engine.submit(p, q) for p, q in zip(PROMPTS, params)]
    finished = [r.id for r in engine.run()]
    assert sorted(finished) == sorted(r.id for r in requests) and not engine.scheduler.has_work
    return requests


@pytest.mark.parametrize("k", [0, 1, 3])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_engine_generates_what_single_request_generation_does(model, k, temperature):
    """Three slots for five requests: they join and leave mid-batch. At temperature 1 the
    distributions are flat enough that most drafts are accepted, so the MTP's catch-up over
    accepted and rejected rows alike is what makes the counts agree."""
    params = [SamplingParams(max_tokens=12, temperature=temperature, seed=i) for i in range(len(PROMPTS))]
    alone = [generate(model, p, q, draft_k=k) for p, q in zip(PROMPTS, params)]
    engine = DeepSeekEngine(model, max_slots=3, max_context=64, draft_k=k)
    requests = _run(engine, params)
    assert [r.output for r in requests] == [g.tokens for g in alone]
    assert engine.stats.accepted == sum(g.accepted for g in alone)
    assert engine.stats.drafted == k * engine.stats.row_steps
    assert engine.stats.row_steps == sum(g.target_steps for g in alone), "each request's decode passes, batched"
    if k and temperature:
        assert engine.stats.acceptance_rate > 0.3 and engine.stats.tokens_per_row_step > 1.5
    if k == 0:
        assert engine.stats.tokens_per_row_step == 1.0


def test_greedy_and_sampled_requests_share_a_step_and_each_generates_what_it_would_alone(model):
    params = [SamplingParams(max_tokens=10, temperature=0.0 if i % 2 else 1.0, seed=i) for i in range(len(PROMPTS))]
    alone = [generate(model, p, q, draft_k=2) for p, q in zip(PROMPTS, params)]
    engine = DeepSeekEngine(model, max_slots=4, max_context=64, draft_k=2)
    assert [r.output for r in _run(engine, params)] == [g.tokens for g in alone]
    assert engine.stats.accepted == sum(g.accepted for g in alone)


def test_a_stop_token_inside_a_speculative_step_ends_the_request_there(model):
    # speculative sampling draws differently from plain sampling: the reference is speculative too
    spec = generate(model, PROMPTS[0], SamplingParams(max_tokens=12, temperature=1.0, seed=0), draft_k=3).tokens
    stop = spec[6]
    engine = DeepSeekEngine(model, max_slots=2, max_context=64, draft_k=3)
    request = engine.submit(PROMPTS[0], SamplingParams(max_tokens=12, temperature=1.0, seed=0,
                                                       stop_token_ids=(stop,)))
    for _ in engine.run():
        pass
    assert request.output == spec[:spec.index(stop) + 1] and request.finish_reason == "stop"
    assert engine.stats.emitted > len(request.output) - 1, "the step that emitted the stop emitted more after it"


def test_a_seeded_request_samples_the_same_tokens_alone_and_in_a_batch(model):
    params = SamplingParams(max_tokens=10, temperature=0.9, seed=42)
    alone = DeepSeekEngine(model, max_slots=1, max_context=64, draft_k=2)
    only = alone.submit(PROMPTS[2], params)
    for _ in alone.run():
        pass
    crowded = DeepSeekEngine(model, max_slots=4, max_context=64, draft_k=2)
    others = [crowded.submit(p, SamplingParams(max_tokens=8, temperature=1.0, seed=i)) for i, p in
              enumerate(PROMPTS[:2])]
    same = crowded.submit(PROMPTS[2], params)
    for _ in crowded.run():
        pass
    assert same.output == only.output and all(r.finished for r in others)


def test_bad_requests_and_settings_are_refused_in_one_line(model):
    with pytest.raises(ModelError, match="draft_k must be >= 0"):
        DeepSeekEngine(model, draft_k=-1)
    engine = DeepSeekEngine(model, max_slots=2, max_context=32, draft_k=2)
    with pytest.raises(ModelError, match="temperature only"):
        engine.submit(PROMPTS[0], SamplingParams(temperature=1.0, top_k=5))
    with pytest.raises(ModelError, match="exceeds max_context"):
        engine.submit(list(range(30)), SamplingParams(max_tokens=8))
    with pytest.raises(ModelError, match="non-empty list of token ids"):
        engine.submit([model.config.vocab_size], SamplingParams())
    assert not engine.scheduler.has_work


def test_the_command_prints_the_engine_with_and_without_speculation(capsys):
    from kforge.models.deepseek.generate import main

    main(["--requests", "3", "--slots", "2", "--k", "1", "--max-tokens", "4", "--prompt-len", "4"])
    lines = capsys.readouterr().out.splitlines()
    assert "3 requests of prompt 4, 4 tokens, 2 slots" in lines[0]
    rows = [line.split() for line in lines[2:]]
    assert [row[0] for row in rows] == ["0", "1"] and all(row[-1] == "yes" for row in rows), lines

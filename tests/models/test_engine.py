"""The engine on the tiny checkpoint (CPU, fp32): the same tokens as transformers, and the same
tokens for a request whatever batch it shares, however its prompt is chunked or another request aborted."""

from __future__ import annotations

import pytest
import torch

from kforge.errors import ModelError
from kforge.models.engine import Engine, plan_pages
from kforge.models.llama import from_pretrained, random_model
from kforge.models.sampling import SamplingParams

PROMPTS = [[1, 17, 99, 3], [1, 5, 77, 200, 9, 31, 4, 100, 12, 250, 3, 44, 45, 46, 47, 48, 49, 50, 51], [1, 42],
           [1, 8, 8, 8, 8, 8, 8, 8, 8, 8]]


@pytest.fixture(scope="module")
def model(checkpoint):
    folder, _ = checkpoint
    return from_pretrained(folder, dtype=torch.float32)[0]


def alone(model, prompt, params):
    engine = Engine(model, page_size=8, max_slots=1, max_context=64)
    return engine.generate([prompt], params)[0]


def test_greedy_generation_matches_transformers(model, checkpoint):
    _, hf = checkpoint
    params = SamplingParams(max_tokens=12)
    got = Engine(model, page_size=8, max_slots=4, max_context=64).generate(PROMPTS, params)
    for prompt, tokens in zip(PROMPTS, got):
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
        assert tokens == want[:len(tokens)]
        assert len(tokens) == 12 or tokens[-1] == 2  # max_tokens, or the eos token (kept)


def test_padded_decode_steps_match_transformers(model, checkpoint):
    # 3 requests in 4 slots: the decode steps pad 3 rows to the bucket of 4 (llama/graphs.py,
    # run eagerly on a CPU), the padded row writing only the cache's scratch page
    _, hf = checkpoint
    engine = Engine(model, page_size=8, max_slots=4, max_context=64, cuda_graphs=True)
    assert engine.graphs.bucket(3) == 4
    for prompt, tokens in zip(PROMPTS[:3], engine.generate(PROMPTS[:3], SamplingParams(max_tokens=12))):
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
        assert tokens == want[:len(tokens)]


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=10),
                                    SamplingParams(temperature=0.8, top_k=40, top_p=0.9, max_tokens=10, seed=7)],
                         ids=["greedy", "seeded"])
def test_a_request_gets_the_same_tokens_in_any_batch(model, params):
    # 2 slots for 4 requests: they queue, join and leave mid-batch; 6 tokens a step: the long
    # prompt is prefilled in chunks beside the others' decodes
    engine = Engine(model, page_size=8, max_slots=2, max_context=64, max_step_tokens=6)
    requests = [engine.submit(p, params) for p in PROMPTS]
    steps = 0
    while engine.scheduler.has_work:
        engine.step()
        steps += 1
        if steps == 3:  # a late arrival
            requests.append(engine.submit(PROMPTS[1], params))
    assert steps > 10
    for request in requests:
        assert request.output == alone(model, request.prompt, params), request.id


def test_aborting_one_of_two_running_requests_leaves_the_others_tokens_as_alone(model):
    params = SamplingParams(max_tokens=10)
    engine = Engine(model, page_size=8, max_slots=2, max_context=64, max_step_tokens=6)
    doomed, other, waiting = (engine.submit(p, params) for p in (PROMPTS[3], PROMPTS[0], PROMPTS[2]))
    for _ in range(4):  # 10 + 4 prompt tokens in chunks of 6 at most: both decode by the 4th step
        engine.step()
    assert doomed.output and other.output and engine.scheduler.waiting == (waiting,)
    cut = list(doomed.output)

    assert engine.abort(doomed.id) is doomed and doomed.id not in engine._generators
    assert (doomed.finish_reason, doomed.slot) == ("abort", None) and engine.abort(doomed.id) is None
    for _ in engine.run():  # waiting takes doomed's slot and pages
        pass
    assert doomed.output == cut and doomed.output == alone(model, doomed.prompt, params)[:len(cut)]
    assert other.output == alone(model, other.prompt, params)
    assert waiting.output == alone(model, waiting.prompt, params)
    assert engine.scheduler.free_pages == 2 * 8 and engine.abort("never") is None


def test_the_kv_budget_bounds_the_batch_and_nothing_runs_out(model):
    kv_pages = plan_pages(model, budget_bytes=model.config.kv_bytes_per_token(torch.float32) * 8 * 5, page_size=8,
                          dtype=torch.float32)
    assert kv_pages == 5
    engine = Engine(model, page_size=8, max_slots=4, max_context=64, kv_pages=kv_pages)
    params = SamplingParams(max_tokens=12)  # prompt + 12 tokens: 2 or 4 pages of 8 each
    outputs = engine.generate(PROMPTS, params)
    assert all(len(o) == 12 or o[-1] == 2 for o in outputs)
    assert engine.cache.lengths and engine.scheduler.free_pages == 5


def test_bad_requests_are_one_clear_error(model):
    engine = Engine(model, page_size=8, max_slots=2, max_context=32)
    with pytest.raises(ModelError, match="max_context|longer"):
        engine.submit(list(range(1, 30)), SamplingParams(max_tokens=8))
    with pytest.raises(ModelError, match="needs a tokenizer"):
        engine.submit("hello", SamplingParams())
    with pytest.raises(ModelError, match="token ids in"):
        engine.submit([1, 999], SamplingParams())
    with pytest.raises(ModelError, match="positions"):
        Engine(model, max_context=4096)


def test_random_presets_generate_without_a_checkpoint():
    model = random_model("tiny", seed=1, dtype=torch.float32)
    out = Engine(model, page_size=8, max_slots=2, max_context=64).generate([[1, 2, 3]], SamplingParams(max_tokens=5))
    assert len(out[0]) <= 5 and all(0 <= t < 256 for t in out[0])
    again = Engine(random_model("tiny", seed=1, dtype=torch.float32), page_size=8, max_slots=2, max_context=64)
    assert again.generate([[1, 2, 3]], SamplingParams(max_tokens=5)) == out

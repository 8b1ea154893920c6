"""The engine on the tiny checkpoint (CPU, fp32): the same tokens as transformers, and the same
tokens for a request whatever batch it shares, however its prompt is chunked."""

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

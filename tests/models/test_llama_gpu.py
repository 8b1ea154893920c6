"""The Llama engine on the GPU, on kforge's kernels: the 1B shape in bf16 against transformers
with the same (random) weights."""

import pytest
import torch

from kforge.models.engine import Engine
from kforge.models.llama import Batch, KVCache, random_model
from kforge.models.llama.export import to_hf_config, to_hf_state_dict
from kforge.models.sampling import SamplingParams

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def pair():
    transformers = pytest.importorskip("transformers")
    model = random_model("llama3-1b", seed=0, dtype=torch.bfloat16, device="cuda")
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**to_hf_config(model.config)))
    hf.load_state_dict(to_hf_state_dict(model), strict=False)  # a tied head is one tensor
    return model, hf.to(device="cuda", dtype=torch.bfloat16).eval()


def test_1b_logits_match_transformers_in_bf16(pair):
    model, hf = pair
    prompt = torch.randint(1, model.config.vocab_size, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    cache = KVCache(model.config, num_pages=16, page_size=16, max_slots=1, max_context=256, dtype=torch.bfloat16,
                    device="cuda")
    cache.assign(0, list(range(16)))
    batch = Batch.build([], [(0, 0, prompt, True)], "cuda")
    batch.logit_rows = torch.arange(len(prompt), device="cuda")
    ours = model(batch, cache)
    with torch.no_grad():
        want = hf(torch.tensor([prompt], device="cuda")).logits[0].float()
    rel_l2 = (ours - want).norm() / want.norm()
    top1 = (ours.argmax(-1) == want.argmax(-1)).float().mean()
    assert rel_l2 < 2e-2 and top1 > 0.95, (float(rel_l2), float(top1))  # bf16: two roundings of each product


def test_1b_greedy_tokens_match_transformers_at_first(pair):
    model, hf = pair
    prompt = list(range(1000, 1032))
    ours = Engine(model, max_slots=1, max_context=256).generate([prompt], SamplingParams(max_tokens=8))[0]
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=8, do_sample=False)[0, 32:].tolist()
    assert ours[:4] == want[:4], (ours, want)

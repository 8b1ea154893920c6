"""The Llama engine on the GPU, on kforge's kernels: the 1B shape in bf16 against transformers
with the same (random) weights.

bf16 is not a reference: on these random weights transformers' own bf16 logits are several
% (relative L2) from its fp32 logits and miss its top token at some positions. So both bf16
models are judged against transformers in fp32, and ours must be no further from it than
transformers' bf16 is (with a 25% margin); the architecture itself matches in fp32 within
1e-4 (the CPU tests, tiny checkpoint)."""

import pytest
import torch

from kforge.models.engine import Engine
from kforge.models.llama import Batch, KVCache, random_model
from kforge.models.llama.export import to_hf_config, to_hf_state_dict
from kforge.models.sampling import SamplingParams

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def models():
    """Ours in bf16; transformers with the same weights in fp32 and in bf16."""
    transformers = pytest.importorskip("transformers")
    model = random_model("llama3-1b", seed=0, dtype=torch.bfloat16, device="cuda")
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**to_hf_config(model.config)))
    hf.load_state_dict({k: v.float() for k, v in to_hf_state_dict(model).items()}, strict=False)  # tied head
    hf32 = hf.to(device="cuda", dtype=torch.float32).eval()
    hf16 = transformers.LlamaForCausalLM(transformers.LlamaConfig(**to_hf_config(model.config)))
    hf16.load_state_dict(to_hf_state_dict(model), strict=False)
    return model, hf32, hf16.to(device="cuda", dtype=torch.bfloat16).eval()


def errors(logits: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """Relative L2 error and top-1 agreement against `want`."""
    return float((logits - want).norm() / want.norm()), float((logits.argmax(-1) == want.argmax(-1)).float().mean())


def test_1b_bf16_logits_are_as_close_to_fp32_as_transformers_bf16(models):
    model, hf32, hf16 = models
    prompt = torch.randint(1, model.config.vocab_size, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    cache = KVCache(model.config, num_pages=16, page_size=16, max_slots=1, max_context=256, dtype=torch.bfloat16,
                    device="cuda")
    cache.assign(0, list(range(16)))
    batch = Batch.build([], [(0, 0, prompt, True)], "cuda")
    batch.logit_rows = torch.arange(len(prompt), device="cuda")
    ours = model(batch, cache)
    with torch.no_grad():
        ids = torch.tensor([prompt], device="cuda")
        want, theirs = hf32(ids).logits[0].float(), hf16(ids).logits[0].float()
    (our_err, our_top1), (their_err, their_top1) = errors(ours, want), errors(theirs, want)
    assert our_err <= 1.25 * their_err and our_top1 >= their_top1 - 0.05, (our_err, our_top1, their_err, their_top1)


def test_1b_greedy_tokens_are_fp32_transformers_greedy_up_to_near_ties(models):
    """Our engine's greedy tokens (an eager prefill, then graphed decode steps) against
    transformers in fp32 after the same prefix. Random weights make near-ties common (logits
    of std 0.9 over 128k tokens: the top four can sit within 0.03, and transformers' own bf16
    picks another token there), and ours are ~0.02 off in logit units (2% relative L2). So:
    every token we pick has an fp32 logit within NEAR_TIE of fp32's best, and wherever fp32's
    best leads its runner-up by more than NEAR_TIE, we pick it."""
    near_tie = 0.1  # five times our logit error
    model, hf32, _ = models
    for prompt in (list(range(1000, 1032)), list(range(5000, 5077))):
        ours = Engine(model, max_slots=1, max_context=256).generate([prompt], SamplingParams(max_tokens=24))[0]
        with torch.no_grad():
            logits = hf32(torch.tensor([prompt + ours], device="cuda")).logits[0].float()
        steps = logits[len(prompt) - 1:len(prompt) - 1 + len(ours)]
        best, picked = steps.topk(2, dim=-1), steps.gather(1, torch.tensor(ours, device="cuda")[:, None])[:, 0]
        behind = (best.values[:, 0] - picked).tolist()
        assert max(behind) <= near_tie, (prompt[0], ours, behind)
        decisive = (best.values[:, 0] - best.values[:, 1] > near_tie).tolist()
        assert sum(decisive) >= len(ours) // 3, (prompt[0], decisive)  # the check below must have cases to check
        assert all(t == b for t, b, d in zip(ours, best.indices[:, 0].tolist(), decisive) if d), (prompt[0], ours)

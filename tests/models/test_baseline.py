"""The gpt-fast-style baseline computes what transformers computes (CPU, fp32, uncompiled):
the benchmarks' baseline must be the same model, not a cheaper one."""

import pytest
import torch

from kforge.models.llama import from_pretrained
from kforge.models.llama.baseline import StaticCacheLlama


def test_prefill_then_decode_match_transformers(checkpoint):
    folder, hf = checkpoint
    model, _ = from_pretrained(folder, dtype=torch.float32)
    baseline = StaticCacheLlama(model, max_batch=2, max_context=32)
    seqs = torch.tensor([[1, 9, 8, 7, 6, 5, 200, 201, 17, 18], [1, 42, 43, 44, 45, 46, 47, 48, 49, 50]])
    want = hf(seqs).logits
    got = baseline(seqs[:, :7], torch.arange(7))
    assert torch.allclose(got, want[:, :7], rtol=1e-4, atol=1e-4), (got - want[:, :7]).abs().max()
    for position in range(7, 10):  # one token at a time, both sequences at once
        step = baseline(seqs[:, position:position + 1], torch.tensor([position]))
        assert torch.allclose(step[:, 0], want[:, position], rtol=1e-4, atol=1e-4), position


def test_unwritten_cache_positions_are_never_attended(checkpoint):
    folder, hf = checkpoint
    model, _ = from_pretrained(folder, dtype=torch.float32)
    baseline = StaticCacheLlama(model, max_batch=1, max_context=32)
    for layer in baseline.caches:  # garbage past the written positions would swamp the softmax
        layer.k.fill_(1e4)
        layer.v.fill_(1e4)
    seq = torch.tensor([[1, 5, 6, 7]])
    assert torch.allclose(baseline(seq, torch.arange(4)), hf(seq).logits, rtol=1e-4, atol=1e-4)


def test_a_batch_other_than_the_cache_is_refused(checkpoint):
    folder, _ = checkpoint
    model, _ = from_pretrained(folder, dtype=torch.float32)
    baseline = StaticCacheLlama(model, max_batch=2, max_context=32)
    with pytest.raises(ValueError, match="exactly 2"):
        baseline(torch.tensor([[1, 5]]), torch.arange(2))

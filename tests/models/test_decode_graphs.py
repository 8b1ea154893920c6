"""Decode steps padded to a batch bucket and replayed as CUDA graphs (llama/graphs.py).

On CPU the padded step runs eagerly, so these tests check what the graphs replay: the
buckets, the same tokens as the unpadded forward, and padded rows that write only the
scratch page and leave other slots' lengths alone (fp32, the tiny preset). On a GPU
(marked gpu) the replays give the eager forward's logits on llama3-1b's shapes in each
weight format, while the contexts cross page boundaries."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from kforge.errors import ModelError
from kforge.models.engine import Engine
from kforge.models.llama import Batch, KVCache, Llama, preset, random_model
from kforge.models.llama.graphs import DecodeGraphs, decode_buckets
from kforge.models.sampling import SamplingParams

PROMPTS = [[1, 17, 99, 3], [1, 5, 77, 200, 9, 31, 4, 100, 12, 250, 3, 44, 45, 46, 47, 48, 49, 50, 51], [1, 42],
           [1, 8, 8, 8, 8, 8, 8, 8, 8, 8], [1, 2, 3], [1, 60, 61, 62, 63, 64], [1, 7]]


@pytest.fixture
def tiny():
    return random_model("tiny", seed=1, dtype=torch.float32)


def interleaved_pages(slot: int, slots: int, count: int) -> list[int]:
    """Slot s's pages s, s + slots, ...: a wrong block-table row reads or writes another slot's."""
    return [slot + slots * i for i in range(count)]


@pytest.mark.parametrize("max_batch, buckets", [
    (1, (1,)), (3, (1, 2, 3)), (8, (1, 2, 4, 8)), (20, (1, 2, 4, 8, 16, 20)),
    (64, (1, 2, 4, 8, 16, 24, 32, 48, 64)), (100, (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100)),
])
def test_buckets_are_powers_of_two_then_halfway_points_up_to_max_batch(max_batch, buckets):
    assert decode_buckets(max_batch) == buckets


def test_a_step_takes_the_smallest_bucket_that_holds_it(tiny):
    graphs = DecodeGraphs(tiny, KVCache(tiny.config, num_pages=4, page_size=8, max_slots=20, max_context=32,
                                        dtype=torch.float32, device="cpu"), max_batch=20, max_context=32)
    # one row, exactly a bucket, a bucket + 1, the last bucket below max_batch + 1, max_batch
    assert [graphs.bucket(n) for n in (1, 8, 9, 16, 17, 20)] == [1, 8, 16, 16, 20, 20]
    for n in (0, 21):
        with pytest.raises(ValueError, match="1 to 20 rows"):
            graphs.bucket(n)


def test_the_cache_keeps_a_scratch_page_that_only_the_pad_slot_names(tiny):
    cache = KVCache(tiny.config, num_pages=6, page_size=8, max_slots=3, max_context=32, dtype=torch.float32,
                    device="cpu")
    assert cache.k.shape[1] == 7 and cache.pad_slot == 3 and cache.block_tables.shape[0] == 4
    assert cache.block_tables[3].tolist() == [6, -1, -1, -1] and len(cache.lengths) == 3
    with pytest.raises(ModelError, match="slots"):
        cache.assign(cache.pad_slot, [0])


def test_graphs_are_on_by_default_only_on_cuda(tiny):
    assert Engine(tiny, page_size=8, max_slots=2, max_context=32).graphs is None
    graphs = Engine(tiny, page_size=8, max_slots=2, max_context=32, cuda_graphs=True).graphs
    assert graphs is not None and not graphs.capture and graphs.captured == ()


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=7)],
                         ids=["greedy", "seeded"])
def test_padded_decode_steps_give_the_unpadded_tokens(tiny, params):
    # 6 slots for 7 requests of 3 to 15 new tokens, 8 tokens a step: requests start and finish
    # at different steps, so the decode-only steps come in several sizes, some of them padded
    def generate(engine):
        requests = [engine.submit(p, dataclasses.replace(params, max_tokens=3 + 2 * i)) for i, p in enumerate(PROMPTS)]
        for _ in engine.run():
            pass
        return [r.output for r in requests]

    sizes = {"page_size": 8, "max_slots": 6, "max_context": 64, "max_step_tokens": 8}
    eager = generate(Engine(tiny, **sizes, cuda_graphs=False))
    engine = Engine(tiny, **sizes, cuda_graphs=True)
    graphs, steps = engine.graphs, []

    def counted(decodes):
        steps.append((len(decodes), graphs.bucket(len(decodes))))
        return graphs(decodes)

    engine.graphs = counted
    assert generate(engine) == eager
    assert {n for n, bucket in steps if n < bucket} and {n for n, bucket in steps if n == bucket}, steps
    assert engine.scheduler.free_pages == engine.cache.num_pages


def test_padded_rows_write_only_the_scratch_page_and_advance_only_real_slots(tiny):
    cache = KVCache(tiny.config, num_pages=24, page_size=8, max_slots=6, max_context=32, dtype=torch.float32,
                    device="cpu")
    prompts = {0: list(range(3, 10)), 1: [4, 5, 6], 2: list(range(20, 28)), 5: list(range(30, 47))}
    for slot in prompts:
        cache.assign(slot, interleaved_pages(slot, 6, 4))
    tiny(Batch.build([], [(slot, 0, p, True) for slot, p in prompts.items()], "cpu"), cache)
    unpadded = copy.deepcopy(cache)
    k, v, lengths = cache.k.clone(), cache.v.clone(), list(cache.lengths)

    # 3 rows in the bucket of 4; slot 2 starts its second page, slot 5 is inside its third
    decodes = [(0, 7, 11), (2, 8, 12), (5, 17, 13)]
    logits = DecodeGraphs(tiny, cache, max_batch=6, max_context=32)(decodes)

    want = tiny(Batch.build(decodes, [], "cpu"), unpadded)
    assert torch.allclose(logits, want, rtol=1e-5, atol=1e-5), (logits - want).abs().max()
    assert cache.lengths == unpadded.lengths == [8, 3, 9, 0, 0, 18] and lengths == [7, 3, 8, 0, 0, 17]
    real = slice(0, cache.num_pages)
    for pool, before, reference in ((cache.k, k, unpadded.k), (cache.v, v, unpadded.v)):
        expected = before.clone()
        for slot, position, _ in decodes:
            page, offset = interleaved_pages(slot, 6, 4)[position // 8], position % 8
            assert not torch.equal(pool[:, page, :, offset], before[:, page, :, offset])  # written
            expected[:, page, :, offset] = pool[:, page, :, offset]
        assert torch.equal(pool[:, real], expected[:, real])  # and nothing else, bit for bit
        assert torch.allclose(pool[:, real], reference[:, real], rtol=1e-5, atol=1e-6)
        assert pool[:, cache.num_pages, :, 0].abs().sum() > 0  # the padded row's K or V, in the scratch page


# --- GPU: the graphs themselves -------------------------------------------------------------------


def llama3_1b_two_layers(weights: str) -> Llama:
    """llama3-1b's shapes (vocab, widths, heads, tied head) with 2 of its 16 layers, random
    weights in `weights`' format."""
    return random_model(dataclasses.replace(preset("llama3-1b"), n_layers=2), device="cuda", weights=weights)


@pytest.mark.gpu
@pytest.mark.parametrize("weights", ["bf16", "w4a16", "fp8"])
def test_graph_replays_give_the_eager_forwards_logits(weights):
    model = llama3_1b_two_layers(weights)
    # a block-table row of 256 tokens: the paged decode kernel splits it in two partitions
    cache = KVCache(model.config, num_pages=16, page_size=16, max_slots=4, max_context=256, dtype=torch.bfloat16,
                    device="cuda")
    prompts = [list(range(1000, 1000 + n)) for n in (14, 15, 30, 31)]  # a step or two before a page ends
    for slot, prompt in enumerate(prompts):
        cache.assign(slot, interleaved_pages(slot, 4, 4))
    model(Batch.build([], [(slot, 0, p, True) for slot, p in enumerate(prompts)], "cuda"), cache)
    graphs = DecodeGraphs(model, cache, max_batch=4, max_context=256)
    tokens = torch.randint(1, model.config.vocab_size, (18, 4), generator=torch.Generator().manual_seed(1)).tolist()

    for step, n in enumerate((3, 1, 4) * 6):  # 3 rows padded to 4, one row, 4 rows: slot 0 grows 14 -> 32
        decodes = [(slot, cache.lengths[slot], tokens[step][slot]) for slot in range(n)]
        eager = model(Batch.build(decodes, [], "cuda"), cache)
        for slot in range(n):  # the same step again, replayed: it rewrites the same K and V
            cache.lengths[slot] -= 1
        replayed = graphs(decodes)
        relative = float((replayed - eager).norm() / eager.norm())
        assert relative < 1e-2, (weights, step, n, relative)
    assert graphs.captured == (1, 4)
    assert cache.lengths == [32, 27, 42, 37]  # each across a page's end


@pytest.mark.gpu
def test_engine_warmup_captures_every_bucket_and_generates_the_eager_tokens():
    model = llama3_1b_two_layers("bf16")
    prompts = [list(range(2000, 2000 + n)) for n in (5, 9, 17, 3, 30)]
    params = SamplingParams(max_tokens=8)
    engine = Engine(model, max_slots=6, max_context=128)
    engine.warmup()
    assert engine.graphs.captured == (1, 2, 4, 6)
    graphed = engine.generate(prompts, params)  # 5 rows a decode step, padded to 6
    eager = Engine(model, max_slots=6, max_context=128, cuda_graphs=False).generate(prompts, params)
    assert [tokens[:4] for tokens in graphed] == [tokens[:4] for tokens in eager], (graphed, eager)


def fused_and_unfused_logits(model: Llama, device: str, dtype: torch.dtype, monkeypatch) -> dict[bool, torch.Tensor]:
    """Twelve decode steps of 1, 4 and 3 rows (contexts crossing page ends) replayed through
    DecodeGraphs (eagerly on CPU) with the model's decode fusions on and off."""
    from kforge.models.llama import model as llama_model

    logits = {}
    for fused in (True, False):
        monkeypatch.setattr(llama_model, "FUSED_DECODE", fused)
        cache = KVCache(model.config, num_pages=16, page_size=16, max_slots=4, max_context=256, dtype=dtype,
                        device=device)
        prompts = [list(range(100, 100 + n)) for n in (14, 15, 30, 40)]  # up to 44 of 64 tokens
        for slot, prompt in enumerate(prompts):
            cache.assign(slot, interleaved_pages(slot, 4, 4))
        model(Batch.build([], [(slot, 0, p, True) for slot, p in enumerate(prompts)], device), cache)
        graphs = DecodeGraphs(model, cache, max_batch=4, max_context=256)
        steps = [graphs([(slot, cache.lengths[slot], 7 + step + slot) for slot in range(n)])[0].clone()
                 for step, n in enumerate((1, 4, 3) * 4)]
        logits[fused] = torch.stack(steps)
    return logits


def test_the_fused_decode_step_computes_what_the_unfused_one_does(tiny, monkeypatch):
    """On CPU every op is its reference, so this checks the wiring: the fused path still rotates
    q and k, appends k and v where the unfused one does, and adds the residual."""
    logits = fused_and_unfused_logits(tiny, "cpu", torch.float32, monkeypatch)
    assert torch.equal(logits[True], logits[False])


@pytest.mark.gpu
@pytest.mark.parametrize("weights", ["bf16", "w4a16", "fp8"])
def test_the_fused_decode_step_gives_the_unfused_steps_logits_bit_for_bit(weights, monkeypatch):
    """The decode fusions (GEMV epilogues, RoPE + append) keep the
    unfused ops' arithmetic: graphs captured with FUSED_DECODE on and off replay the same steps
    to the same logits, bit for bit."""
    logits = fused_and_unfused_logits(llama3_1b_two_layers(weights), "cuda", torch.bfloat16, monkeypatch)
    assert torch.equal(logits[True], logits[False])

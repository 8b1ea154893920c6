"""The Llama model against Hugging Face transformers on the same weights (CPU, fp32): a tiny
checkpoint written by `save_pretrained`, read back by `from_pretrained`."""

import json

import pytest
import torch

from kforge.errors import ModelError
from kforge.models.llama import Batch, KVCache, from_pretrained, preset, random_model
from kforge.models.llama.config import from_hf, rope_frequencies
from kforge.models.llama.export import save_pretrained, to_hf_state_dict
from conftest import hf_config

transformers = pytest.importorskip("transformers")
TINY = preset("tiny")


def prefill(model, cache, prompts, slots):
    """All prompts in one step, each from position 0; the logits of every prompt position."""
    chunks = [(slot, 0, p, True) for slot, p in zip(slots, prompts)]
    batch = Batch.build([], chunks, "cpu")
    batch.logit_rows = torch.arange(batch.tokens.numel())
    for slot in slots:
        cache.assign(slot, pages(slot))
    return model(batch, cache)


def pages(slot: int) -> list[int]:
    """16 pages of 8 tokens per slot, interleaved across slots so that a wrong table reads another's."""
    return [slot + 4 * i for i in range(16)]


def new_cache(model, slots=4):
    return KVCache(model.config, num_pages=64, page_size=8, max_slots=slots, max_context=128,
                   dtype=torch.float32, device="cpu")


def test_logits_match_transformers_for_packed_prompts(checkpoint):
    folder, hf = checkpoint
    model, tokenizer = from_pretrained(folder, dtype=torch.float32)
    assert tokenizer is None
    prompts = [[1, 5, 77, 200, 9, 31, 4, 100, 12, 250, 3], [1, 42, 43]]
    logits = prefill(model, new_cache(model), prompts, [2, 0])
    row = 0
    for p in prompts:
        want = hf(torch.tensor([p])).logits[0]
        got = logits[row:row + len(p)]
        row += len(p)
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (got - want).abs().max()


def test_decode_and_chunked_prefill_give_the_full_forwards_logits(checkpoint):
    folder, hf = checkpoint
    model, _ = from_pretrained(folder, dtype=torch.float32)
    cache = new_cache(model)
    seq = [1, 9, 8, 7, 6, 5, 4, 3, 200, 201, 202, 17, 18, 19]
    want = hf(torch.tensor([seq])).logits[0]
    cache.assign(1, pages(1))
    first = model(Batch.build([], [(1, 0, seq[:5], True)], "cpu"), cache)  # a chunk that starts the sequence
    second = model(Batch.build([], [(1, 5, seq[5:12], True)], "cpu"), cache)  # one that continues it
    got = [first[0], second[0]]
    for position in (12, 13):  # then one token at a time
        got.append(model(Batch.build([(1, position, seq[position])], [], "cpu"), cache)[0])
    for logits, position in zip(got, (4, 11, 12, 13)):
        assert torch.allclose(logits, want[position], rtol=1e-4, atol=1e-4), (position, (logits - want[position]).abs().max())
    assert cache.lengths[1] == len(seq)


def test_greedy_tokens_match_transformers_generate(checkpoint):
    folder, hf = checkpoint
    model, _ = from_pretrained(folder, dtype=torch.float32)
    cache = new_cache(model)
    prompt = [1, 17, 99, 3]
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()
    cache.assign(0, pages(0))
    token = int(model(Batch.build([], [(0, 0, prompt, True)], "cpu"), cache)[0].argmax())
    got = [token]
    for position in range(len(prompt), len(prompt) + 7):
        token = int(model(Batch.build([(0, position, token)], [], "cpu"), cache)[0].argmax())
        got.append(token)
    assert got == want


def test_llama3_rope_scaling_matches_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config(), "cpu")
    assert torch.allclose(rope_frequencies(TINY).float(), inv_freq, rtol=1e-6)


def test_tied_embeddings_and_sharded_checkpoints_load(tmp_path):
    from safetensors.torch import save_file

    config = json.loads(hf_config().to_json_string())
    config.update(tie_word_embeddings=True, architectures=["LlamaForCausalLM"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    source = random_model(from_hf(config), seed=3, dtype=torch.float32)
    tensors = to_hf_state_dict(source)
    names = sorted(tensors)
    halves = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2:]}
    for file, part in halves.items():
        save_file({n: tensors[n].contiguous() for n in part}, str(tmp_path / file))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {n: f for f, part in halves.items() for n in part}}))
    loaded, _ = from_pretrained(tmp_path, dtype=torch.float32)
    assert loaded.lm_head is None
    for (name, a), (_, b) in zip(source.named_parameters(), loaded.named_parameters()):
        assert torch.equal(a, b), name


def test_a_saved_preset_loads_back_in_transformers_with_the_same_logits(tmp_path):
    source = random_model("tiny", seed=5, dtype=torch.float32)
    save_pretrained(source, tmp_path)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32).eval()
    ours, _ = from_pretrained(tmp_path, dtype=torch.float32)
    prompt = [1, 60, 61, 62, 63, 64]
    cache = new_cache(ours)
    got = prefill(ours, cache, [prompt], [0])
    assert torch.allclose(got, hf(torch.tensor([prompt])).logits[0], rtol=1e-4, atol=1e-4)


def test_a_tokenizer_json_is_read(checkpoint, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder, _ = checkpoint
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    try:
        _, tokenizer = from_pretrained(folder, dtype=torch.float32)
        assert tokenizer.encode("hello world").ids == [3, 4]
    finally:
        (folder / "tokenizer.json").unlink()


@pytest.mark.parametrize("break_it, message", [
    (lambda d: (d / "config.json").unlink(), "has no config.json"),
    (lambda d: (d / "config.json").write_text("{not json"), "is not valid JSON"),
    (lambda d: (d / "config.json").write_text(json.dumps({"model_type": "gpt2"})), "unknown architecture"),
    (lambda d: [p.unlink() for p in d.glob("*.safetensors")], "has no *.safetensors"),
    (lambda d: (d / "model.safetensors").write_bytes(b"\0" * 64), "not a readable safetensors file"),
])
def test_a_broken_checkpoint_is_one_clear_error(checkpoint, tmp_path, break_it, message):
    import shutil

    folder, _ = checkpoint
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    break_it(copy)
    with pytest.raises(ModelError, match=message.replace("*", r"\*")):
        from_pretrained(copy)


def test_a_missing_directory_and_a_wrong_shape_are_refused(checkpoint, tmp_path):
    with pytest.raises(ModelError, match="no checkpoint directory"):
        from_pretrained(tmp_path / "nowhere")
    folder, _ = checkpoint
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    config = json.loads((copy / "config.json").read_text())
    config["intermediate_size"] = 96
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match="does not fit"):
        from_pretrained(copy)


def test_presets_have_the_published_sizes():
    assert round(preset("llama3-8b").parameter_count() / 1e9, 2) == 8.03
    assert round(preset("llama3-70b").parameter_count() / 1e9, 1) == 70.6
    assert round(preset("llama3-1b").parameter_count() / 1e9, 2) == 1.24
    with pytest.raises(ModelError, match="no model preset"):
        preset("llama9")

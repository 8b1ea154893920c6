"""Weight formats (CPU): what W4A16 and FP8 weights cost in logits against the same model in fp32
and bf16, decoding through the engine in each, the bytes a decode step reads, and refusals.

The quality model is random (std 0.02 weights) with every K a multiple of 128, as the formats
need; its logits are nearly flat (the top two a fraction of their spread apart), so top-1
agreement here is a harsh measure, not a forecast for a trained checkpoint. Measured with
the prompt below against fp32: w4a16 0.198 relative logit error, 0.69 top-1 agreement; fp8
0.058, 0.96; bf16 itself 0.006, 0.98 (seeds 0-2 and prompts of 24 and 64 tokens: w4a16
0.16-0.20 and 0.55-0.79, fp8 0.048-0.061 and 0.86-0.96). The LM head quantized too (quantize_head,
seeds 0-2 against each seed's fp32): w4a16 0.22-0.25 and 0.52-0.71 (0.19-0.22 without), fp8
0.048-0.056 and 0.81-0.92 (0.041-0.049 without)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kforge import ops
from kforge.errors import ModelError
from kforge.models.engine import Engine
from kforge.models.llama import Batch, KVCache, LlamaConfig, from_pretrained, random_model
from kforge.models.llama.quantize import (LINEAR_WEIGHTS, Fp8Weight, Int4Weight, quantize_head, quantize_model,
                                           weight_bytes)
from kforge.models.sampling import SamplingParams

CONFIG = LlamaConfig(vocab_size=512, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256, max_position=256)
PROMPT = torch.randint(0, 512, (48,), generator=torch.Generator().manual_seed(1)).tolist()  # > 32 rows: prefill
BOUNDS = {"w4a16": (0.25, 0.5), "fp8": (0.08, 0.8)}  # (relative logit error below, top-1 agreement at least)
WEIGHT_TYPES = {"w4a16": Int4Weight, "fp8": Fp8Weight}


def prompt_logits(model, prompt: list[int]) -> torch.Tensor:
    """The logits of every prompt position, the prompt prefilled in one step (fp32)."""
    cache = KVCache(model.config, num_pages=16, page_size=16, max_slots=1, max_context=256, dtype=model.embed.dtype,
                    device="cpu")
    cache.assign(0, list(range(16)))
    batch = Batch.build([], [(0, 0, prompt, True)], "cpu")
    batch.logit_rows = torch.arange(len(prompt))
    return model(batch, cache)


def quality(logits: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """(relative L2 logit error, fraction of positions with the same argmax)."""
    relative = ((logits - reference).norm() / reference.norm()).item()
    return relative, (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()


def within_bounds(fmt: str, relative: float, top1: float) -> bool:
    max_relative, min_top1 = BOUNDS[fmt]
    return relative < max_relative and top1 >= min_top1


@pytest.fixture(scope="module")
def references() -> dict[str, torch.Tensor]:
    return {"fp32": prompt_logits(random_model(CONFIG, dtype=torch.float32), PROMPT),
            "bf16": prompt_logits(random_model(CONFIG), PROMPT)}


@pytest.mark.parametrize("fmt", ["w4a16", "fp8"])
def test_the_quality_cost_against_fp32_and_bf16_stays_within_bounds(fmt, references):
    model = random_model(CONFIG, weights=fmt)
    assert all(isinstance(getattr(block, name), WEIGHT_TYPES[fmt]) for block in model.layers for name in LINEAR_WEIGHTS)
    logits = prompt_logits(model, PROMPT)
    bf16_floor, _ = quality(references["bf16"], references["fp32"])
    for reference in ("fp32", "bf16"):
        relative, top1 = quality(logits, references[reference])
        print(f"{fmt} vs {reference}: relative logit error {relative:.4f}, top-1 agreement {top1:.3f}")
        assert within_bounds(fmt, relative, top1), (reference, relative, top1)
        assert relative > 3 * bf16_floor, "no quantization error: were the weights quantized?"


HEAD_BOUNDS = {"w4a16": (0.3, 0.45), "fp8": (0.09, 0.75)}  # the head quantized too


@pytest.mark.parametrize("fmt", ["w4a16", "fp8"])
def test_a_quantized_head_costs_a_measured_step_of_quality_and_its_bytes_go(fmt, references):
    blocks_only = random_model(CONFIG, weights=fmt)
    with_head = random_model(CONFIG, weights=fmt, quantize_head=True)
    assert isinstance(with_head.head_q, WEIGHT_TYPES[fmt]) and blocks_only.head_q is None
    assert torch.equal(with_head.head_weight(), blocks_only.head_weight()), "the bf16 head stays"
    relative, top1 = quality(prompt_logits(with_head, PROMPT), references["fp32"])
    print(f"{fmt} with its head: relative logit error {relative:.4f}, top-1 agreement {top1:.3f}")
    max_relative, min_top1 = HEAD_BOUNDS[fmt]
    assert relative < max_relative and top1 >= min_top1, (relative, top1)
    assert relative > quality(prompt_logits(blocks_only, PROMPT), references["fp32"])[0], "the head's error adds"
    head = blocks_only.head_weight()
    assert weight_bytes(blocks_only) - weight_bytes(with_head) == head.nbytes - with_head.head_q.nbytes > 0


@pytest.mark.parametrize("fmt", ["w4a16", "fp8"])
def test_quantize_head_on_a_quantized_model_gives_the_loaded_with_head_logits(fmt):
    loaded = random_model(CONFIG, weights=fmt, quantize_head=True)
    later = quantize_head(random_model(CONFIG, weights=fmt), fmt)
    assert torch.equal(prompt_logits(later, PROMPT), prompt_logits(loaded, PROMPT))
    with pytest.raises(ModelError, match="quantize_head needs a quantized format"):
        quantize_head(random_model(CONFIG, weights=fmt), "bf16")


def test_a_head_is_quantized_only_in_a_quantized_format():
    with pytest.raises(ModelError, match="quantize_head needs a quantized format"):
        random_model(CONFIG, quantize_head=True)
    odd = dataclasses.replace(CONFIG, dim=192, n_heads=4, n_kv_heads=2)  # 192 is no multiple of 128
    with pytest.raises(ModelError, match="needs a multiple of 128"):
        quantize_model(random_model(odd), "fp8", head=True)


@pytest.mark.parametrize("fmt", ["w4a16", "fp8"])
def test_a_wrong_dequantization_fails_the_bounds(fmt, references):
    model = random_model(CONFIG, weights=fmt)
    scales = "scales" if fmt == "w4a16" else "scale"
    for block in model.layers:
        for name in LINEAR_WEIGHTS:
            weight = getattr(block, name)
            setattr(block, name, dataclasses.replace(weight, **{scales: torch.zeros_like(getattr(weight, scales))}))
    assert not within_bounds(fmt, *quality(prompt_logits(model, PROMPT), references["fp32"]))


@pytest.mark.parametrize("length", [8, 48], ids=["w4a16_matmul", "dequantize+gemm"])
def test_w4a16_runs_the_bf16_model_of_its_dequantized_weights(length):
    """Both W4A16 paths (up to 32 rows, and the dequantized GEMM above) compute exactly what the
    format stores: the quality cost is the format's, not the code's."""
    quantized, dequantized = random_model(CONFIG, weights="w4a16"), random_model(CONFIG)
    for q_block, d_block in zip(quantized.layers, dequantized.layers):
        for name in LINEAR_WEIGHTS:
            weight = getattr(q_block, name)
            getattr(d_block, name).data.copy_(ops.dequantize_int4(weight.qweight, weight.scales, weight.group))
    relative, top1 = quality(prompt_logits(quantized, PROMPT[:length]), prompt_logits(dequantized, PROMPT[:length]))
    assert relative < 1e-2 and top1 == 1.0, relative


def greedy_alone(model, prompt: list[int], steps: int) -> list[int]:
    """Greedy tokens by hand: the prompt in one step, then one decode row at a time."""
    cache = KVCache(model.config, num_pages=8, page_size=8, max_slots=1, max_context=64, dtype=model.embed.dtype,
                    device="cpu")
    cache.assign(0, list(range(8)))
    tokens = [int(model(Batch.build([], [(0, 0, prompt, True)], "cpu"), cache)[0].argmax())]
    for position in range(len(prompt), len(prompt) + steps - 1):
        tokens.append(int(model(Batch.build([(0, position, tokens[-1])], [], "cpu"), cache)[0].argmax()))
    return tokens


PROMPTS = [[1, 17, 99, 3], PROMPT[:19], [1, 42], [1, 8, 8, 8, 8, 8, 8, 8, 8, 8]]
GREEDY = SamplingParams(max_tokens=5)


@pytest.fixture(scope="module", params=["bf16", "w4a16", "fp8"])
def model_and_tokens(request):
    """A model in each format and each prompt's greedy tokens, generated alone."""
    model = random_model(CONFIG, weights=request.param)
    return model, [greedy_alone(model, prompt, GREEDY.max_tokens) for prompt in PROMPTS]


def test_the_engine_decodes_in_each_format(model_and_tokens):
    model, alone = model_and_tokens
    assert Engine(model, page_size=8, max_slots=4, max_context=64).generate(PROMPTS, GREEDY) == alone


def test_a_request_gets_the_same_tokens_in_any_batch(model_and_tokens):
    # 2 slots for 4 requests, 6 tokens a step: they queue, join and leave, the long prompt is chunked
    model, alone = model_and_tokens
    outputs = Engine(model, page_size=8, max_slots=2, max_context=64, max_step_tokens=6).generate(PROMPTS, GREEDY)
    assert outputs == alone


def linear_bytes(model) -> int:
    return sum(getattr(block, name).nbytes for block in model.layers for name in LINEAR_WEIGHTS)


def test_weight_bytes_counts_what_a_decode_step_reads():
    bf16 = random_model(CONFIG)
    everything_but_the_embedding = sum(p.nbytes for name, p in bf16.named_parameters() if name != "embed")
    assert weight_bytes(bf16) == everything_but_the_embedding
    rest = weight_bytes(bf16) - linear_bytes(bf16)
    w4a16, fp8 = random_model(CONFIG, weights="w4a16"), random_model(CONFIG, weights="fp8")
    # INT4: half a byte a value and a 2-byte scale per 128 values, against 2 bytes a value
    assert (weight_bytes(w4a16) - rest) / linear_bytes(bf16) == pytest.approx(1 / 4 + 1 / 128)
    assert 1 / 2 < (weight_bytes(fp8) - rest) / linear_bytes(bf16) < 1 / 2 + 1e-3  # a 4-byte scale per 128 x 128
    assert weight_bytes(w4a16) - rest == linear_bytes(w4a16)
    # the bf16 copies are gone: only the embedding, the norms and the head are parameters still
    assert {name.split(".")[-1] for name, _ in w4a16.named_parameters()} == {"embed", "norm", "lm_head", "attn_norm",
                                                                            "ffn_norm"}


def test_bad_formats_and_shapes_are_one_clear_error(checkpoint):
    with pytest.raises(ModelError, match="weights must be one of bf16, w4a16, fp8, got 'int8'"):
        random_model(CONFIG, weights="int8")
    with pytest.raises(ModelError, match="bf16 activations"):
        random_model(CONFIG, dtype=torch.float32, weights="fp8")
    folder, _ = checkpoint  # the tiny preset: dim 64, ffn 160, neither a multiple of 128
    for fmt in ("w4a16", "fp8"):
        with pytest.raises(ModelError, match=rf"layers\.0\.wqkv \(128, 64\): {fmt} needs .* multiple of 128"):
            from_pretrained(folder, weights=fmt)
    model = random_model(CONFIG, weights="fp8")
    with pytest.raises(ModelError, match="already quantized"):
        quantize_model(model, "w4a16")
    refused = random_model(dataclasses.replace(CONFIG, ffn_dim=160))
    with pytest.raises(ModelError, match=r"layers\.0\.w_down \(128, 160\)"):
        quantize_model(refused, "w4a16")
    assert all(isinstance(getattr(block, name), torch.nn.Parameter) for block in refused.layers
               for name in LINEAR_WEIGHTS)  # left whole

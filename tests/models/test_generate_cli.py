"""`kforge generate` end to end on a CPU: a checkpoint with its tokenizer, a random preset, and
one clear line with exit 2 for each kind of bad input."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch


def kforge(*args):
    return subprocess.run([sys.executable, "-m", "kforge", *map(str, args)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "COLUMNS": "200"})


@pytest.fixture
def with_tokenizer(checkpoint, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path / "tiny"
    shutil.copytree(checkpoint[0], folder)
    vocab = {f"w{i}": i for i in range(256)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder, checkpoint[1]


@pytest.mark.slow
def test_a_text_prompt_gives_transformers_greedy_text(with_tokenizer):
    folder, hf = with_tokenizer
    done = kforge("generate", "--model", folder, "--prompt", "w1 w17 w99 w3", "--max-tokens", "6", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert (result["weights"], result["head"]) == ("bf16", "float32")  # a CPU runs bf16 weights in fp32
    want = hf.generate(torch.tensor([[1, 17, 99, 3]]), max_new_tokens=6, do_sample=False)[0, 4:].tolist()
    assert result["output_ids"] == want[:len(result["output_ids"])]
    assert result["text"] == " ".join(f"w{t}" for t in result["output_ids"])


@pytest.mark.slow
def test_a_preset_generates_from_token_ids():
    done = kforge("generate", "--model", "tiny", "--prompt-ids", "1,2,3", "--max-tokens", "4")
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.split()) <= 4 and "prompt + " in done.stderr


@pytest.mark.parametrize("args, message", [
    (["--model", "nowhere", "--prompt-ids", "1"], "neither a preset (llama3-8b, llama3-70b"),
    (["--model", __file__, "--prompt-ids", "1"], "no checkpoint directory"),
    (["--model", "tiny", "--prompt", "hi"], "needs a tokenizer"),
    (["--model", "tiny", "--prompt-ids", "1,x"], "takes integers"),
    (["--model", "tiny", "--prompt-ids", ",".join(["1"] * 100), "--max-context", "64"], "exceeds max_context"),
    (["--model", "tiny", "--prompt-ids", "1", "--weights", "fp8"], "multiple of 128"),
    (["--model", "tiny", "--prompt-ids", "1", "--quantize-head"], "quantize_head needs a quantized format"),
    # 70B's random weights would not fit a CPU machine's memory (it once ran on, swapping): refused before drawing
    *([(["--model", "llama3-70b", "--prompt-ids", "1"],
        "no CUDA device: llama3-70b's weights need 282 GB in float32 on this CPU, more than half")]
      if not torch.cuda.is_available() else []),
])
@pytest.mark.slow
def test_bad_input_is_one_line_and_exit_2(args, message):
    done = kforge("generate", *args)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["w4a16", "fp8"])
def test_quantize_head_generates_what_the_api_does_with_the_head_quantized(fmt, tmp_path):
    """A checkpoint whose widths the quantized formats take (K a multiple of 128): the CLI says its
    head is quantized, and its greedy tokens with --quantize-head are the API's with
    quantize_head=True."""
    from kforge.models.engine import Engine
    from kforge.models.llama import LlamaConfig, from_pretrained, random_model
    from kforge.models.llama.export import save_pretrained
    from kforge.models.sampling import SamplingParams

    config = LlamaConfig(vocab_size=512, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256, max_position=256)
    save_pretrained(random_model(config, seed=3), tmp_path)
    done = kforge("generate", "--model", tmp_path, "--prompt-ids", "5,9,300,7", "--max-tokens", "5", "--weights", fmt,
                  "--quantize-head", "--json")
    assert done.returncode == 0, done.stderr
    model, _ = from_pretrained(tmp_path, dtype=torch.bfloat16, weights=fmt, quantize_head=True)
    assert model.head_q is not None
    engine = Engine(model, max_slots=1, max_context=64)
    request = engine.submit([5, 9, 300, 7], SamplingParams(max_tokens=5))
    for _ in engine.run():
        pass
    result = json.loads(done.stdout)
    assert (result["weights"], result["head"]) == (fmt, fmt) and result["output_ids"] == request.output


@pytest.mark.slow
def test_serve_refuses_what_it_cannot_quantize_before_listening():
    done = kforge("serve", "--model", "tiny", "--weights", "w4a16", "--port", "0")
    assert done.returncode == 2 and "multiple of 128" in done.stderr and "Traceback" not in done.stderr
    done = kforge("serve", "--model", "tiny", "--quantize-head", "--port", "0")
    assert done.returncode == 2 and "quantize_head needs a quantized format" in done.stderr

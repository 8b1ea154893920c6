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
])
@pytest.mark.slow
def test_bad_input_is_one_line_and_exit_2(args, message):
    done = kforge("generate", *args)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr

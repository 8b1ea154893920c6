"""scripts/decode_ab.py on the CPU: two engines on one tiny model, the switch on while the first
captures its decode step and off while the second does, alternating rounds, the verdict's
interval, the tokens compared; a bad switch refused in one line."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "decode_ab.py"


@pytest.fixture(scope="module")
def decode_ab():
    spec = importlib.util.spec_from_file_location("decode_ab", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up while it is made
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_each_engine_captures_under_its_setting_and_the_rounds_alternate(decode_ab, monkeypatch):
    from kforge.bench import model as bench_model
    from kforge.models.engine import Engine
    from kforge.models.llama import model as llama_model
    from kforge.models.llama.checkpoint import random_model

    seen, order = [], []
    warmup = Engine.warmup
    monkeypatch.setattr(Engine, "warmup", lambda self: (seen.append(llama_model.FUSED_DECODE), warmup(self))[1])
    time_steps = bench_model.time_steps
    monkeypatch.setattr(bench_model, "time_steps",
                        lambda step, **kw: (order.append(step.__self__), time_steps(step, **kw))[1])
    model = random_model("tiny", seed=0, dtype=torch.float32, device="cpu")
    result = decode_ab.compare(model, "FUSED_DECODE", batch=2, prompt=5, rounds=4, steps=2)
    assert seen == [True, False] and llama_model.FUSED_DECODE is True  # restored after
    first, second = order[0], order[1]
    assert first is not second and order == [first, second, second, first] * 2
    assert len(result.ratios) == 4 and result.ratios == [b / a for a, b in zip(result.a_ms, result.b_ms)]
    assert result.low <= result.ratio <= result.high and result.clock == "host"
    assert result.same_tokens  # the fusions keep the arithmetic: the same greedy tokens


def test_a_switch_that_is_not_a_flag_of_the_model_is_refused_in_one_line(decode_ab):
    with pytest.raises(ValueError, match="FUSED_DECODE"):
        decode_ab.check_switch("torch")
    done = subprocess.run([sys.executable, str(SCRIPT), "--model", "tiny", "--switch", "NOPE"], capture_output=True,
                          text=True)
    assert done.returncode != 0 and done.stderr.strip().splitlines() == [
        "decode_ab: --switch must be a flag of kforge.models.llama.model (FUSED_DECODE), got 'NOPE'"]

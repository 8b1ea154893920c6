"""scripts/decode_ab.py on the CPU: two engines on one tiny model, each prefilling and stepping
with its own setting of the switch, alternating rounds, the verdict's interval, the tokens
compared; a bad switch or too few rounds refused in one line."""

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


def test_each_engine_steps_under_its_setting_and_the_rounds_alternate(decode_ab, monkeypatch):
    from kforge.bench import model as bench_model
    from kforge.models.llama import model as llama_model
    from kforge.models.llama.checkpoint import random_model
    from kforge.models.llama.model import Llama

    seen: dict[int, set] = {}  # the flag each engine's forward passes saw, by its cache
    forward = Llama.forward
    monkeypatch.setattr(Llama, "forward", lambda self, batch, cache: (
        seen.setdefault(id(cache), set()).add(llama_model.FUSED_DECODE), forward(self, batch, cache))[1])
    order = []
    time_steps = bench_model.time_steps
    monkeypatch.setattr(bench_model, "time_steps",
                        lambda step, **kw: (order.append(step.__self__), time_steps(step, **kw))[1])
    model = random_model("tiny", seed=0, dtype=torch.float32, device="cpu")
    result = decode_ab.compare(model, "FUSED_DECODE", batch=2, prompt=5, rounds=6, steps=2)
    first, second = order[0], order[1]
    assert first is not second and order == [first, second, second, first] * 3
    assert seen == {id(first.cache): {True}, id(second.cache): {False}}
    assert llama_model.FUSED_DECODE is True  # restored after
    assert len(result.ratios) == 6 and result.ratios == [b / a for a, b in zip(result.a_ms, result.b_ms)]
    assert -float("inf") < result.low <= result.ratio <= result.high < float("inf") and result.clock == "host"
    assert result.same_tokens  # the fusions keep the arithmetic: the same greedy tokens


def test_a_bad_switch_or_too_few_rounds_is_refused_in_one_line(decode_ab):
    with pytest.raises(ValueError, match="FUSED_DECODE"):
        decode_ab.check_switch("torch")
    for args, message in ((["--switch", "NOPE"], "decode_ab: --switch must be a flag of kforge.models.llama.model "
                                                 "(FUSED_DECODE), got 'NOPE'"),
                          (["--rounds", "5"], "decode_ab: --rounds must be at least 6: fewer give no 95% interval")):
        done = subprocess.run([sys.executable, str(SCRIPT), "--model", "tiny", *args], capture_output=True, text=True)
        assert done.returncode != 0 and done.stderr.strip().splitlines() == [message]

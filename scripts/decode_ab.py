"""Two settings of the Llama engine's decode step, timed against each other in one process.

    python scripts/decode_ab.py [--model llama3-8b] [--weights bf16|w4a16|fp8] [--switch FUSED_DECODE]
                                [--batch 1] [--prompt 512] [--rounds 20] [--steps 10]

Why: a decode step's time moves up to ~0.17 ms between two processes of the same setting (H200,
`decode_profile.py`; benchmarks/results/nvidia-h200/decode-fused-quant.txt), more than a fused
launch saves (45-50 us a step). Here both settings share the weights, the process and the GPU's
state. `--switch` names a module-level flag of kforge.models.llama.model (FUSED_DECODE: the decode
fusions): it is True while engine A prefills, captures its decode graphs and steps, False while
engine B does. Each round times `--steps` decode steps of each engine, A first in rounds 0, 2,
4, ... and B first in the others, every step timed from the end of the one before as `kforge
bench model` does (`bench.model.time_steps`). A round's ratio is B's median step over A's; the
verdict is the median of the rounds' ratios and its 95% interval by order statistics
(`harness.verdict.median_interval`), so a speedup is read within one run, against the spread
of its own rounds. A prompt not prefilled in one step, a graph that did not capture, or a row
that stopped early (an EOS) ends the run with one line: each would time something else.

Both engines decode the same random prompts greedily; the last line says whether their tokens
agree (a switch that keeps the arithmetic, as FUSED_DECODE does, must give the same tokens).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Comparison:
    a_ms: list[float]  # each round's median step, setting A (the switch on)
    b_ms: list[float]  # the same rounds, setting B (the switch off)
    ratios: list[float]  # b / a, a round each: above 1, A is faster
    low: float  # the median ratio's 95% interval
    high: float
    same_tokens: bool
    clock: str

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios)


def check_switch(switch: str) -> None:
    """Raise ValueError unless `switch` names a boolean flag of kforge.models.llama.model."""
    from kforge.models.llama import model as llama_model

    if not switch.isupper() or not isinstance(getattr(llama_model, switch, None), bool):
        flags = sorted(name for name, value in vars(llama_model).items() if name.isupper() and isinstance(value, bool))
        raise ValueError(f"--switch must be a flag of kforge.models.llama.model ({', '.join(flags)}), got {switch!r}")


@contextlib.contextmanager
def _flag(module, name: str, value: bool) -> Iterator[None]:
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


def compare(model, switch: str, *, batch: int, prompt: int, rounds: int, steps: int, seed: int = 1) -> Comparison:
    """Engine A (switch on) against engine B (switch off) on `model`, in alternating rounds. Each
    engine prefills, captures its decode graphs and steps with its own setting of the switch (on
    a CPU, or in a bucket whose capture failed, the step runs eagerly and reads the flag as it
    runs)."""
    from kforge.bench.model import time_steps
    from kforge.harness.verdict import MIN_ROUNDS, median_interval
    from kforge.models.engine import Engine
    from kforge.models.llama import model as llama_model
    from kforge.models.sampling import SamplingParams

    check_switch(switch)
    if rounds < MIN_ROUNDS:
        raise ValueError(f"--rounds must be at least {MIN_ROUNDS}: fewer give no 95% interval, got {rounds}")
    cuda = model.embed.device.type == "cuda"
    warmup = 2
    tokens = 1 + rounds * (steps + warmup)  # the prefill's token, then one a step
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, model.config.vocab_size, (prompt,), generator=gen).tolist() for _ in range(batch)]
    engines, requests = {}, {}
    for setting in (True, False):
        with _flag(llama_model, switch, setting), torch.no_grad():
            engine = Engine(model, max_slots=batch, max_context=prompt + tokens + 1, max_step_tokens=prompt * batch)
            requests[setting] = [engine.submit(p, SamplingParams(max_tokens=tokens)) for p in prompts]
            engine.step()  # every prompt in one step
            engine.warmup()  # the decode graphs, captured under this setting
        if any(r.in_prefill for r in requests[setting]):
            raise RuntimeError("the prompts were not prefilled in one step")
        if cuda and engine.graphs.captured != engine.graphs.buckets:
            raise RuntimeError(f"decode graphs captured for {engine.graphs.captured} of {engine.graphs.buckets}: "
                               "an eager bucket would time the host")
        engines[setting] = engine
    a_ms, b_ms = [], []
    for r in range(rounds):
        order = (True, False) if r % 2 == 0 else (False, True)
        timed = {}
        for setting in order:
            with _flag(llama_model, switch, setting), torch.no_grad():
                timed[setting] = time_steps(engines[setting].step, steps=steps, warmup=warmup, cuda=cuda)
        a_ms.append(timed[True].median_ms)
        b_ms.append(timed[False].median_ms)
    for rows in requests.values():  # a row that stopped early (an EOS) would shrink the later steps
        if any(len(r.output) != tokens for r in rows):
            raise RuntimeError(f"a request generated {min(len(r.output) for r in rows)} tokens, not {tokens}")
    ratios = [b / a for a, b in zip(a_ms, b_ms)]
    low, high = median_interval(ratios)
    same = all(list(x.output) == list(y.output) for x, y in zip(requests[True], requests[False]))
    return Comparison(a_ms, b_ms, ratios, low, high, same, "cuda_events" if cuda else "host")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--weights", default="bf16", choices=("bf16", "w4a16", "fp8"))
    parser.add_argument("--switch", default="FUSED_DECODE")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    if min(args.batch, args.prompt, args.steps) < 1:
        sys.exit("decode_ab: --batch, --prompt and --steps must be at least 1")

    from kforge.device import current_device
    from kforge.models.llama.checkpoint import random_model
    from kforge.models.llama.config import PRESETS

    if args.model not in PRESETS:
        sys.exit(f"decode_ab: no preset {args.model!r} (presets: {', '.join(PRESETS)})")
    from kforge.harness.verdict import MIN_ROUNDS

    if args.rounds < MIN_ROUNDS:
        sys.exit(f"decode_ab: --rounds must be at least {MIN_ROUNDS}: fewer give no 95% interval")
    try:
        check_switch(args.switch)
    except ValueError as error:
        sys.exit(f"decode_ab: {error}")
    device = current_device()
    model = random_model(PRESETS[args.model], seed=0, dtype=torch.bfloat16, device=device.torch_device,
                         weights=args.weights)
    try:
        result = compare(model, args.switch, batch=args.batch, prompt=args.prompt, rounds=args.rounds,
                         steps=args.steps)
    except RuntimeError as error:
        sys.exit(f"decode_ab: {error}")
    print(f"# {args.model} {args.weights}, batch {args.batch}, prompt {args.prompt}; {device.name}, "
          f"torch {torch.__version__}; A: {args.switch} on, B: off; {args.rounds} rounds of {args.steps} steps "
          f"each ({result.clock})")
    print("round      A ms      B ms     B / A")
    for r, (a, b, q) in enumerate(zip(result.a_ms, result.b_ms, result.ratios)):
        print(f"{r:5d}  {a:8.4f}  {b:8.4f}  {q:8.4f}")
    print(f"A's step {statistics.median(result.a_ms):.4f} ms, B's {statistics.median(result.b_ms):.4f} ms: "
          f"B / A {result.ratio:.4f} (95% interval {result.low:.4f}-{result.high:.4f})")
    print(f"tokens: {'the same' if result.same_tokens else 'DIFFERENT'} in A and B")


if __name__ == "__main__":
    main()

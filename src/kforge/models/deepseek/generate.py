"""Generation, plain or speculative with the MTP block as the draft (batch 1, gpt-fast's shape).

    model = random_model(preset("tiny"))
    plain = generate(model, prompt, SamplingParams(max_tokens=64))
    spec = generate(model, prompt, SamplingParams(max_tokens=64), draft_k=3)    # MtpDrafter by default
    spec.tokens == plain.tokens; spec.acceptance_rate, spec.tokens_per_step, spec.tokens_per_second

A speculative round, with L tokens committed (the last, y, not yet fed to the target):

1. the drafter proposes K tokens d_1..d_K, each drawn from its distribution q_i (greedy: its argmax);
2. the target runs one decode step of K + 1 tokens [y, d_1, .., d_K], causal among them: its
   logits at each give p_0..p_K, p_i the target's next-token distribution after d_i;
3. verification: greedy accepts d_i while d_i = argmax p_{i-1} and then emits argmax p_a (a
   accepted drafts); sampling runs `kforge.ops.chain_speculative_sampling` (accept d_i with
   probability min(1, p/q), at the first rejection draw from max(0, p - q), after K acceptances
   a bonus token from p_K), so every emitted token follows the target's distribution;
4. the target's cache keeps y and the a accepted drafts (`truncate` drops the rest), and the
   a + 1 emitted tokens are committed.

So greedy speculation emits exactly plain greedy decoding's tokens, 1 to K + 1 a target step.

The MTP drafter (DeepSeek-V3 trains one MTP module; to draft K > 1 tokens it is applied again
on its own output, as SGLang and vLLM run it): row j of the MTP block reads the target's
hidden state h_j and token t_{j+1} and predicts t_{j+2}. After each round it rolls its cache
back to the committed rows and runs the target's a + 1 new hidden states (the verify step's
outputs at y and the accepted drafts) with the tokens after them; its last row predicts d_1.
For d_2..d_K it feeds its own output g in place of h, one row at a time.

Speculative sampling takes the temperature only (top-k and top-p would have to filter p and q
alike; refused for now); plain generation takes every `SamplingParams` field.

    python -m kforge.models.deepseek --preset tiny --max-tokens 64 --k 1,2,4 [--temperature 0.8]
    python -m kforge.models.deepseek --requests 32 --slots 8 --k 1,2    # the batching engine, engine.py

prints plain and speculative generation side by side (random weights): target steps, acceptance,
tokens a step, tokens/s, and whether the tokens equal plain greedy's. A random MTP block's drafts
rarely match a random target's argmax; and on a CPU every op is its PyTorch reference, so the
timings say where the time goes, not how fast a GPU would be.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from kforge import ops
from kforge.errors import ModelError
from kforge.models.deepseek.config import preset
from kforge.models.deepseek.model import DeepSeekV3, random_model
from kforge.models.sampling import SamplingParams, make_generator, sample

Choose = Callable[[torch.Tensor], int]  # logits (1, vocab) -> the token picked (argmax, or a draw)


class Drafter(Protocol):
    def propose(self, tokens: list[int], hidden: torch.Tensor, k: int, choose: Choose
                ) -> tuple[list[int], torch.Tensor]:
        """K draft tokens to follow `tokens` (the committed sequence) and the logits each was picked
        from (K, vocab). `hidden` (1, m, dim): the target's last hidden states at positions
        len(tokens) - 1 - m .. len(tokens) - 2, the ones computed since the last call."""


class MtpDrafter:
    """Drafts with the model's MTP block, applied recursively past the first token (module docstring)."""

    def __init__(self, model: DeepSeekV3, max_context: int):
        self.model = model
        self.cache = model.new_cache(1, max_context, mtp=True)

    def propose(self, tokens: list[int], hidden: torch.Tensor, k: int, choose: Choose
                ) -> tuple[list[int], torch.Tensor]:
        model, start = self.model, len(tokens) - 1 - hidden.shape[1]
        next_tokens = torch.tensor(tokens[start + 1:], device=hidden.device)
        if start == 0:  # after the prompt: the MTP block's own prefill
            g = model.mtp_prefill(hidden, next_tokens, self.cache)
        else:  # rows past `start` were drafts or rejected: redo them from the target's states
            self.cache.truncate(0, start)
            g = model.mtp_decode(hidden, next_tokens[None, :], self.cache)
        logits = model.mtp_logits(g[:, -1])
        drafts, rows = [], []
        for i in range(k):
            drafts.append(choose(logits))
            rows.append(logits)
            if i + 1 < k:
                g = model.mtp_decode(g[:, -1:], torch.tensor([[drafts[-1]]], device=hidden.device), self.cache)
                logits = model.mtp_logits(g[:, -1])
        return drafts, torch.cat(rows)


@dataclass
class Generation:
    tokens: list[int]  # the generated tokens (a stop token included)
    target_steps: int  # the target's forward passes after the prefill
    drafted: int  # draft tokens proposed
    accepted: int  # draft tokens emitted (each accepted and every draft before it)
    decode_seconds: float  # from the first generated token to the last

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens emitted a target step, past the prefill's first token."""
        return (len(self.tokens) - 1) / self.target_steps if self.target_steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return (len(self.tokens) - 1) / self.decode_seconds if self.decode_seconds else 0.0


def generate(model: DeepSeekV3, prompt: Sequence[int], params: SamplingParams | None = None, *,
             draft_k: int = 0, drafter: Drafter | None = None) -> Generation:
    """Generate up to params.max_tokens tokens after `prompt` (default params: greedy, 128 tokens);
    with draft_k > 0, speculatively with K = draft_k drafts a step from `drafter` (default: the
    model's MTP block)."""
    params = params or SamplingParams()
    config, device = model.config, model.embed.device
    prompt = [int(t) for t in prompt]
    if not prompt or not all(0 <= t < config.vocab_size for t in prompt):
        raise ModelError(f"a prompt must be a non-empty list of token ids in [0, {config.vocab_size})")
    if draft_k < 0:
        raise ModelError(f"draft_k must be >= 0, got {draft_k}")
    if draft_k and not params.greedy and (params.top_k or params.top_p < 1):
        raise ModelError("speculative sampling takes the temperature only: top_k and top_p are not supported")
    # a round may feed K + 1 tokens past the last one kept
    max_context = len(prompt) + params.max_tokens + draft_k
    cache = model.new_cache(1, max_context)
    if draft_k and drafter is None:
        drafter = MtpDrafter(model, max_context)
    generator = make_generator(params.seed, device)

    def choose(logits: torch.Tensor) -> int:
        return int(sample(logits, [params], [generator])[0])

    hidden = model.prefill(torch.tensor(prompt, device=device), cache)
    tokens = prompt + [choose(model.logits(hidden[:, -1]))]
    result = Generation(tokens[len(prompt):], 0, 0, 0, 0.0)
    start = _now(device)
    while not _finished(result.tokens, params):
        result.target_steps += 1
        if draft_k == 0:
            hidden = model.decode(torch.tensor([tokens[-1:]], device=device), cache)
            emitted = [choose(model.logits(hidden[:, -1]))]
        else:
            drafts, draft_logits = drafter.propose(tokens, hidden, draft_k, choose)
            hidden = model.decode(torch.tensor([tokens[-1:] + drafts], device=device), cache)
            emitted = verify(drafts, draft_logits, model.logits(hidden[0]), params.temperature, generator)
            accepted = len(emitted) - 1
            cache.truncate(0, len(tokens) + accepted)
            hidden = hidden[:, :accepted + 1]
            result.drafted += draft_k
            result.accepted += accepted
        tokens += emitted
        for token in emitted:
            if _finished(result.tokens, params):
                break
            result.tokens.append(token)
    result.decode_seconds = _now(device) - start
    return result


def verify(drafts: list[int], draft_logits: torch.Tensor, target_logits: torch.Tensor, temperature: float,
           generator: torch.Generator | None) -> list[int]:
    """The accepted drafts and one more token: greedy at temperature 0, else speculative sampling.
    draft_logits (K, vocab), the draft's when it picked each draft; target_logits (K + 1, vocab)."""
    if temperature == 0:
        return greedy_accept(drafts, target_logits.argmax(-1).tolist())
    q = torch.softmax(draft_logits.float() / temperature, dim=-1)
    p = torch.softmax(target_logits.float() / temperature, dim=-1)
    ids = torch.tensor([drafts], device=q.device)
    out, _, emitted = ops.chain_speculative_sampling(q[None], ids, p[None], generator=generator, validate=False)
    return out[0, :int(emitted[0]) + 1].tolist()


def greedy_accept(drafts: list[int], best: list[int]) -> list[int]:
    """Greedy verification: the drafts while each equals the target's argmax before it (`best`,
    K + 1 of them), then the argmax after the last one accepted."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == best[accepted]:
        accepted += 1
    return drafts[:accepted] + [best[accepted]]


def _finished(generated: list[int], params: SamplingParams) -> bool:
    return len(generated) >= params.max_tokens or bool(generated and generated[-1] in params.stop_token_ids)


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kforge.models.deepseek",
                                     description="plain vs speculative generation with the MTP draft, on random "
                                                 "weights or a checkpoint's")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--checkpoint", default=None,
                        help="a DeepSeek-V3 checkpoint directory (config.json, *.safetensors) instead of --preset")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--prompt-len", type=int, default=32, help="random prompt token ids (without --prompt)")
    parser.add_argument("--prompt", default=None, help="a text prompt (needs --checkpoint with a tokenizer.json)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--k", type=_draft_counts, default="1,2,4", help="draft counts, comma-separated")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--requests", type=int, default=0,
                        help="run this many requests through the continuous-batching engine instead of one alone")
    parser.add_argument("--slots", type=int, default=8, help="the engine's slots (with --requests)")
    args = parser.parse_args(argv)
    try:
        device = torch.device(args.device)
    except RuntimeError:
        parser.error(f"--device {args.device}: not a device (cpu, cuda, cuda:1, ...)")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch sees no CUDA device here (--device cpu)")
    try:
        _run(args)
    except ModelError as exc:
        parser.exit(2, f"python -m kforge.models.deepseek: {exc}\n")


def _draft_counts(text: str) -> list[int]:
    """--k: draft counts of at least 1, comma-separated."""
    try:
        counts = [int(k) for k in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes comma-separated integers, got {text!r}") from None
    if any(k < 1 for k in counts):
        raise argparse.ArgumentTypeError(f"draft counts are at least 1, got {text!r}")
    return counts


def _run(args: argparse.Namespace) -> None:
    model, tokenizer = _model(args)
    if args.checkpoint:
        args.preset = args.checkpoint  # the tables' heading names the weights
        if not model.mtp_from_checkpoint:
            print("the checkpoint has no MTP block: the drafts come from random weights", file=sys.stderr)
    if args.prompt is not None:
        if tokenizer is None:
            raise ModelError("--prompt needs a checkpoint with a tokenizer.json (--prompt-len draws random token ids)")
        prompt = tokenizer.encode(args.prompt).ids
        args.prompt_len = len(prompt)
    else:
        prompt = torch.randint(0, model.config.vocab_size, (args.prompt_len,),
                               generator=torch.Generator().manual_seed(args.seed)).tolist()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    if args.requests:
        _engine_table(model, args, params, prompt if args.prompt is not None else None)
        return
    generate(model, prompt, replace(params, max_tokens=2), draft_k=1)  # warm-up: first calls, kernel builds
    print(f"{args.preset}, {args.dtype} on {args.device}, prompt {args.prompt_len}, {args.max_tokens} tokens, "
          f"temperature {args.temperature}")
    print(f"{'drafts K':>8} {'steps':>6} {'accepted':>9} {'tokens/step':>11} {'tokens/s':>9}  same tokens as K=0")
    plain = generate(model, prompt, params)
    for k in [0] + args.k:
        run = plain if k == 0 else generate(model, prompt, params, draft_k=k)
        same = "yes" if run.tokens == plain.tokens else ("no" if params.greedy else "(sampled)")
        print(f"{k:>8} {run.target_steps:>6} {run.acceptance_rate:>9.1%} {run.tokens_per_step:>11.2f} "
              f"{run.tokens_per_second:>9.1f}  {same}")
    if tokenizer is not None and args.prompt is not None:
        print(f"text (K = 0): {tokenizer.decode(plain.tokens)}")


def _model(args: argparse.Namespace) -> tuple[DeepSeekV3, object | None]:
    """The model, and its checkpoint's tokenizer (None for random weights or none in the directory)."""
    dtype = getattr(torch, args.dtype)
    if args.checkpoint:
        from kforge.models.deepseek.checkpoint import from_pretrained

        return from_pretrained(args.checkpoint, dtype=dtype, device=args.device)
    return random_model(preset(args.preset), seed=args.seed, dtype=dtype, device=args.device), None


def _engine_table(model: DeepSeekV3, args: argparse.Namespace, params: SamplingParams,
                  text_prompt: list[int] | None) -> None:
    """The engine on --requests prompts of --prompt-len random tokens (or each the --prompt text),
    each K of --k against K = 0."""
    from kforge.models.deepseek.engine import DeepSeekEngine

    g = torch.Generator().manual_seed(args.seed)
    prompts = [text_prompt or torch.randint(0, model.config.vocab_size, (args.prompt_len,), generator=g).tolist()
               for _ in range(args.requests)]
    each = [replace(params, seed=args.seed + i) for i in range(args.requests)]
    max_context = args.prompt_len + args.max_tokens
    print(f"{args.preset}, {args.dtype} on {args.device}: {args.requests} requests of prompt {args.prompt_len}, "
          f"{args.max_tokens} tokens, {args.slots} slots, temperature {args.temperature}")
    print(f"{'drafts K':>8} {'passes':>7} {'accepted':>9} {'tokens/row-pass':>15} {'tokens/s':>9}  same tokens as K=0")
    plain = None
    for k in [0] + args.k:
        engine = DeepSeekEngine(model, max_slots=args.slots, max_context=max_context, draft_k=k)
        engine.generate(prompts[:1], replace(params, max_tokens=2))  # warm-up: first calls, kernel builds
        engine.stats = type(engine.stats)()
        start = _now(model.embed.device)
        requests = [engine.submit(p, q) for p, q in zip(prompts, each)]
        for _ in engine.run():
            pass
        seconds = _now(model.embed.device) - start
        outputs = [r.output for r in requests]
        plain = outputs if k == 0 else plain
        same = "yes" if outputs == plain else ("no" if params.greedy else "(sampled)")
        stats = engine.stats
        print(f"{k:>8} {stats.target_steps:>7} {stats.acceptance_rate:>9.1%} {stats.tokens_per_row_step:>15.2f} "
              f"{sum(map(len, outputs)) / seconds:>9.1f}  {same}")

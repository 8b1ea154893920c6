"""Next-token sampling for a batch of requests, each with its own parameters, on the logits' device.

A row with temperature 0 takes the argmax of its logits. Any other row samples from

    p = softmax(logits / T)            in fp32, whatever the logits' dtype

restricted first to its `top_k` most likely tokens, then to the nucleus: the smallest set of
the remaining tokens whose probability, renormalized over what top-k left, reaches `top_p`.
A token is in the nucleus when the mass of the tokens ranked above it is still below
`top_p`, so the most likely token always stays. Excluded tokens get probability 0; the rest
are not renormalized, because the draw below does not need it.

The draw is the exponential race: with E_i ~ Exp(1) independent, E_i / p_i ~ Exp(p_i), and
the first of independent exponential clocks to ring is clock i with probability
p_i / sum(p). So argmax_i p_i / E_i is an exact categorical draw from p (scaled by any
constant), computed with one elementwise divide and one argmax: no cumulative sum, no
`torch.multinomial`, and no host sync. (It is the Gumbel-max trick: -log E is Gumbel.)

Batch invariance: row i's noise comes from `generators[i]` when given, so a seeded request
samples the same tokens whatever batch it shares and whatever row it sits in. Make its
generator once, with `make_generator(params.seed, device)`, and pass the same one every
step: a fresh generator each step would replay the same noise every step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens, and when it stops."""

    temperature: float = 0.0  # 0 means greedy (argmax)
    top_k: int = 0  # 0 means off; else keep the k most likely tokens
    top_p: float = 1.0  # 1.0 means off; else keep the smallest set whose probability reaches top_p
    max_tokens: int = 128  # new tokens to generate at most
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None  # the same seeded request samples the same tokens in any batch

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))  # a list would break hashing
        problems = [
            ("temperature", self.temperature, "a finite number >= 0",
             math.isfinite(self.temperature) and self.temperature >= 0),
            ("top_k", self.top_k, "an integer >= 0 (0 means off)", self.top_k >= 0),
            ("top_p", self.top_p, "a number in (0, 1] (1 means off)", 0 < self.top_p <= 1),
            ("max_tokens", self.max_tokens, "an integer >= 1", self.max_tokens >= 1),
            ("stop_token_ids", self.stop_token_ids, "token ids >= 0", all(t >= 0 for t in self.stop_token_ids)),
            ("seed", self.seed, "None or an integer in [0, 2**64)", self.seed is None or 0 <= self.seed < 2**64),
        ]
        for field, value, expected, ok in problems:
            if not ok:
                raise ValueError(f"SamplingParams.{field} must be {expected}, got {value!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A generator on `device` seeded with `seed`, or None (the default generator) when seed is None."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None] | None = None,
) -> torch.Tensor:
    """logits (batch, vocab), any float dtype -> next token ids (batch,) int64 on the same device.

    `params[i]` and `generators[i]` (None: the default generator) belong to row i.
    """
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a (batch, vocab) float tensor, got {tuple(logits.shape)} {logits.dtype}")
    batch, vocab = logits.shape
    if len(params) != batch or (generators is not None and len(generators) != batch):
        n_generators = "no" if generators is None else len(generators)
        raise ValueError(f"{batch} rows of logits need as many params and generators, got {len(params)} "
                         f"and {n_generators}")

    greedy_tokens = logits.argmax(dim=-1)
    if all(p.greedy for p in params):
        return greedy_tokens

    def per_row(values: list, dtype: torch.dtype) -> torch.Tensor:  # a few bytes to the device, no sync
        return torch.tensor(values, dtype=dtype, device=logits.device)

    # greedy rows are sampled at T=1 (no division by 0) and their draw discarded
    temperature = per_row([p.temperature if not p.greedy else 1.0 for p in params], torch.float32)
    probs = torch.softmax(logits.float() / temperature[:, None], dim=-1)
    if any(0 < p.top_k < vocab or p.top_p < 1 for p in params):
        top_k = per_row([p.top_k if 0 < p.top_k < vocab else vocab for p in params], torch.int64)
        top_p = per_row([p.top_p for p in params], torch.float32)
        probs = _restrict_to_top_k_then_nucleus(probs, top_k, top_p)

    noise = torch.empty_like(probs).exponential_()
    for row, generator in enumerate(generators or ()):
        if generator is not None:
            noise[row].exponential_(generator=generator)
    # an Exp(1) draw of exactly 0 would make an excluded token's 0 / 0 a NaN, which argmax would pick
    sampled_tokens = (probs / noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)
    is_greedy = per_row([p.greedy for p in params], torch.bool)
    return torch.where(is_greedy, greedy_tokens, sampled_tokens)


def _restrict_to_top_k_then_nucleus(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero every token outside row i's `top_k[i]` most likely, then outside the nucleus `top_p[i]` of the rest."""
    sorted_probs, sorted_tokens = probs.sort(dim=-1, descending=True, stable=True)  # ties: the lower id ranks first
    rank = torch.arange(probs.shape[-1], device=probs.device)
    sorted_probs = sorted_probs.masked_fill(rank >= top_k[:, None], 0.0)
    cumulative = sorted_probs.cumsum(dim=-1)
    mass_ranked_above = torch.nn.functional.pad(cumulative[:, :-1], (1, 0))
    # the nucleus is measured on the top-k renormalized, hence top_p times the mass top-k kept; top_p = 1 keeps all
    # outright, where rounding could otherwise drop the least likely tokens
    in_nucleus = (mass_ranked_above < top_p[:, None] * cumulative[:, -1:]) | (top_p[:, None] >= 1)
    keep_sorted = in_nucleus & (rank < top_k[:, None])
    keep = torch.zeros_like(keep_sorted).scatter_(-1, sorted_tokens, keep_sorted)
    return probs.masked_fill(~keep, 0.0)

"""Continuous batching for the DeepSeek model, plain or speculative with the MTP draft: the
Llama engine's scheduler (FIFO admission into slots, `kforge.models.scheduler`) drives
`DeepSeekV3` over a latent cache of one row per slot.

    engine = DeepSeekEngine(model, max_slots=8, max_context=512, draft_k=2)
    outputs = engine.generate([prompt_a, prompt_b, ...], SamplingParams(max_tokens=64))
    engine.stats.acceptance_rate, engine.stats.tokens_per_row_step

A step runs what the scheduler hands out:

1. Each newly admitted request's whole prompt, in a pass of its own: the model's prefill is
   unabsorbed attention over the pass's own tokens, so a prompt is never chunked (the step's
   token budget covers every slot's whole context). Its first token is sampled from the last
   position; with speculation the MTP block prefills the same row from the prompt's hidden
   states and the tokens after them (`generate.py` explains the MTP's rows).
2. One pass over every running row past its prompt. Plain: one token a row, all rows sampled
   at once. Speculative, with K = draft_k:
   - draft: the MTP's last output of each row gives d_1; K - 1 more MTP passes over all rows
     give d_2..d_K (each feeds the MTP its own output and the token it just drafted);
   - verify: one target pass of [y, d_1, .., d_K] a row, causal among the K + 1; each row keeps
     a accepted drafts and one more token, by `generate.verify`'s rule (greedy rows by their
     argmaxes, sampled rows in one chain-sampling launch, each at its temperature on draws from
     its own generator);
   - the scheduler records the a + 1 tokens (its `computed` counts y and the a drafts, now in
     the cache); the target's row is cut back to them;
   - catch-up, for the rows still running: the MTP cache is cut back to the committed rows and
     fed the verify pass's K + 1 hidden states with the tokens after them (the emitted ones,
     then filler), all rows at once; row b's output at its position a_b is its next d_1, and
     its MTP row is cut to a_b + 1 new positions (what the filler produced is overwritten
     later: attention is causal, so position a_b never saw it).
3. The scheduler finishes requests on a stop token or at max_tokens (tokens past either are
   dropped) and frees their slots; a freed row starts over at its next prefill.

Greedy speculation emits exactly plain greedy decoding's tokens, request by request, whatever
the batch (the tests hold the engine to `generate`'s plain tokens). Each row's cache holds
max_context + K positions: a verify pass writes K past the last token kept.

On a CPU every kforge op runs its PyTorch reference, so the tests run this code; what the
engine's figures mean there is where the time goes, not how fast a GPU would be.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from kforge import ops
from kforge.errors import ModelError
from kforge.models.deepseek.generate import greedy_accept
from kforge.models.deepseek.model import DeepSeekV3
from kforge.models.sampling import SamplingParams, make_generator, sample
from kforge.models.scheduler import Request, Scheduler, Work


@dataclass
class EngineStats:
    target_steps: int = 0  # decode passes of the target (prefills not counted)
    row_steps: int = 0  # rows those passes advanced, summed
    emitted: int = 0  # tokens the decode passes emitted (kept by the scheduler or not)
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_row_step(self) -> float:
        """Tokens a row gains from one decode pass: 1 plain, 1 to K + 1 speculative."""
        return self.emitted / self.row_steps if self.row_steps else 0.0


class DeepSeekEngine:
    def __init__(self, model: DeepSeekV3, *, max_slots: int = 8, max_context: int = 512, draft_k: int = 0,
                 page_size: int = 16, clock: Callable[[], float] = time.perf_counter):
        if draft_k < 0:
            raise ModelError(f"draft_k must be >= 0, got {draft_k}")
        self.model, self.draft_k, self.device = model, draft_k, model.embed.device
        rows = max_context + draft_k  # a verify pass writes K positions past the last one kept
        self.cache = model.new_cache(max_slots, rows, page_size=page_size)
        self.mtp_cache = model.new_cache(max_slots, rows, mtp=True, page_size=page_size) if draft_k else None
        pages = max_slots * -(-max_context // page_size)  # each slot owns its cache row: pages never bind
        self.scheduler = Scheduler(num_pages=pages, page_size=page_size, max_slots=max_slots,
                                   max_step_tokens=max_slots * max_context, max_context=max_context, clock=clock)
        self.stats = EngineStats()
        self._generators: dict[str, torch.Generator | None] = {}
        self._mtp_out: dict[str, torch.Tensor] = {}  # request id -> the MTP's output that drafts its next d_1
        self._ids = itertools.count()

    # --- requests ------------------------------------------------------------------------------

    def submit(self, prompt: Sequence[int], params: SamplingParams = SamplingParams(),
               request_id: str | None = None) -> Request:
        tokens = [int(t) for t in prompt]
        vocab = self.model.config.vocab_size
        if not tokens or not all(0 <= t < vocab for t in tokens):
            raise ModelError(f"a prompt must be a non-empty list of token ids in [0, {vocab})")
        if self.draft_k and not params.greedy and (params.top_k or params.top_p < 1):
            raise ModelError("speculative sampling takes the temperature only: top_k and top_p are not supported")
        request = Request(id=request_id or f"req-{next(self._ids)}", prompt=tokens, max_tokens=params.max_tokens,
                          stop_token_ids=frozenset(params.stop_token_ids), params=params)
        try:
            self.scheduler.submit(request)
        except ValueError as exc:  # the scheduler's one-line reason
            raise ModelError(str(exc)) from None
        self._generators[request.id] = make_generator(params.seed, self.device)
        return request

    # --- running -------------------------------------------------------------------------------

    def step(self) -> list[Request]:
        """One scheduler step (prefills, then one decode pass); the requests that finished in it."""
        step = self.scheduler.schedule()
        if step is None:
            return []
        tokens: dict[str, list[int]] = {}
        for work in step.prefills:
            tokens[work.request.id] = [self._prefill(work)]
        decodes = step.decodes
        hidden = None
        if decodes and not self.draft_k:
            tokens.update(self._decode(decodes))
        elif decodes:
            emitted, hidden = self._speculate(decodes)
            tokens.update(emitted)
        finished = self.scheduler.complete(step, tokens)
        for request in finished:
            self._generators.pop(request.id, None)
            self._mtp_out.pop(request.id, None)
        if hidden is not None:
            self._catch_up(decodes, hidden, tokens, {r.id for r in finished})
        return finished

    def run(self) -> Iterator[Request]:
        """Step until every submitted request has finished, yielding each as it does."""
        while self.scheduler.has_work:
            yield from self.step()

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams = SamplingParams()
                 ) -> list[list[int]]:
        """Each prompt's generated tokens (its stop token included), in the prompts' order."""
        requests = [self.submit(p, params) for p in prompts]
        for _ in self.run():
            pass
        return [list(r.output) for r in requests]

    # --- the passes ------------------------------------------------------------------------------

    def _choose(self, logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
        return sample(logits, [r.params for r in requests], [self._generators[r.id] for r in requests]).tolist()

    def _prefill(self, work: Work) -> int:
        request, model = work.request, self.model
        if work.start != 0 or not work.emits:  # the budget covers whole prompts: this cannot happen
            raise ModelError(f"request {request.id!r}: a prompt arrived in chunks; the DeepSeek model prefills whole")
        hidden = model.prefill(torch.tensor(work.tokens, device=self.device), self.cache, row=request.slot)
        (first,) = self._choose(model.logits(hidden[:, -1]), [request])
        if self.draft_k:
            next_tokens = torch.tensor(work.tokens[1:] + [first], device=self.device)
            g = model.mtp_prefill(hidden, next_tokens, self.mtp_cache, row=request.slot)
            self._mtp_out[request.id] = g[0, -1]
        return first

    def _decode(self, decodes: list[Work]) -> dict[str, list[int]]:
        requests = [w.request for w in decodes]
        fed = torch.tensor([w.tokens for w in decodes], device=self.device)
        hidden = self.model.decode(fed, self.cache, rows=[r.slot for r in requests])
        chosen = self._choose(self.model.logits(hidden[:, -1]), requests)
        self.stats.target_steps += 1
        self.stats.row_steps += len(decodes)
        self.stats.emitted += len(decodes)
        return {r.id: [t] for r, t in zip(requests, chosen)}

    def _speculate(self, decodes: list[Work]) -> tuple[dict[str, list[int]], torch.Tensor]:
        """Draft K tokens a row, verify them in one target pass: each row's emitted tokens and the
        pass's hidden states (B, K + 1, dim)."""
        model, k = self.model, self.draft_k
        requests = [w.request for w in decodes]
        slots = [r.slot for r in requests]
        g = torch.stack([self._mtp_out[r.id] for r in requests])[:, None]  # (B, 1, dim)
        drafts, draft_logits = [], []
        for i in range(k):
            logits = model.mtp_logits(g[:, -1])
            draft_logits.append(logits)
            drafts.append(self._choose(logits, requests))
            if i + 1 < k:
                g = model.mtp_decode(g[:, -1:], torch.tensor(drafts[-1], device=self.device)[:, None],
                                     self.mtp_cache, rows=slots)
        by_row = [list(row) for row in zip(*drafts)]  # (B, K)
        fed = torch.tensor([w.tokens + d for w, d in zip(decodes, by_row)], device=self.device)
        hidden = model.decode(fed, self.cache, rows=slots)
        kept_by_row = self._verify(requests, by_row, torch.stack(draft_logits, 1), model.logits(hidden))
        emitted = {}
        for b, (request, kept) in enumerate(zip(requests, kept_by_row)):
            emitted[request.id] = kept
            self.cache.truncate(request.slot, decodes[b].start + len(kept))  # y and the accepted drafts
            self.stats.accepted += len(kept) - 1
            self.stats.emitted += len(kept)
        self.stats.target_steps += 1
        self.stats.row_steps += len(decodes)
        self.stats.drafted += k * len(decodes)
        return emitted, hidden

    def _verify(self, requests: list[Request], drafts: list[list[int]], draft_logits: torch.Tensor,
                target_logits: torch.Tensor) -> list[list[int]]:
        """Each row's accepted drafts and one more token, as `generate.verify` decides them for one
        request, with two reads back from the device for the whole batch: the greedy rows'
        argmaxes, and one chain-sampling launch for the sampled rows (each at its temperature, on
        draws from its own generator, so a request's tokens do not depend on its batch).
        draft_logits (B, K, vocab), target_logits (B, K + 1, vocab)."""
        kept: list[list[int]] = [[] for _ in requests]
        greedy = [b for b, r in enumerate(requests) if r.params.greedy]
        if greedy:
            for b, best in zip(greedy, target_logits[greedy].argmax(-1).tolist()):
                kept[b] = greedy_accept(drafts[b], best)
        sampled = [b for b, r in enumerate(requests) if not r.params.greedy]
        if sampled:
            temperature = torch.tensor([requests[b].params.temperature for b in sampled], device=self.device)[:, None,
                                                                                                           None]
            q = torch.softmax(draft_logits[sampled].float() / temperature, dim=-1)
            p = torch.softmax(target_logits[sampled].float() / temperature, dim=-1)
            ids = torch.tensor([drafts[b] for b in sampled], device=self.device)
            uniforms = torch.cat([torch.rand((1, self.draft_k + 1), generator=self._generators[requests[b].id],
                                             dtype=torch.float32, device=self.device) for b in sampled])
            out, _, emitted = ops.chain_speculative_sampling(q, ids, p, uniforms, validate=False)
            for b, row, n in zip(sampled, out.tolist(), emitted.tolist()):
                kept[b] = row[:n + 1]
        return kept

    def _catch_up(self, decodes: list[Work], hidden: torch.Tensor, tokens: dict[str, list[int]],
                  finished: set[str]) -> None:
        """Feed the MTP the verify pass's hidden states of the rows still running (module docstring,
        step 2): its rows cut back to the committed positions, then K + 1 positions a row, the
        emitted tokens then filler as the tokens after them."""
        keep = [b for b, w in enumerate(decodes) if w.request.id not in finished]
        if not keep:
            return
        k = self.draft_k
        requests = [decodes[b].request for b in keep]
        for b, request in zip(keep, requests):
            self.mtp_cache.truncate(request.slot, decodes[b].start)  # drop the drafting passes' rows
        after = [tokens[r.id] + [0] * (k + 1 - len(tokens[r.id])) for r in requests]
        g = self.model.mtp_decode(hidden[keep], torch.tensor(after, device=self.device), self.mtp_cache,
                                  rows=[r.slot for r in requests])
        for row, (b, request) in enumerate(zip(keep, requests)):
            accepted = len(tokens[request.id]) - 1
            self._mtp_out[request.id] = g[row, accepted]
            self.mtp_cache.truncate(request.slot, decodes[b].start + accepted + 1)

"""The engine: requests in, tokens out, on a Llama model, a paged KV cache and the scheduler.

    engine = Engine(model, tokenizer=tokenizer, max_slots=8, max_context=2048)
    outputs = engine.generate(["The capital of France is"], SamplingParams(max_tokens=32))

Each `step()` asks the scheduler (scheduler.py) what to feed: one decode token per running
request, then prompt chunks within the step's token budget. The engine gives every newly
admitted request its pages in the cache, runs one forward pass over the packed tokens
(llama/model.py), samples a token for each request whose logits were computed
(sampling.py), and hands the tokens back to the scheduler, which finishes requests on a
stop token or at max_tokens and frees their slots and pages. `abort()` ends a request early,
between steps (the server's, when its client hangs up).

A step of decodes alone (no prompt chunk) on a GPU is padded to a batch bucket and replayed
as a CUDA graph (llama/graphs.py), captured at the bucket's first step or up front by
`warmup()`; a small batch's decode step is otherwise bound by the host's kernel launches.
Steps with prompt chunks run the eager forward. `cuda_graphs=False` runs every step
eagerly; `cuda_graphs=True` off a GPU runs the padded decode step eagerly, as the CPU tests do.

Sizing: the KV cache gets `kv_pages` pages of `page_size` tokens, shared by `max_slots`
slots; `plan_pages` derives a count from a byte budget. A prompt the context cannot hold
is refused at submit with one line.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Sequence

import torch

from kforge.errors import ModelError
from kforge.models.llama.graphs import DecodeGraphs
from kforge.models.llama.model import Batch, KVCache, Llama
from kforge.models.sampling import SamplingParams, make_generator, sample
from kforge.models.scheduler import Request, Scheduler, Step


def plan_pages(model: Llama, budget_bytes: int, page_size: int, dtype: torch.dtype) -> int:
    """How many KV pages fit in `budget_bytes` (K and V of every layer for page_size tokens each)."""
    return budget_bytes // (page_size * model.config.kv_bytes_per_token(dtype))


class Engine:
    def __init__(self, model: Llama, *, tokenizer=None, page_size: int = 16, max_slots: int = 8,
                 max_context: int = 2048, kv_pages: int | None = None, max_step_tokens: int = 512,
                 clock: Callable[[], float] = time.perf_counter, cuda_graphs: bool | None = None):
        """cuda_graphs: whether decode-only steps take the padded, graphed path; None means
        when the model is on a CUDA device."""
        self.model, self.tokenizer = model, tokenizer
        config = model.config
        if max_context > config.max_position:
            raise ModelError(f"max_context {max_context} is longer than the model's {config.max_position} positions")
        pages_per_slot = -(-max_context // page_size)
        kv_pages = kv_pages or max_slots * pages_per_slot
        device, dtype = model.embed.device, model.embed.dtype
        self.cache = KVCache(config, num_pages=kv_pages, page_size=page_size, max_slots=max_slots,
                             max_context=max_context, dtype=dtype, device=device)
        self.scheduler = Scheduler(num_pages=kv_pages, page_size=page_size, max_slots=max_slots,
                                   max_step_tokens=max(max_step_tokens, max_slots), max_context=max_context,
                                   clock=clock)
        self.device = device
        graphed = device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.graphs = DecodeGraphs(model, self.cache, max_batch=max_slots, max_context=max_context) if graphed else None
        self._generators: dict[str, torch.Generator | None] = {}
        self._ids = itertools.count()

    # --- requests ----------------------------------------------------------------------------

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if not isinstance(prompt, str):
            return [int(t) for t in prompt]
        if self.tokenizer is None:
            raise ModelError("a text prompt needs a tokenizer (a checkpoint with tokenizer.json); pass token ids")
        return list(self.tokenizer.encode(prompt).ids)

    def decode(self, tokens: Sequence[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(list(tokens))

    def submit(self, prompt: str | Sequence[int], params: SamplingParams = SamplingParams(),
               request_id: str | None = None) -> Request:
        tokens = self.encode(prompt)
        vocab = self.model.config.vocab_size
        if not tokens or not all(0 <= t < vocab for t in tokens):
            raise ModelError(f"a prompt must be a non-empty list of token ids in [0, {vocab})")
        stops = set(params.stop_token_ids) | set(self.model.config.eos_token_ids)
        request = Request(id=request_id or f"req-{next(self._ids)}", prompt=tokens, max_tokens=params.max_tokens,
                          stop_token_ids=frozenset(stops), params=params)
        try:
            self.scheduler.submit(request)
        except ValueError as exc:  # the scheduler's one-line reason: too long for the context or the pool
            raise ModelError(str(exc)) from None
        self._generators[request.id] = make_generator(params.seed, self.device)
        return request

    def abort(self, request_id: str) -> Request | None:
        """End a request now (finish_reason "abort"), freeing its slot and pages for others; None if no request with
        this id is waiting or running. Call it on the thread that runs the steps: the engine is not thread-safe."""
        self._generators.pop(request_id, None)
        return self.scheduler.abort(request_id)

    # --- running -------------------------------------------------------------------------------

    def step(self) -> list[Request]:
        """One forward pass; the requests that finished in it."""
        step = self.scheduler.schedule()
        if step is None:
            return []
        if self.graphs is not None and not step.prefills:
            emitting = [w.request for w in step.decodes]
            logits = self.graphs([(w.request.slot, w.start, w.tokens[0]) for w in step.decodes])
        else:
            batch, emitting = self._batch(step)
            logits = self.model(batch, self.cache)
        tokens = sample(logits, [r.params for r in emitting], [self._generators[r.id] for r in emitting]).tolist()
        finished = self.scheduler.complete(step, {r.id: t for r, t in zip(emitting, tokens)})
        for request in finished:
            self._generators.pop(request.id, None)
        return finished

    def _batch(self, step: Step) -> tuple[Batch, list[Request]]:
        """The step as the model's packed batch, and the requests in the order of its logit rows
        (the decodes, then the chunks that end a prompt)."""
        for work in step.prefills:
            if work.start == 0:  # a new occupant of its slot
                self.cache.assign(work.request.slot, work.request.pages)
        decodes = [(w.request.slot, w.start, w.tokens[0]) for w in step.decodes]
        chunks = [(w.request.slot, w.start, w.tokens, w.emits) for w in step.prefills]
        emitting = [w.request for w in step.decodes] + [w.request for w in step.prefills if w.emits]
        return Batch.build(decodes, chunks, self.device), emitting

    def warmup(self) -> None:
        """Capture every batch bucket's decode graph now rather than at its first step (a
        server's or a benchmark's first steps then run at full speed); nothing without graphs."""
        if self.graphs is not None:
            self.graphs.warmup()

    def run(self) -> Iterator[Request]:
        """Step until every submitted request has finished, yielding each as it does."""
        while self.scheduler.has_work:
            yield from self.step()

    def generate(self, prompts: Sequence[str | Sequence[int]], params: SamplingParams = SamplingParams()
                 ) -> list[list[int]]:
        """Each prompt's generated tokens (its stop token included), in the prompts' order."""
        requests = [self.submit(p, params) for p in prompts]
        for _ in self.run():
            pass
        return [list(r.output) for r in requests]

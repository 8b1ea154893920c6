"""Continuous-batching scheduler of kforge's Llama engine: which requests run, and which tokens each step feeds.

The engine owns the model and a paged KV cache. Each step it calls `schedule()`, runs the returned `Step`, samples a
token for every `Work` with `emits=True` and passes them to `complete()`. The policy, and why:

- Admission is FIFO. The head of the queue is admitted when a slot is free and the free pages cover its whole
  reservation, len(prompt) + max_tokens tokens. Reserving everything up front means the cache never runs out
  mid-generation, so there is no preemption and no recompute; the price is that fewer requests run at once than under
  vLLM's on-demand allocation + preemption, since most requests stop well before max_tokens. A request that does not
  fit blocks those behind it: a later small request never jumps an earlier large one, so large ones cannot starve.
- Each step feeds at most `max_step_tokens` tokens (chunked prefill). Every running request past its prompt gets its
  one decode token first, so a long prompt never stalls the streams already generating; the rest of the budget goes
  to prompt chunks of the requests still in prefill, in admission order: a long prompt is split over steps, several
  short ones share a step. The constructor requires max_step_tokens >= max_slots, so the decodes always fit and a
  step with a request in prefill always has room for some of its prompt.
- complete() frees a finished request's slot and pages at once. The lowest free slot and pages are handed out first,
  so slots are reused and the rows in use stay packed.
- abort() frees a request at once, but one in the step in flight at its complete(): the engine may be using its pages.
- One step is in flight at a time: scheduling again before complete() would feed the same tokens twice.

What the engine relies on: `request.slot` is its KV-cache row and `request.pages` the physical pages reserved for
it, in order (position p lives in pages[p // page_size] at offset p % page_size); a Work with start == 0 is a new
occupant of its slot, where any per-row state is reset. `params` passes through untouched.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(eq=False)  # identity, not field equality: two requests are never "the same" by content
class Request:
    """One generation request; the fields after `arrival` are the scheduler's to set."""

    id: str
    prompt: list[int]
    max_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    params: object = None
    arrival: float | None = None
    slot: int | None = None
    pages: list[int] = field(default_factory=list)
    computed: int = 0
    output: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" (the stop token is kept in output), "length" or "abort"
    finish_time: float | None = None

    @property
    def in_prefill(self) -> bool:
        return self.computed < len(self.prompt)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Work:
    """One request's share of a step: `tokens` go at positions start, start + 1, ... of its sequence."""

    request: Request
    start: int
    tokens: list[int]
    emits: bool  # the logits at the last of these tokens give the request's next token

    @property
    def is_decode(self) -> bool:
        return self.start >= len(self.request.prompt)


@dataclass
class Step:
    """What the engine runs in one forward pass: decodes first, then prefill chunks, each in admission order."""

    work: list[Work]

    @property
    def decodes(self) -> list[Work]:
        return [w for w in self.work if w.is_decode]

    @property
    def prefills(self) -> list[Work]:
        return [w for w in self.work if not w.is_decode]

    @property
    def num_tokens(self) -> int:
        return sum(len(w.tokens) for w in self.work)


class Scheduler:
    """FIFO admission with whole-request page reservation, and chunked prefill under a per-step token budget."""

    def __init__(self, *, num_pages: int, page_size: int, max_slots: int, max_step_tokens: int, max_context: int,
                 clock: Callable[[], float] = time.perf_counter):
        sizes = dict(num_pages=num_pages, page_size=page_size, max_slots=max_slots,
                     max_step_tokens=max_step_tokens, max_context=max_context)
        for name, value in sizes.items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if max_step_tokens < max_slots:
            raise ValueError(f"max_step_tokens ({max_step_tokens}) must be >= max_slots ({max_slots}), "
                             "so that every running request's decode fits in one step")
        self.num_pages, self.page_size, self.max_slots = num_pages, page_size, max_slots
        self.max_step_tokens, self.max_context, self.clock = max_step_tokens, max_context, clock
        self._free_slots = list(range(max_slots))  # heaps: the lowest free number goes out first
        self._free_pages = list(range(num_pages))
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []  # in admission order
        self._in_flight: Step | None = None
        self._aborting: set[Request] = set()  # aborted while in the step in flight: finished at its complete()

    def pages_needed(self, request: Request) -> int:
        """Pages reserved for `request`: room for its prompt and all max_tokens outputs."""
        return self._pages_for(len(request.prompt) + request.max_tokens)

    def _pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def capacity(self, prompt_len: int, max_tokens: int) -> int:
        """How many requests of this shape can run at once, limited by the page pool and the slots."""
        if prompt_len < 1 or max_tokens < 1 or prompt_len + max_tokens > self.max_context:
            return 0
        return min(self.max_slots, self.num_pages // self._pages_for(prompt_len + max_tokens))

    @property
    def free_pages(self) -> int:
        return len(self._free_pages)

    @property
    def running(self) -> tuple[Request, ...]:
        return tuple(self._running)

    @property
    def waiting(self) -> tuple[Request, ...]:
        return tuple(self._waiting)

    @property
    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    def submit(self, request: Request) -> None:
        """Queue `request`; ValueError if it is malformed or could never run here."""
        length = len(request.prompt) + request.max_tokens
        if not request.prompt:
            raise ValueError(f"request {request.id!r}: the prompt is empty")
        if request.max_tokens < 1:
            raise ValueError(f"request {request.id!r}: max_tokens must be >= 1, got {request.max_tokens}")
        if length > self.max_context:
            raise ValueError(f"request {request.id!r}: prompt ({len(request.prompt)}) + max_tokens "
                             f"({request.max_tokens}) = {length} tokens exceeds max_context ({self.max_context})")
        if self.pages_needed(request) > self.num_pages:
            raise ValueError(f"request {request.id!r} needs {self.pages_needed(request)} pages of {self.page_size} "
                             f"tokens, more than the whole pool ({self.num_pages})")
        # ids key the tokens passed to complete(), so they must be unique among the requests held here
        if any(held.id == request.id for held in (*self._waiting, *self._running)):
            raise ValueError(f"request {request.id!r}: a request with this id is already waiting or running")
        if request.arrival is None:
            request.arrival = self.clock()
        self._waiting.append(request)

    def schedule(self) -> Step | None:
        """Admit what fits, then build the next step; None when there is nothing to run."""
        if self._in_flight is not None:
            raise RuntimeError("schedule() called again before complete() of the step in flight")
        self._admit()
        work = [Work(r, r.computed, [r.output[-1]], emits=True) for r in self._running if not r.in_prefill]
        budget = self.max_step_tokens - len(work)
        for request in self._running:
            if budget == 0:
                break
            if request.in_prefill:
                chunk = request.prompt[request.computed:request.computed + budget]
                emits = request.computed + len(chunk) == len(request.prompt)
                work.append(Work(request, request.computed, chunk, emits))
                budget -= len(chunk)
        if not work:
            return None
        self._in_flight = Step(work)
        return self._in_flight

    def abort(self, request_id: str) -> Request | None:
        """End a request no longer wanted (its client went away), freeing its slot and pages for others; None if no
        request with this id is waiting or running. One in the step in flight is finished by that step's complete(),
        its token dropped: until then the engine may be writing its pages."""
        for request in self._waiting:
            if request.id == request_id:
                self._waiting.remove(request)
                self._finish(request, "abort", self.clock())
                return request
        request = next((r for r in self._running if r.id == request_id), None)
        if request is None:
            return None
        if self._in_flight is not None and any(w.request is request for w in self._in_flight.work):
            self._aborting.add(request)
        else:
            self._finish(request, "abort", self.clock())
        return request

    def _admit(self) -> None:
        while self._waiting and self._free_slots:
            head = self._waiting[0]
            pages = self.pages_needed(head)
            if pages > len(self._free_pages):
                return  # FIFO: nothing behind the head may take the pages it is waiting for
            self._waiting.popleft()
            head.slot = heapq.heappop(self._free_slots)
            head.pages = [heapq.heappop(self._free_pages) for _ in range(pages)]
            self._running.append(head)

    def complete(self, step: Step, next_tokens: Mapping[str, int | Sequence[int]]) -> list[Request]:
        """Record `step` as run and its sampled tokens; return the requests it finished, their slot and pages freed.
        A request aborted during the step is among them, and its token, still required here, is dropped.

        A decode may be given several tokens (speculative decoding: the drafts the target accepted, then its own
        token): the accepted drafts were fed at the positions after the decode's token, so they count as computed
        too; tokens past a stop token or max_tokens are dropped."""
        if step is not self._in_flight:
            raise ValueError("complete() got a step that is not the one in flight")
        emitting = {w.request.id for w in step.work if w.emits}
        missing, extra = emitting - next_tokens.keys(), next_tokens.keys() - emitting
        if missing or extra:  # checked before any state changes, so a bad call leaves the scheduler as it was
            raise ValueError(f"next_tokens must cover exactly the emitting requests: missing {sorted(missing)}, "
                             f"given for non-emitting {sorted(extra)}")
        given = {work.request.id: _token_list(next_tokens[work.request.id], work) for work in step.work if work.emits}
        self._in_flight, aborting, self._aborting = None, self._aborting, set()
        now = self.clock()
        finished = []
        for work in step.work:
            request = work.request
            if request in aborting:
                self._finish(request, "abort", now)
                finished.append(request)
                continue
            if not work.emits:
                request.computed += len(work.tokens)
                continue
            tokens = given[request.id]
            request.computed += len(work.tokens) + len(tokens) - 1
            for token in tokens:
                request.output.append(token)
                request.token_times.append(now)
                if token in request.stop_token_ids:
                    self._finish(request, "stop", now)
                elif len(request.output) == request.max_tokens:
                    self._finish(request, "length", now)
                else:
                    continue
                finished.append(request)
                break
        return finished

    def _finish(self, request: Request, reason: str, now: float) -> None:
        """Free the request's slot and pages, then mark it finished: whoever sees it finished, on any thread, sees
        them free."""
        if request.slot is not None:  # running; a waiting request holds none
            self._running.remove(request)
            heapq.heappush(self._free_slots, request.slot)
            for page in request.pages:
                heapq.heappush(self._free_pages, page)
            request.slot, request.pages = None, []
        request.finish_reason, request.finish_time = reason, now


def _token_list(value: int | Sequence[int], work: Work) -> list[int]:
    """One emitting work's tokens as a list; ValueError unless one token, or several for a decode."""
    tokens = [value] if isinstance(value, int) else list(value)
    if not tokens or not all(isinstance(t, int) and t >= 0 for t in tokens):
        raise ValueError(f"request {work.request.id!r}: the tokens must be one or more ids >= 0, got {value!r}")
    if len(tokens) > 1 and not work.is_decode:
        raise ValueError(f"request {work.request.id!r}: a prompt chunk emits one token, got {len(tokens)}")
    return tokens


@dataclass(frozen=True)
class RequestMetrics:
    """Latency of one request that ran to its end, in the scheduler clock's units."""

    ttft: float  # time to first token: first output's time - arrival
    tpot: float | None  # time per output token: mean gap between outputs after the first; None for one output
    output_tokens: int

    @classmethod
    def of(cls, request: Request) -> RequestMetrics:
        if not request.finished or request.arrival is None:
            raise ValueError(f"request {request.id!r} has not finished")
        if request.finish_reason == "abort":  # cut short, perhaps before any token: not a served request's latency
            raise ValueError(f"request {request.id!r} was aborted")
        times = request.token_times
        tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
        return cls(ttft=times[0] - request.arrival, tpot=tpot, output_tokens=len(times))


def percentile(values: Iterable[float], p: float) -> float | None:
    """Nearest-rank percentile: the smallest value with at least p% of the values at or below it; None if empty."""
    ordered = sorted(values)
    if not ordered:
        return None
    rank = max(1, math.ceil(p * len(ordered) / 100))  # p * n first: exact for integer p
    return ordered[rank - 1]


def summary(requests: Iterable[Request]) -> dict[str, float | int | None]:
    """p50/p99 TTFT and TPOT, total output tokens and throughput (output tokens / (last finish - first arrival)) of the
    requests that ran to their end; aborted ones are only counted, as serving benchmarks count failed requests."""
    given = list(requests)
    finished = [r for r in given if r.finish_reason != "abort"]
    metrics = [RequestMetrics.of(r) for r in finished]
    ttfts = [m.ttft for m in metrics]
    tpots = [m.tpot for m in metrics if m.tpot is not None]
    output_tokens = sum(m.output_tokens for m in metrics)
    duration = (max(r.finish_time for r in finished) - min(r.arrival for r in finished)) if finished else 0.0
    return {
        "requests": len(metrics),
        "aborted": len(given) - len(finished),
        "output_tokens": output_tokens,
        "duration": duration,
        "throughput": output_tokens / duration if duration > 0 else None,  # None: no elapsed time to divide by
        "ttft_p50": percentile(ttfts, 50),
        "ttft_p99": percentile(ttfts, 99),
        "tpot_p50": percentile(tpots, 50),
        "tpot_p99": percentile(tpots, 99),
    }

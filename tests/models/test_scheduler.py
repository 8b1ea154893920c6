"""The continuous-batching scheduler: admission, chunked prefill, finishing, aborting, validation, metrics (scripted
clock)."""

from __future__ import annotations

import random

import pytest

from kforge.models.scheduler import Request, RequestMetrics, Scheduler, Step, percentile, summary


class ScriptedClock:
    """A clock that moves only when the test says so."""

    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def make(clock=None, **sizes) -> Scheduler:
    config = dict(num_pages=64, page_size=4, max_slots=4, max_step_tokens=64, max_context=128)
    return Scheduler(**{**config, **sizes}, clock=clock or ScriptedClock())


def req(rid: str, prompt_len: int, max_tokens: int, stop=(), first_token: int = 1) -> Request:
    return Request(rid, list(range(first_token, first_token + prompt_len)), max_tokens, frozenset(stop))


def step_tokens(step: Step, token: int = 0) -> dict[str, int]:
    """The same sampled token for every emitting work of `step`."""
    return {w.request.id: token for w in step.work if w.emits}


def drain(sched: Scheduler, token: int = 0) -> list[Request]:
    finished = []
    while (step := sched.schedule()) is not None:
        finished += sched.complete(step, step_tokens(step, token))
    return finished


def test_fifo_admission_reserves_the_whole_request_and_a_later_small_one_does_not_jump():
    sched = make(num_pages=4, page_size=4)
    big, blocked, small = req("big", 6, 6), req("blocked", 4, 4), req("small", 2, 2)
    for r in (big, blocked, small):
        sched.submit(r)
    assert [sched.pages_needed(r) for r in (big, blocked, small)] == [3, 2, 1]

    step = sched.schedule()
    # big holds 3 of 4 pages; blocked needs 2 and waits; small would fit the last page but must not jump it
    assert [w.request.id for w in step.work] == ["big"]
    assert sched.running == (big,) and sched.waiting == (blocked, small)
    assert sched.free_pages == 1 and big.pages == [0, 1, 2]

    sched.complete(step, {"big": 0})
    while sched.running == (big,):  # nothing is admitted until big finishes and gives its pages back
        assert sched.waiting == (blocked, small)
        step = sched.schedule()
        sched.complete(step, step_tokens(step))
    assert big.finish_reason == "length" and big.pages == [] and big.slot is None

    step = sched.schedule()
    assert [w.request.id for w in step.work] == ["blocked", "small"]
    assert blocked.pages == [0, 1] and small.pages == [2] and sched.free_pages == 1
    sched.complete(step, step_tokens(step))
    drain(sched)
    assert sched.free_pages == 4 and not sched.has_work


def test_a_free_slot_is_needed_as_well_as_pages_and_slots_are_reused_lowest_first():
    sched = make(max_slots=2)
    a, b, c = req("a", 3, 1), req("b", 3, 2), req("c", 3, 1)
    for r in (a, b, c):
        sched.submit(r)
    step = sched.schedule()
    assert (a.slot, b.slot) == (0, 1) and sched.waiting == (c,)
    assert sched.complete(step, step_tokens(step)) == [a]  # a wanted one token; b goes on
    assert a.slot is None

    step = sched.schedule()
    assert c.slot == 0 and b.slot == 1  # a's row went back to the free list and was handed out again
    assert [(w.request.id, w.start) for w in step.work] == [("b", 3), ("c", 0)]
    assert sched.complete(step, step_tokens(step)) == [b, c]
    assert sched.schedule() is None and sched.free_pages == 64


def test_chunked_prefill_splits_a_long_prompt_with_exact_starts_and_emits_only_at_its_end():
    sched = make(max_step_tokens=4)
    long = req("long", 10, 2)
    sched.submit(long)
    chunks = []
    for _ in range(3):
        step = sched.schedule()
        (work,) = step.work
        chunks.append((work.start, work.tokens, work.emits))
        sched.complete(step, step_tokens(step, 42))
    assert chunks == [(0, [1, 2, 3, 4], False), (4, [5, 6, 7, 8], False), (8, [9, 10], True)]
    assert long.computed == 10 and long.output == [42]

    step = sched.schedule()  # the decode feeds the token just sampled, at the position after the prompt
    (work,) = step.work
    assert (work.start, work.tokens, work.emits, work.is_decode) == (10, [42], True, True)


def test_decodes_come_first_and_prefill_gets_only_the_rest_of_the_budget():
    sched = make(max_step_tokens=4, max_slots=4)
    short, long = req("short", 2, 5), req("long", 10, 1)
    sched.submit(short)
    sched.submit(long)

    step = sched.schedule()  # two prompts share the step, in admission order
    assert [(w.request.id, w.start, len(w.tokens), w.emits) for w in step.work] == [
        ("short", 0, 2, True), ("long", 0, 2, False)]
    sched.complete(step, step_tokens(step))

    step = sched.schedule()
    assert [(w.request.id, w.start, len(w.tokens)) for w in step.decodes] == [("short", 2, 1)]
    assert [(w.request.id, w.start, len(w.tokens)) for w in step.prefills] == [("long", 2, 3)]
    assert step.work == step.decodes + step.prefills and step.num_tokens == 4
    sched.complete(step, step_tokens(step))

    sched.submit(req("late", 3, 1))  # arrives while long is still in prefill: it queues behind long's chunks
    step = sched.schedule()
    assert [(w.request.id, w.start, len(w.tokens)) for w in step.work] == [("short", 3, 1), ("long", 5, 3)]


def test_the_constructor_requires_room_for_every_decode_in_a_step():
    with pytest.raises(ValueError, match="max_step_tokens"):
        make(max_slots=8, max_step_tokens=7)
    with pytest.raises(ValueError, match="page_size must be >= 1"):
        make(page_size=0)


def test_a_stop_token_finishes_with_stop_and_is_kept_and_max_tokens_with_length():
    sched = make()
    stops, runs_out = req("stops", 3, 10, stop={7}), req("runs_out", 3, 3, stop={7})
    sched.submit(stops)
    sched.submit(runs_out)
    sampled = iter([{"stops": 5, "runs_out": 5}, {"stops": 7, "runs_out": 6}, {"runs_out": 8}])
    finished = []
    while (step := sched.schedule()) is not None:
        finished.append([r.id for r in sched.complete(step, next(sampled))])
    assert finished == [[], ["stops"], ["runs_out"]]
    assert (stops.output, stops.finish_reason) == ([5, 7], "stop")
    assert (runs_out.output, runs_out.finish_reason) == ([5, 6, 8], "length")


def test_a_decode_given_several_tokens_counts_the_accepted_drafts_as_computed_and_stops_inside_the_list():
    # speculative decoding: the decode fed y, the target accepted drafts d1, d2 and added t
    sched = make()
    spec, stops = req("spec", 3, 10), req("stops", 3, 10, stop={7})
    sched.submit(spec)
    sched.submit(stops)
    sched.complete(sched.schedule(), {"spec": 5, "stops": 5})  # the prompts, one token each
    step = sched.schedule()
    assert [(w.start, w.tokens) for w in step.work] == [(3, [5]), (3, [5])]
    finished = sched.complete(step, {"spec": [11, 12, 13], "stops": [6, 7, 8]})
    assert (spec.output, spec.computed) == ([5, 11, 12, 13], 6), "y, d1 and d2 are in the cache; t is next"
    assert finished == [stops] and (stops.output, stops.finish_reason) == ([5, 6, 7], "stop"), "8 came after the stop"
    step = sched.schedule()
    assert [(w.start, w.tokens) for w in step.work] == [(6, [13])]
    assert sched.complete(step, {"spec": list(range(20, 30))}) == [spec]
    assert spec.output == [5, 11, 12, 13, *range(20, 26)] and spec.finish_reason == "length"


def test_several_tokens_for_a_prompt_chunk_or_none_at_all_are_refused_and_change_nothing():
    sched = make()
    sched.submit(req("a", 3, 5))
    step = sched.schedule()
    with pytest.raises(ValueError, match="a prompt chunk emits one token, got 2"):
        sched.complete(step, {"a": [1, 2]})
    with pytest.raises(ValueError, match="one or more ids >= 0"):
        sched.complete(step, {"a": []})
    with pytest.raises(ValueError, match="one or more ids >= 0"):
        sched.complete(step, {"a": -1})
    assert sched.complete(step, {"a": [4]}) == [] and sched.running[0].output == [4]


def test_complete_rejects_a_missing_or_an_unexpected_token_and_changes_nothing():
    sched = make(max_step_tokens=4)
    short, long = req("short", 2, 3), req("long", 8, 3)
    sched.submit(short)
    sched.submit(long)
    step = sched.schedule()  # short emits, long's first chunk does not
    with pytest.raises(ValueError, match=r"missing \['short'\]"):
        sched.complete(step, {})
    with pytest.raises(ValueError, match=r"non-emitting \['long'\]"):
        sched.complete(step, {"short": 1, "long": 1})
    assert (short.computed, long.computed, short.output) == (0, 0, [])
    assert sched.complete(step, {"short": 1}) == [] and (short.computed, long.computed) == (2, 2)


def test_one_step_in_flight_at_a_time():
    sched = make()
    sched.submit(req("a", 2, 2))
    step = sched.schedule()
    with pytest.raises(RuntimeError, match="before complete"):
        sched.schedule()
    with pytest.raises(ValueError, match="not the one in flight"):
        sched.complete(Step(list(step.work)), step_tokens(step))
    sched.complete(step, step_tokens(step))
    with pytest.raises(ValueError, match="not the one in flight"):
        sched.complete(step, step_tokens(step))  # the same step twice would feed its tokens twice


@pytest.mark.parametrize("request_, message", [
    (Request("empty", [], 4), "prompt is empty"),
    (Request("zero", [1, 2], 0), "max_tokens must be >= 1"),
    (Request("long", [1] * 100, 29), "129 tokens exceeds max_context"),
    (Request("huge", [1] * 60, 8), "needs 17 pages of 4 tokens, more than the whole pool"),
    (Request("dup", [1], 1), "already waiting or running"),
])
def test_submit_rejects_what_could_never_run(request_, message):
    sched = make(num_pages=16)
    sched.submit(Request("dup", [5, 6], 2))
    with pytest.raises(ValueError, match=message):
        sched.submit(request_)
    assert [r.id for r in sched.waiting] == ["dup"]


def test_an_id_may_come_back_once_its_request_has_finished_and_arrival_defaults_to_the_clock():
    clock = ScriptedClock(5.0)
    sched = make(clock)
    first = req("x", 2, 1)
    sched.submit(first)
    drain(sched)
    again = Request("x", [3], 1, arrival=1.5)
    sched.submit(again)
    assert (first.arrival, again.arrival) == (5.0, 1.5)


def model(context: list[int], vocab: int = 50) -> int:
    """A fake model whose next token depends on every token of the context, in order."""
    return sum((i + 1) * t for i, t in enumerate(context)) % vocab


def generate_alone(request: Request) -> list[int]:
    context, output = list(request.prompt), []
    while len(output) < request.max_tokens:
        output.append(model(context))
        if output[-1] in request.stop_token_ids:
            break
        context.append(output[-1])
    return output


class FakeEngine:
    """A KV cache of token rows, one per slot: checks the scheduler feeds each position once, in order."""

    def __init__(self, page_size: int):
        self.page_size, self.rows = page_size, {}

    def run(self, step: Step) -> dict[str, int]:
        sampled = {}
        for work in step.work:
            request = work.request
            if work.start == 0:  # a new occupant of the slot
                self.rows[request.slot] = []
            row = self.rows[request.slot]
            assert work.start == len(row) == request.computed
            assert work.start + len(work.tokens) <= len(request.pages) * self.page_size
            row.extend(work.tokens)
            if work.emits:
                assert row == request.prompt + request.output
                sampled[request.id] = model(row)
        return sampled


def test_end_to_end_requests_join_and_leave_mid_batch_and_each_generates_what_it_would_alone():
    rng = random.Random(0)
    sizes = dict(num_pages=12, page_size=4, max_slots=3, max_step_tokens=8, max_context=40)
    sched, engine = make(**sizes), FakeEngine(page_size=4)
    arrivals = sorted((rng.randrange(30), i) for i in range(14))
    requests = [Request(f"r{i}", [rng.randrange(50) for _ in range(rng.randint(1, 20))], rng.randint(1, 12),
                        frozenset({rng.randrange(50)})) for i in range(14)]
    submitted, admitted, finished, mixed_steps, left_mid_batch = [], [], [], 0, 0
    step_no = 0
    while len(submitted) < len(requests) or sched.has_work:
        assert step_no < 1000, "the run stopped making progress"
        for _, i in (a for a in arrivals if a[0] == step_no):
            sched.submit(requests[i])
            submitted.append(requests[i])
        step_no += 1
        step = sched.schedule()
        if step is None:
            continue
        slots = [r.slot for r in sched.running]
        assert len(set(slots)) == len(slots) <= sizes["max_slots"]
        assert sched.free_pages + sum(len(r.pages) for r in sched.running) == sizes["num_pages"]
        assert step.num_tokens <= sizes["max_step_tokens"] and step.work == step.decodes + step.prefills
        admitted += [w.request for w in step.work if w.start == 0]
        mixed_steps += bool(step.decodes and step.prefills)
        done = sched.complete(step, engine.run(step))
        left_mid_batch += bool(done and sched.running)
        finished += done
    assert admitted == submitted  # FIFO
    assert sorted(r.id for r in finished) == sorted(r.id for r in requests)
    assert mixed_steps > 0 and left_mid_batch > 0  # the run did exercise joining and leaving a live batch
    for r in requests:
        assert r.output == generate_alone(r), r.id
        expected = "stop" if r.output[-1] in r.stop_token_ids else "length"
        assert r.finish_reason == expected and len(r.token_times) == len(r.output)
    assert sched.free_pages == sizes["num_pages"]


def test_abort_takes_a_waiting_request_off_the_queue_even_while_a_step_is_in_flight():
    clock = ScriptedClock(3.0)
    sched = make(clock, max_slots=1)
    running, waiting = req("running", 2, 2), req("waiting", 2, 2)
    sched.submit(running)
    sched.submit(waiting)
    step = sched.schedule()
    assert sched.abort("waiting") is waiting and sched.waiting == ()
    assert (waiting.finish_reason, waiting.finish_time, waiting.slot, waiting.output) == ("abort", 3.0, None, [])
    assert sched.complete(step, step_tokens(step)) == [] and drain(sched) == [running]


def test_abort_between_steps_frees_the_slot_and_pages_at_once_and_the_next_request_takes_them():
    sizes = dict(num_pages=5, page_size=4, max_slots=2, max_step_tokens=8, max_context=16)
    sched, engine = make(**sizes), FakeEngine(page_size=4)
    doomed, other, later = (Request(rid, [3, 1, 4, 1, 5][:n], 6, frozenset()) for rid, n in
                            (("doomed", 5), ("other", 2), ("later", 3)))
    for r in (doomed, other, later):
        sched.submit(r)
    for _ in range(2):  # both running, with 3 + 2 of the 5 pages: later waits for a slot and pages
        step = sched.schedule()
        sched.complete(step, engine.run(step))
    assert (doomed.slot, doomed.pages, other.slot, sched.waiting) == (0, [0, 1, 2], 1, (later,))

    assert sched.abort("doomed") is doomed
    assert (doomed.finish_reason, doomed.slot, doomed.pages, len(doomed.output)) == ("abort", None, [], 2)
    assert sched.running == (other,) and sched.free_pages == 3

    step = sched.schedule()  # later gets doomed's slot and pages, as a new occupant of the row
    assert (later.slot, later.pages) == (0, [0, 1, 2])
    assert [(w.request.id, w.start) for w in step.work] == [("other", 3), ("later", 0)]
    finished = sched.complete(step, engine.run(step))
    while (step := sched.schedule()) is not None:
        finished += sched.complete(step, engine.run(step))
    assert finished == [other, later] and doomed.output == generate_alone(doomed)[:2]
    assert (other.output, later.output) == (generate_alone(other), generate_alone(later))
    assert sched.free_pages == 5


def test_abort_of_a_request_in_the_step_in_flight_takes_effect_at_complete_and_drops_its_token():
    clock = ScriptedClock(0.0)
    sched = make(clock, max_step_tokens=4, max_slots=3)
    decoding, chunked, idle = req("decoding", 2, 5, stop={9}), req("chunked", 10, 2), req("idle", 3, 2)
    for r in (decoding, chunked, idle):
        sched.submit(r)
    step = sched.schedule()  # decoding's prompt and 2 of chunked's; idle is admitted but gets no room in this step
    assert [w.request.id for w in step.work] == ["decoding", "chunked"] and idle.slot is not None
    free = sched.free_pages

    assert sched.abort("idle") is idle and idle.finish_reason == "abort"  # not in the step: freed at once
    assert sched.abort("decoding") is decoding and sched.abort("chunked") is chunked
    assert not decoding.finished and decoding.pages and sched.free_pages == free + sched.pages_needed(idle)
    assert sched.abort("decoding") is decoding  # still running until complete(): asking again changes nothing
    with pytest.raises(ValueError, match=r"missing \['decoding'\]"):
        sched.complete(step, {})  # the engine ran the pass: the aborted request's token is still owed

    clock.t = 2.0
    assert sched.complete(step, {"decoding": 9}) == [decoding, chunked]  # 9, a stop token, would have finished it
    assert [(r.finish_reason, r.finish_time, r.output, r.slot, r.pages) for r in (decoding, chunked)] == [
        ("abort", 2.0, [], None, [])] * 2
    assert not sched.has_work and sched.free_pages == 64 and sched.schedule() is None


def test_abort_of_an_unknown_or_finished_request_is_none():
    sched = make()
    done, gone = req("done", 2, 1), req("gone", 2, 1)
    sched.submit(done)
    sched.submit(gone)
    assert sched.abort("gone") is gone
    assert drain(sched) == [done]
    assert [sched.abort(rid) for rid in ("done", "gone", "never")] == [None] * 3
    assert done.finish_reason == "length"


def test_summary_counts_aborted_requests_apart_and_metrics_refuse_them():
    clock = ScriptedClock(0.0)
    sched = make(clock)
    served, cut, unstarted = req("served", 2, 2), req("cut", 2, 8), req("unstarted", 2, 2)
    for r in (served, cut, unstarted):
        sched.submit(r)
    sched.abort("unstarted")
    for _ in range(2):
        step = sched.schedule()
        clock.t += 1.0
        sched.complete(step, step_tokens(step))
    clock.t = 10.0
    sched.abort("cut")
    assert (served.finish_reason, len(cut.output), unstarted.output) == ("length", 2, [])
    with pytest.raises(ValueError, match="'cut' was aborted"):
        RequestMetrics.of(cut)
    # the aborted requests neither stretch the duration (cut ends at 10) nor add their tokens
    assert summary([served, cut, unstarted]) == {**summary([served]), "aborted": 2}
    assert summary([served])["duration"] == 2.0 and summary([cut])["requests"] == 0


def test_metrics_on_a_scripted_clock():
    clock = ScriptedClock(0.0)
    sched = make(clock, max_step_tokens=4, max_slots=2)
    a, b = req("a", 3, 3), req("b", 6, 2)
    sched.submit(a)
    clock.t = 1.0
    sched.submit(b)
    # steps: a's prompt + 1 of b's; a decode + 3 of b's; a decode + b's last 2; b decode
    for duration in (1.0, 2.0, 4.0, 8.0):
        step = sched.schedule()
        clock.t += duration
        sched.complete(step, step_tokens(step))
    assert sched.schedule() is None
    assert (a.token_times, b.token_times) == ([2.0, 4.0, 8.0], [8.0, 16.0])
    assert RequestMetrics.of(a) == RequestMetrics(ttft=2.0, tpot=3.0, output_tokens=3)
    assert RequestMetrics.of(b) == RequestMetrics(ttft=7.0, tpot=8.0, output_tokens=2)
    assert summary([a, b]) == {"requests": 2, "aborted": 0, "output_tokens": 5, "duration": 16.0, "throughput": 5 / 16,
                               "ttft_p50": 2.0, "ttft_p99": 7.0, "tpot_p50": 3.0, "tpot_p99": 8.0}


def test_a_one_token_request_has_no_tpot_and_an_unfinished_one_no_metrics():
    clock = ScriptedClock(0.0)
    sched = make(clock)
    one = req("one", 2, 1)
    sched.submit(one)
    step = sched.schedule()
    with pytest.raises(ValueError, match="has not finished"):
        RequestMetrics.of(one)
    clock.t = 0.5
    sched.complete(step, step_tokens(step))
    assert RequestMetrics.of(one) == RequestMetrics(ttft=0.5, tpot=None, output_tokens=1)
    assert summary([one])["tpot_p50"] is None and summary([one])["throughput"] == 2.0


def test_percentile_is_nearest_rank():
    values = [float(v) for v in range(10, 0, -1)]
    assert [percentile(values, p) for p in (0, 10, 50, 51, 70, 99, 100)] == [1.0, 1.0, 5.0, 6.0, 7.0, 10.0, 10.0]
    assert percentile([], 50) is None


def test_capacity_is_the_tighter_of_pages_and_slots_and_matches_admission():
    sched = make(num_pages=10, page_size=16, max_slots=8, max_context=256)
    assert sched.capacity(20, 12) == 5  # 32 tokens = 2 pages: the pool allows 5
    assert sched.capacity(1, 1) == 8  # 1 page each: the slots allow 8
    assert sched.capacity(100, 60) == 1 and sched.capacity(100, 61) == 0  # 161 tokens need 11 pages of 10
    assert sched.capacity(200, 57) == 0  # past max_context
    for i in range(7):
        sched.submit(req(f"r{i}", 20, 12))
    sched.schedule()
    assert len(sched.running) == 5 and sched.free_pages == 0

"""The loop over real HTTP: replies replayed by a loopback server, candidates judged in
isolated workers, feedback, lineage, the store and resuming.

Gate 2's speed on a shared CPU proves nothing (tests/conftest.py, scripted_timing): the
judge runs every candidate for real, and only the clocks of the timed calls are scripted,
2x for the correct kernel and 0.5x for every other.
"""

import itertools
import re

import pytest
from conftest import FIXTURES, scripted_timing
from replay_server import ReplayServer, reply_text

from kforge.harness.isolation import StageLimits, evaluate_isolated
from kforge.harness.profile import KernelProfile, ProfileSummary
from kforge.harness.record import read_store
from kforge.machine.client import EndpointClient, ManualClient, Waiting
from kforge.machine.estimators import pass_at_k
from kforge.machine.extract import extract_code
from kforge.machine.loop import AttemptStore, Settings, run_machine, scores
from kforge.machine.prompt import FEEDBACK_PASSED, first_messages, problem_facts

PROBLEM = FIXTURES / "problems" / "add.py"
CORRECT = extract_code(reply_text("correct")).code


@pytest.fixture
def machine(tmp_path, cpu, cpu_ceilings):
    """run(client, **settings) -> (MachineRun, the candidate files judged by this call)."""
    facts = problem_facts(PROBLEM, cpu)
    messages = first_messages(facts, cpu, cpu_ceilings, "triton")
    store = AttemptStore(tmp_path / "machine-add.jsonl")

    def run(client, profile=None, **settings):
        judged = []

        def evaluate(problem, candidate, gpu):
            judged.append(candidate)
            speedup = 2.0 if candidate.read_text() == CORRECT else 0.5
            return evaluate_isolated(problem, candidate, gpu=gpu, device_name=cpu.name, ceilings=cpu_ceilings,
                                     timing=scripted_timing(speedup, budget_s=5.0),  # (1 s: 7-9 rounds, or 5)
                                     limits=StageLimits(load_s=60, gate1_s=60, gate2_s=60))

        settings = Settings(**{"problem": PROBLEM, "backend": "triton", "model": "replay", **settings})
        result = run_machine(settings, client, store, facts=facts, messages=messages, slots=[None],
                             device_name=cpu.name, evaluate=evaluate, profile=profile)
        return result, judged

    run.store = store
    run.messages = messages
    return run


def endpoint(server: ReplayServer) -> EndpointClient:
    return EndpointClient(server.url, "replay", backoff_s=0.01, retries=1)


@pytest.mark.slow
def test_samples_learn_from_feedback_stop_once_passed_and_resume_without_asking_again(machine):
    script = {"s0/t0": ["compile_error"], "s0/t1": ["wrong"], "s0/t2": ["slow"], "s0/t3": ["correct"],
              "s1/t0": ["no_code"], "s1/t1": ["two_model_new"], "s1/t2": ["cheat"], "s1/t3": ["no_code"],
              "s1/t4": ["no_code"]}
    with ReplayServer(script) as server:
        run, judged = machine(endpoint(server), samples=2, turns=5)
        asked = len(server.requests)
        # the same command again: everything is in the store, so nothing is asked or judged
        again, judged_again = machine(endpoint(server), samples=2, turns=5)
    assert again.ran == 0 and judged_again == [] and len(server.requests) == asked
    assert again.run == run.run and again.attempts == run.attempts
    assert len(judged) == 5, "every code block was judged, the replies without one were not"
    by_id = {a["id"].split("/", 1)[1]: a for a in run.attempts}
    s0 = [by_id[f"s0/t{t}"] for t in range(4)]
    s1 = [by_id[f"s1/t{t}"] for t in range(5)]
    assert "s0/t4" not in by_id and not any(r["attempt"].endswith("s0/t4") for r in server.requests), \
        "a sample stops once it passed"
    assert [a["status"] for a in s0] == ["candidate_error", "incorrect", "slower", "passed"]
    assert [a["status"] for a in s1[:2]] + [a["status"] for a in s1[3:]] == ["no_code", "ambiguous_code"] + \
        ["no_code"] * 2
    assert s1[2]["record"] is not None and s1[2]["status"] != "passed"

    # the record is the isolated judge's: its worker was confined, this process ran none of it
    assert all(a["record"]["containment"] is not None for a in s0)
    assert s0[3]["record"]["candidate"]["sha256"] == s0[3]["code_sha256"]

    # lineage: each turn's prompt is the conversation so far, sent as stored
    for chain in (s0, s1):
        assert chain[0]["parent"] is None and chain[0]["prompt"] == machine.messages
        for before, after in itertools.pairwise(chain):
            assert after["parent"] == before["id"]
            assert after["prompt"] == [*before["prompt"], {"role": "assistant", "content": before["reply"]},
                                       {"role": "user", "content": before["feedback"]}]
    sent = {r["attempt"]: r["body"]["messages"] for r in server.requests}
    assert all(sent[a["id"]] == a["prompt"] for a in run.attempts)
    assert all(a["usage"]["completion_tokens"] > 0 and a["model"] == "replay" for a in run.attempts)
    assert all(a["endpoint"] == server.url for a in run.attempts)

    # the feedback carries the error's line, gate 1's statistics, gate 2's verdict, the flags
    compile_error = s0[0]["feedback"]
    assert "fused_add" in compile_error and "line 22, in forward" in compile_error
    wrong = s0[1]["feedback"]
    assert "Gate 1 (correct) failed" in wrong and "max abs error" in wrong
    # a - b for a + b: wrong wherever |2b| exceeds the tolerance, which a few random b near zero do not
    outside = re.search(r"([\d.]+)% of elements outside atol", wrong)
    assert outside and 99 <= float(outside[1]) <= 100, wrong
    assert "decided by the elementwise test" in wrong
    slow = s0[2]["feedback"]
    assert "Gate 1 (correct): passed" in slow and "speedup 0.5" in slow and "Verdict: slower." in slow
    assert "95% interval" in slow and "% of roof" in slow
    assert "Verdict: faster." in s0[3]["feedback"] and s0[3]["feedback"].endswith(FEEDBACK_PASSED)
    assert "no fenced code block" in s1[0]["feedback"]
    assert "2 code blocks define class ModelNew" in s1[1]["feedback"]
    assert {f["code"] for f in s1[2]["static_flags"]} == {"timer", "side_stream"}
    assert "[side_stream]" in s1[2]["feedback"] and "[timer]" in s1[2]["feedback"]
    assert s0[3]["static_flags"] == [] and "Static checks" not in s0[3]["feedback"]

    reading = read_store(machine.store.path)
    assert not reading.rejected and len(reading.records) == 9 and run.ran == 9

    found = scores(run.attempts)
    assert found.samples == 2 and found.fast == 1
    assert found.pass_at[1] == pass_at_k(2, found.correct, 1) and found.fast_1_at[2] == 1.0


@pytest.mark.slow
def test_attempts_past_gate_1_are_profiled_and_the_profile_joins_their_feedback(machine):
    profiled = []

    def profile(problem, candidate, gpu):  # a stand-in for Nsight Compute: no GPU here
        profiled.append(candidate.read_text())
        if len(profiled) == 1:
            return "the profiling run failed (exit 1): no counters"
        return ProfileSummary([KernelProfile("add_kernel", 0.02, 96_000.0, 35.0, 10.0, None, {"long scoreboard": 3.0})])

    script = {"s0/t0": ["wrong"], "s0/t1": ["slow"], "s0/t2": ["correct"]}
    with ReplayServer(script) as server:
        run, _ = machine(endpoint(server), profile=profile, turns=3)
    wrong, slow, correct = sorted(run.attempts, key=lambda a: a["turn"])
    assert [a["status"] for a in (wrong, slow, correct)] == ["incorrect", "slower", "passed"]
    assert len(profiled) == 2 and profiled[1] == CORRECT, "gate 1's failures are not profiled"
    assert wrong["profile"] is None and "Profile" not in wrong["feedback"]
    assert slow["profile"] == "the profiling run failed (exit 1): no counters"
    assert "Profile: none (the profiling run failed (exit 1): no counters)." in slow["feedback"]
    assert correct["profile"]["kernels"][0]["name"] == "add_kernel"
    assert "- add_kernel: 0.02 ms (100%); DRAM 35%, SM 10% of peak; warps wait on long scoreboard (3)" in \
        correct["feedback"]


def test_a_failed_request_is_recorded_asked_again_on_resume_and_force_asks_everything(machine):
    script = {"s0/t0": ["no_code", "no_code"], "s1/t0": [503, 503, "two_model_new", "no_code"]}
    with ReplayServer(script) as server:
        first, _ = machine(endpoint(server), samples=2, turns=1)
        asked = len(server.requests)
        second, _ = machine(endpoint(server), samples=2, turns=1)
        asked_again = [r["attempt"].split("/", 1)[1] for r in server.requests[asked:]]
        forced, _ = machine(endpoint(server), samples=2, turns=1, force=True)
    assert [a["status"] for a in first.attempts] == ["no_code", "request_failed"]
    failed = first.attempts[1]
    assert failed["reply"] is None and "HTTP 503" in failed["reason"] and failed["usage"] is None
    assert len(first.failures) == 1 and "HTTP 503" in first.failures[0]
    assert scores(first.attempts).samples == 1, "a failed request is no sample of the model's"

    assert asked_again == ["s1/t0"], "only the failed request is asked again"
    assert second.ran == 1 and [a["status"] for a in second.attempts] == ["no_code", "ambiguous_code"]

    assert forced.ran == 2 and [a["status"] for a in forced.attempts] == ["no_code", "no_code"]
    reading = read_store(machine.store.path)
    assert not reading.rejected and len(reading.records) == 5, "appended, never rewritten"


def test_more_samples_extend_the_run_and_other_settings_start_another(machine):
    with ReplayServer({"s0/t0": ["no_code", "no_code"], "s1/t0": ["no_code"]}) as server:
        one, _ = machine(endpoint(server), samples=1, turns=1)
        two, _ = machine(endpoint(server), samples=2, turns=1)
        other, _ = machine(endpoint(server), samples=1, turns=1, temperature=0.1)
    assert two.run == one.run and two.ran == 1 and len(two.attempts) == 2
    assert other.run != one.run and other.ran == 1


def test_manual_mode_waits_for_each_reply_and_picks_up_where_it_stopped(machine, tmp_path):
    client = ManualClient(tmp_path / "replies")
    first, _ = machine(client, turns=2)
    assert first.ran == 0 and first.attempts == [] and len(first.waiting) == 1
    waiting = first.waiting[0]
    assert isinstance(waiting, Waiting) and waiting.prompt.is_file() and not waiting.reply.exists()
    assert "## The reference: add.py" in waiting.prompt.read_text()

    waiting.reply.write_text(reply_text("no_code"))
    second, _ = machine(client, turns=2)
    assert second.ran == 1 and [a["status"] for a in second.attempts] == ["no_code"]
    assert second.attempts[0]["endpoint"] == "manual" and second.attempts[0]["usage"] is None
    (turn_1,) = second.waiting
    assert turn_1.prompt.name.endswith("-s0-t1.prompt.md")
    assert "no fenced code block" in turn_1.prompt.read_text(), "the next prompt carries the feedback"

    third, _ = machine(client, turns=2)
    assert third.ran == 0 and len(third.waiting) == 1, "the store's attempt is not asked again"

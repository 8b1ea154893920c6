"""The clients: an OpenAI-compatible endpoint over real HTTP (retries, timeouts, errors), and manual mode."""

import socket

import pytest
from replay_server import ReplayServer, reply_text

from kforge.machine.client import EndpointClient, ManualClient, RequestFailed, Waiting

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "write ModelNew"}]


def client_for(url: str, **kwargs) -> EndpointClient:
    kwargs.setdefault("backoff_s", 0.01)
    return EndpointClient(url, "replay-model", **kwargs)


def test_a_reply_comes_back_with_its_usage_and_the_request_carries_the_settings():
    with ReplayServer({"s0/t0": ["correct"]}) as server:
        reply = client_for(server.url, temperature=0.3, max_tokens=123).complete(MESSAGES, "run/s0/t0")
    assert reply.text == reply_text("correct")
    assert reply.usage["completion_tokens"] > 0 and reply.usage["requests"] == 1
    assert reply.usage["finish_reason"] == "stop"
    (request,) = server.requests
    assert request["attempt"] == "run/s0/t0"
    assert request["body"]["messages"] == MESSAGES and request["body"]["model"] == "replay-model"
    assert request["body"]["temperature"] == 0.3 and request["body"]["max_tokens"] == 123


def test_http_500_and_429_are_retried_then_the_reply_counts():
    with ReplayServer({"s0/t0": [500, 429, "no_code"]}) as server:
        reply = client_for(server.url).complete(MESSAGES, "run/s0/t0")
    assert reply.text == reply_text("no_code") and reply.usage["requests"] == 3
    assert [r["answer"] for r in server.requests] == [500, 429, "no_code"]


def test_a_timeout_is_retried():
    with ReplayServer({"s0/t0": [("sleep", 5.0, "no_code"), "no_code"]}) as server:
        reply = client_for(server.url, request_timeout=2.0).complete(MESSAGES, "run/s0/t0")
    assert reply.text == reply_text("no_code") and reply.usage["requests"] == 2


def test_retries_are_bounded_and_the_failure_says_why():
    failed = pytest.raises(RequestFailed, match=r"HTTP 503: scripted HTTP 503 \(after 3 requests\)")
    with ReplayServer({"s0/t0": [503, 503, 503]}) as server, failed:
        client_for(server.url, retries=2).complete(MESSAGES, "run/s0/t0")
    assert len(server.requests) == 3


def test_a_client_error_is_not_retried():
    with ReplayServer({"s0/t0": [404, "correct"]}) as server, pytest.raises(RequestFailed, match="HTTP 404"):
        client_for(server.url).complete(MESSAGES, "run/s0/t0")
    assert len(server.requests) == 1


def test_an_unreachable_endpoint_fails_at_once_in_one_line():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RequestFailed) as caught:
        client_for(f"http://127.0.0.1:{port}/v1").complete(MESSAGES, "run/s0/t0")
    assert caught.value.reason.startswith(f"cannot reach http://127.0.0.1:{port}/v1")
    assert "\n" not in caught.value.reason


def test_a_missing_key_is_sent_as_empty_for_local_servers(monkeypatch):
    monkeypatch.delenv("KFORGE_TEST_NO_KEY", raising=False)
    assert client_for("http://127.0.0.1:1/v1", api_key_env="KFORGE_TEST_NO_KEY").client.api_key == "EMPTY"
    monkeypatch.setenv("KFORGE_TEST_KEY", "sk-test")
    assert client_for("http://127.0.0.1:1/v1", api_key_env="KFORGE_TEST_KEY").client.api_key == "sk-test"


def test_manual_mode_writes_the_prompt_waits_then_reads_the_reply(tmp_path):
    client = ManualClient(tmp_path / "replies")
    with pytest.raises(Waiting) as caught:
        client.complete(MESSAGES, "run/s0/t1")
    prompt, reply = caught.value.prompt, caught.value.reply
    assert prompt == tmp_path / "replies" / "run-s0-t1.prompt.md" and reply.name == "run-s0-t1.reply.md"
    assert "write ModelNew" in prompt.read_text() and "<!-- user -->" in prompt.read_text()
    reply.write_text("  \n")  # an empty file is not a reply yet
    with pytest.raises(Waiting):
        client.complete(MESSAGES, "run/s0/t1")
    reply.write_text(reply_text("correct"))
    answer = client.complete(MESSAGES, "run/s0/t1")
    assert answer.text == reply_text("correct") and answer.usage is None

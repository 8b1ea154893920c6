"""`kforge serve`'s server through the official openai client, on the tiny checkpoint with a WordLevel tokenizer
(CPU, fp32): the same tokens and text as the Engine alone, streamed or not, one request or several at once, and a
400 in OpenAI's shape for what cannot be served, after which the server goes on serving."""

from __future__ import annotations

import http.client
import json
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kforge.models.engine import Engine
from kforge.models.llama import from_pretrained
from kforge.models.sampling import SamplingParams
from kforge.models.chat import load_chat_template, messages_of, plain_transcript
from kforge.models.server import Server, TextStream

openai = pytest.importorskip("openai")

MAX_CONTEXT = 64
PROMPT = "w1 w17 w99 w3"


@pytest.fixture(scope="module")
def folder(checkpoint, tmp_path_factory):
    """The tiny checkpoint with tokenizer.json: token i is the word w{i}."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path_factory.mktemp("tiny-with-tokenizer")
    shutil.copytree(checkpoint[0], folder, dirs_exist_ok=True)
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(256)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def engine_on(folder, **sizes) -> Engine:
    model, tokenizer = from_pretrained(folder, dtype=torch.float32)
    return Engine(model, tokenizer=tokenizer, page_size=8, max_context=MAX_CONTEXT, **sizes)


@pytest.fixture(scope="module")
def server(folder):
    server = Server(engine_on(folder, max_slots=4), model_id="tiny-test", port=0)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def alone(folder):
    """The tokens the Engine generates greedily for a prompt on its own (its own copy of the model)."""
    engine = engine_on(folder, max_slots=1)

    def generate(prompt: str | list[int], max_tokens: int) -> list[int]:
        return engine.generate([prompt], SamplingParams(max_tokens=max_tokens))[0]

    generate.tokenizer = engine.tokenizer
    return generate


def text_of(tokens: list[int], finish_reason: str) -> str:
    """The WordLevel text of the tokens, a stop token left out."""
    return " ".join(f"w{t}" for t in (tokens[:-1] if finish_reason == "stop" else tokens))


def test_a_character_split_over_tokens_is_sent_whole():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    byte_tokens = Tokenizer(models.BPE({c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}, []))
    byte_tokens.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    byte_tokens.decoder = decoders.ByteLevel()
    ids = byte_tokens.encode("héllo €!").ids  # é is two tokens, € three
    stream = TextStream(byte_tokens)
    pieces = [stream.add([token], last=i == len(ids) - 1) for i, token in enumerate(ids)]
    assert "".join(pieces) == "héllo €!" and "é" in pieces and "€" in pieces

def test_models_lists_the_one_model(client):
    assert [m.id for m in client.models.list()] == ["tiny-test"]


def test_a_greedy_completion_is_the_engines_with_its_usage(client, alone):
    want = alone(PROMPT, 8)
    reply = client.completions.create(model="tiny-test", prompt=PROMPT, max_tokens=8, temperature=0)
    choice = reply.choices[0]
    assert choice.token_ids == want
    assert choice.finish_reason == ("length" if len(want) == 8 else "stop")
    assert choice.text == text_of(want, choice.finish_reason)
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (4, len(want),
                                                                                                  4 + len(want))


def test_streaming_gives_the_same_text_a_token_a_chunk(client):
    options = dict(model="tiny-test", prompt=PROMPT, max_tokens=8, temperature=0)
    whole = client.completions.create(**options).choices[0]
    chunks = list(client.completions.create(**options, stream=True, stream_options={"include_usage": True}))
    *tokens, usage = chunks
    assert [c.choices[0].token_ids for c in tokens] == [[t] for t in whole.token_ids]
    assert "".join(c.choices[0].text for c in tokens) == whole.text
    assert [c.choices[0].finish_reason for c in tokens] == [None] * (len(tokens) - 1) + [whole.finish_reason]
    assert usage.choices == [] and usage.usage.completion_tokens == len(whole.token_ids)


def test_chat_is_a_completion_of_the_plain_transcript(client, alone):
    messages = [{"role": "system", "content": "w4 w5"}, {"role": "user", "content": "w6 w7 w8"}]
    transcript = plain_transcript(messages_of(messages))
    assert transcript == "system: w4 w5\nuser: w6 w7 w8\nassistant:"
    want = alone(transcript, 6)
    reply = client.chat.completions.create(model="tiny-test", messages=messages, max_tokens=6, temperature=0)
    choice = reply.choices[0]
    assert choice.token_ids == want and choice.message.role == "assistant"
    assert choice.message.content == text_of(want, choice.finish_reason)
    assert reply.usage.prompt_tokens == len(alone.tokenizer.encode(transcript).ids)

    chunks = list(client.chat.completions.create(model="tiny-test", messages=messages, max_tokens=6, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason


def test_concurrent_requests_each_get_their_tokens_alone(client, alone):
    # 6 requests for 4 slots: some wait, and they join and leave one another's batches
    prompts = [PROMPT, [1, 5, 77, 200, 9, 31, 4, 100, 12, 250], "w1 w42", [1, 8, 8, 8, 8], "w9 w9 w3", [7]]
    lengths = [8, 12, 5, 10, 7, 9]

    def ask(prompt, max_tokens):
        if prompt == "w9 w9 w3":  # one streams
            stream = client.completions.create(model="tiny-test", prompt=prompt, max_tokens=max_tokens,
                                               temperature=0, stream=True)
            return [t for chunk in stream for t in chunk.choices[0].token_ids]
        reply = client.completions.create(model="tiny-test", prompt=prompt, max_tokens=max_tokens, temperature=0)
        return reply.choices[0].token_ids

    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(ask, prompts, lengths))
    assert got == [alone(p, n) for p, n in zip(prompts, lengths)]


@pytest.mark.parametrize("options, message", [
    (dict(prompt=[5] * 60, max_tokens=16), "exceeds max_context (64)"),
    (dict(prompt=[5, 300]), "token ids in [0, 256)"),
    (dict(prompt="w1", extra_body={"top_k": "many"}), "'top_k' must be an integer"),
    (dict(prompt="w1", temperature=-1), "temperature must be"),
    (dict(prompt="w1", n=2), "n=2 is not supported"),
    (dict(prompt=["w1", "w2"]), "a batch of prompts is not supported"),
])
def test_a_bad_request_is_a_400_and_the_server_goes_on(client, options, message):
    with pytest.raises(openai.BadRequestError, match=message.replace("(", r"\(").replace(")", r"\)").replace(
            "[", r"\[")) as caught:
        client.completions.create(model="tiny-test", **options)
    assert caught.value.body["type"] == "invalid_request_error"
    assert client.completions.create(model="tiny-test", prompt="w1", max_tokens=2).usage.completion_tokens >= 1


def test_malformed_json_and_an_unknown_model(server, client):
    connection = http.client.HTTPConnection(server.host, server.port, timeout=10)
    connection.request("POST", "/v1/completions", body=b"{not json", headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 400
    assert json.loads(response.read())["error"]["type"] == "invalid_request_error"
    connection.close()
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.completions.create(model="gpt-4", prompt="w1")


def test_a_client_that_hangs_up_mid_stream_has_its_request_aborted(server, monkeypatch):
    submitted = []
    submit = server.engine.submit
    monkeypatch.setattr(server.engine, "submit", lambda *args: submitted.append(submit(*args)) or submitted[-1])
    body = json.dumps({"model": "tiny-test", "prompt": [1, 2, 3], "max_tokens": 60, "temperature": 0,
                       "stream": True}).encode()
    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        with sock.makefile("rb") as reply:
            while not reply.readline().startswith(b"data: "):  # the headers, then the first token's chunk
                pass
        # an abortive close (RST): the server's next write fails at once
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    deadline = time.monotonic() + 10
    while not (submitted and submitted[0].finished) and time.monotonic() < deadline:
        time.sleep(0.01)
    (request,) = submitted
    assert request.finish_reason == "abort" and len(request.output) < 60  # not run on to max_tokens
    assert request.slot is None and request not in server.engine.scheduler.running


# A Llama-3-shaped template over the test's words: w250 begins the text (bos_token), w251/w252 open and close a
# message header, w253 ends a turn; only user and assistant may speak, in turn.
TEMPLATE = (
    "{{ bos_token }} {% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
    "w251 {{ 'w1' if message['role'] == 'user' else 'w2' }} w252 {{ message['content'] | trim }} w253 "
    "{% endfor %}{% if add_generation_prompt %}w251 w2 w252 {% endif %}")


@pytest.fixture(scope="module")
def templated(folder, tmp_path_factory):
    """The tiny checkpoint with the template in tokenizer_config.json and a tokenizer whose own encode adds
    w250 in front (as Llama-3's adds <|begin_of_text|>), served."""
    from tokenizers import Tokenizer, processors

    templated = tmp_path_factory.mktemp("tiny-with-template")
    shutil.copytree(folder, templated, dirs_exist_ok=True)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.post_processor = processors.TemplateProcessing(single="w250 $A", special_tokens=[("w250", 250)])
    tokenizer.save(str(templated / "tokenizer.json"))
    (templated / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": TEMPLATE, "bos_token": {"content": "w250"}, "eos_token": "w253"}))
    server = Server(engine_on(templated, max_slots=2), model_id="tiny-chat", port=0,
                    chat_template=load_chat_template(templated))
    server.start()
    with openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=30) as client:
        yield client, engine_on(templated, max_slots=1)
    server.stop()


def test_chat_renders_the_checkpoints_template_with_one_bos(templated):
    client, alone = templated
    messages = [{"role": "user", "content": " w6 w7 "}, {"role": "assistant", "content": "w8"},
                {"role": "user", "content": "w9"}]
    want_ids = [250, 251, 1, 252, 6, 7, 253, 251, 2, 252, 8, 253, 251, 1, 252, 9, 253, 251, 2, 252]
    want = alone.generate([want_ids], SamplingParams(max_tokens=5))[0]
    reply = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=5, temperature=0)
    assert reply.usage.prompt_tokens == len(want_ids)  # the template's w250 alone, not the tokenizer's too
    assert reply.choices[0].token_ids == want


def test_a_template_that_refuses_the_messages_is_a_400_with_its_reason(templated):
    client, _ = templated
    with pytest.raises(openai.BadRequestError, match="roles must alternate user/assistant"):
        client.chat.completions.create(model="tiny-chat", messages=[{"role": "assistant", "content": "w1"}])
    reply = client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "w1"}],
                                           max_tokens=2, temperature=0)
    assert reply.usage.prompt_tokens == 9  # and the server goes on serving


def test_without_a_tokenizer_text_is_refused_and_the_server_stops_cleanly(checkpoint):
    model, tokenizer = from_pretrained(checkpoint[0], dtype=torch.float32)
    assert tokenizer is None
    server = Server(Engine(model, page_size=8, max_slots=2, max_context=MAX_CONTEXT), model_id="bare", port=0)
    port = server.start()
    with openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=30) as client:
        with pytest.raises(openai.BadRequestError, match="needs a tokenizer"):
            client.completions.create(model="bare", prompt="w1 w2")
        with pytest.raises(openai.BadRequestError, match="chat needs a tokenizer"):
            client.chat.completions.create(model="bare", messages=[{"role": "user", "content": "hi"}])
        reply = client.completions.create(model="bare", prompt=[1, 2, 3], max_tokens=3, temperature=0)
        assert reply.choices[0].text == "" and len(reply.choices[0].token_ids) == reply.usage.completion_tokens
    server.stop()
    assert not server.engine_thread.is_alive()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5)


@pytest.mark.slow
def test_kforge_serve_serves_until_ctrl_c():
    command = [sys.executable, "-m", "kforge", "serve", "--model", "tiny", "--max-context", "64", "--port"]
    # Start it as a terminal would, with Ctrl-C's default: an ignored SIGINT is inherited across exec, and a
    # process that started ignoring it never sees Ctrl-C (something earlier in a full run leaves it so)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        serving = subprocess.Popen([*command, "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        line = serving.stdout.readline()
        assert line.startswith("serving tiny on cpu at http://127.0.0.1:"), (line, serving.stderr.read())
        url = line.split(" at ")[1].split()[0]
        with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=30) as client:
            assert [m.id for m in client.models.list()] == ["tiny"]
        port = url.split(":")[2].split("/")[0]
        taken = subprocess.run([*command, port], capture_output=True, text=True, timeout=120)
        assert taken.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in taken.stderr
    finally:
        serving.send_signal(signal.SIGINT)
        assert serving.wait(timeout=30) == 0, serving.stderr.read()

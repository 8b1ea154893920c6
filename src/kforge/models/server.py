"""An OpenAI-compatible HTTP server over the Engine (`kforge serve`), so any OpenAI client can talk to a model.

    server = Server(engine, model_id="llama3-1b", port=0)
    port = server.start()          # binds; serves from its own threads until stop()
    ...
    server.stop()

Threads: the Engine is not thread-safe, so one engine thread owns it. The HTTP handler threads (one per connection,
http.server.ThreadingHTTPServer; standard library only) parse a request, put it on a queue and wait on the request's
own queue; the engine thread submits what arrived, runs steps while any request is unfinished, and after each step
hands every request its new token. A streaming handler sends text as TextStream gives it: the decode of the output so
far, less what was sent, so a character split over tokens goes out whole. When a streaming client hangs up, its
handler marks the job abandoned and the engine thread aborts the request before its next step, freeing its slot and
pages.

Endpoints as in OpenAI's API: GET /v1/models, POST /v1/completions, POST /v1/chat/completions, each with `stream`
(server-sent events, `data: [DONE]` last) and `stream_options.include_usage`. Extensions: `top_k`, `stop_token_ids`,
and `token_ids` in every choice (the generated ids: a model without a tokenizer has no text). Refused with 400 rather
than silently ignored: n > 1, best_of, logprobs, echo, suffix, stop strings, tools and functions, logit_bias,
presence and frequency penalties, response formats other than text.

Chat: the checkpoint's own chat template where it has one (`Server(..., chat_template=...)`, models/chat.py: a
Jinja template from tokenizer_config.json or chat_template.jinja, rendered as Hugging Face renders it, its text
encoded without the tokenizer's special tokens, which the template writes); without one, plain "role: content"
lines and a last "assistant:" line, which an instruct model answers less well. A template's raise_exception
(e.g. roles out of order) is a 400 with its message.
A finish_reason "stop" means a stop token: it counts in completion_tokens and token_ids, but is left out of the text,
as OpenAI leaves out the stop sequence. The KV cache is reserved for prompt + max_tokens when a request starts
(scheduler.py), so a chat's default max_tokens, the rest of the context, takes a slot's whole share.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from kforge.errors import ModelError
from kforge.models.chat import ChatTemplate, encode_rendered, messages_of, plain_transcript
from kforge.models.engine import Engine
from kforge.models.sampling import SamplingParams
from kforge.models.scheduler import Request

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

# OpenAI fields the engine cannot honour: any value but null and these is refused, not ignored
UNSUPPORTED = {"n": (1,), "best_of": (1,), "echo": (False,), "logprobs": (False, 0), "top_logprobs": (0,),
               "suffix": ("",), "stop": ("", []), "logit_bias": ({},), "presence_penalty": (0,),
               "frequency_penalty": (0,), "tools": ([],), "functions": ([],), "tool_choice": ("none",),
               "function_call": ("none",), "response_format": ({"type": "text"},)}


class ApiError(Exception):
    """A request that gets an error reply in OpenAI's shape instead of a completion."""

    def __init__(self, message: str, status: int = HTTPStatus.BAD_REQUEST, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.code = message, int(status), code

    def body(self) -> dict:
        kind = "server_error" if self.status >= 500 else "invalid_request_error"
        return {"error": {"message": self.message, "type": kind, "param": None, "code": self.code}}


@dataclass
class _Job:
    """A request crossing from a handler thread to the engine thread; its events come back on `events`: first the
    engine's Request or an ApiError, then a _Progress per step, or an ApiError if the engine fails or stops."""

    prompt: list[int]
    params: SamplingParams
    events: queue.Queue = field(default_factory=queue.Queue)
    delivered: int = 0  # output tokens already sent as events (the engine thread's to write)
    abandoned: bool = False  # the client went away: the engine thread aborts the request before its next step


@dataclass(frozen=True)
class _Progress:
    """One step's new tokens of a request, and its finish reason once it has finished."""

    tokens: list[int]
    finish_reason: str | None


@dataclass(frozen=True)
class _Call:
    """A generation request, parsed and checked by its handler."""

    chat: bool
    prompt: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool


class Server:
    """The engine thread and the HTTP server of one model; `start()` binds and returns the port."""

    def __init__(self, engine: Engine, model_id: str, *, host: str = "127.0.0.1", port: int = 8000,
                 chat_template: ChatTemplate | None = None):
        self.engine, self.model_id, self.host, self.port = engine, model_id, host, port
        self.chat_template = chat_template
        self.tokenizer = engine.tokenizer  # read by the handlers; tokenizers' encode and decode are thread-safe
        self.max_context = engine.scheduler.max_context
        self.created = int(time.time())
        self.engine_thread = threading.Thread(target=self._run_engine, name="kforge-engine", daemon=True)
        self._inbox: queue.Queue[_Job | None] = queue.Queue()  # None only wakes the engine thread to stop
        self._stopping = threading.Event()
        self._stopping_lock = threading.Lock()  # a job queued before stopping is answered by the engine thread
        self._failure: str | None = None  # set once the engine raised: its state is unknown from then on
        self._http: _HTTPServer | None = None
        self._http_thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def start(self) -> int:
        self._http = _HTTPServer((self.host, self.port), _Handler)
        self._http.app = self
        self.port = self._http.server_address[1]
        self._http_thread = threading.Thread(target=self._http.serve_forever, name="kforge-http", daemon=True)
        self.engine_thread.start()
        self._http_thread.start()
        return self.port

    def stop(self) -> None:
        """Stop accepting, close the port, and end the engine thread; unfinished requests get a 503 error."""
        self._http.shutdown()
        self._http.server_close()
        self._http_thread.join()
        with self._stopping_lock:
            self._stopping.set()
            self._inbox.put(None)
        self.engine_thread.join()

    def _submit(self, job: _Job) -> None:
        with self._stopping_lock:
            if self._stopping.is_set():
                raise ApiError("the server is stopping", HTTPStatus.SERVICE_UNAVAILABLE)
            self._inbox.put(job)

    # --- the engine thread: the only one that touches the engine ------------------------------

    def _run_engine(self) -> None:
        running: dict[Request, _Job] = {}
        while not self._stopping.is_set():
            for job in self._arrivals(wait=not running):
                self._admit(job, running)
            if running:
                self._step(running)
        for job in [*running.values(), *self._arrivals(wait=False)]:
            job.events.put(ApiError("the server is stopping", HTTPStatus.SERVICE_UNAVAILABLE))

    def _arrivals(self, wait: bool) -> Iterator[_Job]:
        """The jobs queued so far; with `wait`, block for the first (stop() wakes it)."""
        try:
            job = self._inbox.get(block=wait)
            while True:
                if job is not None:
                    yield job
                job = self._inbox.get_nowait()
        except queue.Empty:
            return

    def _admit(self, job: _Job, running: dict[Request, _Job]) -> None:
        if self._failure is not None:
            job.events.put(ApiError(self._failure, HTTPStatus.INTERNAL_SERVER_ERROR))
            return
        try:
            request = self.engine.submit(job.prompt, job.params)
        except ModelError as exc:  # too long for the context, a token id outside the vocabulary
            job.events.put(ApiError(exc.reason))
            return
        except Exception as exc:  # noqa: BLE001 - a bug: the engine is not trusted again
            self._fail(exc, [job])
            return
        job.events.put(request)
        running[request] = job

    def _step(self, running: dict[Request, _Job]) -> None:
        for request, job in list(running.items()):
            if job.abandoned:  # before the step, so no pass is spent on it; its finish_reason has no one to go to
                self.engine.abort(request.id)
                del running[request]
        try:
            self.engine.step()
        except Exception as exc:  # noqa: BLE001 - the device or a bug: every request is told, the server stays up
            self._fail(exc, running.values())
            running.clear()
            return
        for request, job in list(running.items()):
            if len(request.output) > job.delivered:
                job.events.put(_Progress(request.output[job.delivered:], request.finish_reason))
                job.delivered = len(request.output)
            if request.finished:
                del running[request]

    def _fail(self, exc: Exception, jobs: Iterable[_Job]) -> None:
        self._failure = f"the engine failed: {type(exc).__name__}: {exc}"
        for job in jobs:
            job.events.put(ApiError(self._failure, HTTPStatus.INTERNAL_SERVER_ERROR))

    # --- parsing, on the handler threads --------------------------------------------------------

    def parse(self, body: dict, chat: bool) -> _Call:
        model = body.get("model")
        if model is not None and model != self.model_id:
            raise ApiError(f"model {model!r} is not served here; this server serves {self.model_id!r}",
                           HTTPStatus.NOT_FOUND, code="model_not_found")
        for name, allowed in UNSUPPORTED.items():
            value = body.get(name)
            if value is not None and value not in allowed:
                raise ApiError(f"{name}={json.dumps(value)} is not supported by kforge serve")
        if chat:
            if self.tokenizer is None:
                raise ApiError("chat needs a tokenizer (a checkpoint with tokenizer.json); this model has none: use "
                               "/v1/completions with token ids")
            try:
                messages = messages_of(body.get("messages"))
                if self.chat_template is None:
                    prompt = self.encode(plain_transcript(messages))
                else:
                    prompt = encode_rendered(self.tokenizer, self.chat_template.render(messages))
            except ValueError as exc:  # bad messages, or the template refused them
                raise ApiError(str(exc)) from None
            max_tokens = _option(body, "max_completion_tokens", int, None, "an integer")
            if max_tokens is None:  # the rest of the context; a prompt that fills it is refused by the engine
                max_tokens = _option(body, "max_tokens", int, max(1, self.max_context - len(prompt)), "an integer")
        else:
            prompt = self._completion_prompt(body.get("prompt"))
            max_tokens = _option(body, "max_tokens", int, COMPLETION_DEFAULT_MAX_TOKENS, "an integer")
        stop_token_ids = _option(body, "stop_token_ids", list, [], "an array of token ids")
        if not all(_is_int(t) for t in stop_token_ids):
            raise ApiError(f"'stop_token_ids' must be an array of token ids, got {json.dumps(stop_token_ids)}")
        stream_options = _option(body, "stream_options", dict, {}, "an object")
        try:
            params = SamplingParams(temperature=_option(body, "temperature", (int, float), 1.0, "a number"),
                                    top_p=_option(body, "top_p", (int, float), 1.0, "a number"),
                                    top_k=_option(body, "top_k", int, 0, "an integer"),
                                    max_tokens=max_tokens, stop_token_ids=stop_token_ids,
                                    seed=_option(body, "seed", int, None, "an integer"))
        except ValueError as exc:
            raise ApiError(str(exc)) from None
        return _Call(chat=chat, prompt=prompt, params=params, stream=_option(body, "stream", bool, False, "a boolean"),
                     include_usage=_option(stream_options, "include_usage", bool, False, "a boolean"))

    def _completion_prompt(self, prompt: object) -> list[int]:
        if isinstance(prompt, str):
            return self.encode(prompt)
        if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
            return prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            raise ApiError("one prompt per request: a batch of prompts is not supported")
        raise ApiError(f"'prompt' must be a string or a non-empty array of token ids, got {json.dumps(prompt)}")

    def encode(self, text: str) -> list[int]:
        """As Engine.encode does, on the calling thread: the engine thread keeps to the steps."""
        if self.tokenizer is None:
            raise ApiError("a text prompt needs a tokenizer (a checkpoint with tokenizer.json); this model has "
                           "none: send token ids")
        return list(self.tokenizer.encode(text).ids)

    def text(self, tokens: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(tokens)


class TextStream:
    """The text of a growing output, a piece at a time: the decode of all its tokens so far, less what was sent.
    Decoding the whole output, not each token alone, keeps a character that spans tokens whole; text that ends in
    U+FFFD (the replacement for an incomplete character) waits for the token that completes it."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.sent = ""

    def add(self, tokens: list[int], last: bool) -> str:
        """The text these tokens add ("" without a tokenizer); `last` sends whatever was held back."""
        self.tokens += tokens
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(self.tokens)
        if text.endswith("\ufffd") and not last:
            return ""
        piece, self.sent = text[len(self.sent):], text
        return piece


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _option(body: dict, name: str, kind: type | tuple[type, ...], default, expected: str):
    """body[name], or `default` when it is absent or null; a 400 when it has another JSON type."""
    value = body.get(name)
    if value is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise ApiError(f"'{name}' must be {expected}, got {json.dumps(value)}")
    return value


def _visible(tokens: list[int], finish_reason: str | None) -> list[int]:
    """The tokens whose text is shown: all but a stop token."""
    return tokens[:-1] if finish_reason == "stop" else tokens


class _HTTPServer(ThreadingHTTPServer):
    app: Server  # set by Server.start, read by the handlers


class _Handler(BaseHTTPRequestHandler):
    """One connection's requests (HTTP/1.0: one each). A streamed reply ends when the connection closes."""

    server_version = "kforge"

    @property
    def app(self) -> Server:
        return self.server.app

    def log_message(self, format: str, *args) -> None:
        """No access log: `kforge serve` prints its URL and nothing per request."""

    def do_GET(self) -> None:
        if self.path.rstrip("/") == "/v1/models":
            app = self.app
            self._reply(HTTPStatus.OK, {"object": "list", "data": [
                {"id": app.model_id, "object": "model", "created": app.created, "owned_by": "kforge",
                 "max_model_len": app.max_context}]})
        else:
            self._reply_error(ApiError(f"no such endpoint: GET {self.path}", HTTPStatus.NOT_FOUND))

    def do_POST(self) -> None:
        routes = {"/v1/completions": False, "/v1/chat/completions": True}
        path = self.path.rstrip("/")
        try:
            if path not in routes:
                raise ApiError(f"no such endpoint: POST {self.path}", HTTPStatus.NOT_FOUND)
            call = self.app.parse(self._body(), chat=routes[path])
            self._generate(call)
        except ApiError as exc:
            self._reply_error(exc)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client went away; its request was told to end

    def _body(self) -> dict:
        try:
            length = int(self.headers.get("Content-Length", ""))
            body = json.loads(self.rfile.read(max(length, 0)))
        except ValueError as exc:  # a missing length, or not JSON (JSONDecodeError, UnicodeDecodeError)
            raise ApiError(f"the body must be a JSON object with a Content-Length: {exc}") from None
        if not isinstance(body, dict):
            raise ApiError("the body must be a JSON object")
        return body

    def _generate(self, call: _Call) -> None:
        job = _Job(call.prompt, call.params)
        self.app._submit(job)
        accepted = job.events.get()
        if isinstance(accepted, ApiError):
            raise accepted
        try:
            if call.stream:
                self._stream(call, job)
            else:
                self._complete(call, job)
        except (BrokenPipeError, ConnectionResetError):
            job.abandoned = True
            raise

    def _progress(self, job: _Job) -> Iterator[_Progress]:
        while True:
            event = job.events.get()
            if isinstance(event, ApiError):
                raise event
            yield event
            if event.finish_reason is not None:
                return

    def _complete(self, call: _Call, job: _Job) -> None:
        tokens, finish_reason = [], None
        for progress in self._progress(job):
            tokens += progress.tokens
            finish_reason = progress.finish_reason
        text = self.app.text(_visible(tokens, finish_reason))
        choice = {"index": 0, "finish_reason": finish_reason, "logprobs": None, "token_ids": tokens}
        if call.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        self._reply(HTTPStatus.OK, {**self._header(call), "choices": [choice],
                                    "usage": _usage(len(call.prompt), len(tokens))})

    def _stream(self, call: _Call, job: _Job) -> None:
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        header = self._header(call)
        if call.chat:  # OpenAI's first chunk names the role
            self._event({**header, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                "finish_reason": None, "logprobs": None, "token_ids": []}]})
        text, completion_tokens = TextStream(self.app.tokenizer), 0
        try:
            for progress in self._progress(job):
                completion_tokens += len(progress.tokens)
                piece = text.add(_visible(progress.tokens, progress.finish_reason), progress.finish_reason is not None)
                choice = {"index": 0, "finish_reason": progress.finish_reason, "logprobs": None,
                          "token_ids": progress.tokens}
                if call.chat:
                    choice["delta"] = {"content": piece} if piece else {}
                else:
                    choice["text"] = piece
                self._event({**header, "choices": [choice]})
        except ApiError as exc:  # the engine failed or the server stops: said in the stream, as OpenAI does
            self._event(exc.body())
            return
        if call.include_usage:
            self._event({**header, "choices": [], "usage": _usage(len(call.prompt), completion_tokens)})
        self.wfile.write(b"data: [DONE]\n\n")

    def _header(self, call: _Call) -> dict:
        kind = ("chat.completion.chunk" if call.stream else "chat.completion") if call.chat else "text_completion"
        prefix = "chatcmpl" if call.chat else "cmpl"
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
                "model": self.app.model_id}

    def _event(self, payload: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(payload).encode() + b"\n\n")

    def _reply(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _reply_error(self, error: ApiError) -> None:
        self._reply(error.status, error.body())


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}

"""Where replies come from: an OpenAI-compatible endpoint, or a person (manual mode).

    client = EndpointClient("http://localhost:8000/v1", "my-model", temperature=0.7)
    reply = client.complete(messages, attempt_id)        # Reply(text, usage)

    client = ManualClient(Path("replies"))
    reply = client.complete(messages, attempt_id)        # or raises Waiting(prompt, reply path)

The endpoint is spoken to through the official `openai` client (the `machine` extra), chat
completions only, so any server that speaks that protocol works: OpenAI's, vLLM's,
SGLang's, llama.cpp's, `kforge serve`. HTTP 429 and 5xx answers and timeouts are retried
a bounded number of times with exponential backoff (a 429's Retry-After is honoured, up
to the cap); anything else fails at once, since asking again would get the same answer.
A server that refuses the connection fails at once too: nothing is listening there.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from kforge.errors import KforgeError

ATTEMPT_HEADER = "X-Kforge-Attempt"  # names the attempt in the server's logs


class RequestFailed(KforgeError):
    """The endpoint gave no reply: unreachable, refused the request, or kept failing."""


class Waiting(Exception):
    """Manual mode: the prompt is written and its reply file is not there yet (a state, not an error)."""

    def __init__(self, prompt: Path, reply: Path):
        super().__init__(f"fill in {reply} (the prompt is {prompt})")
        self.prompt = prompt
        self.reply = reply


@dataclass(frozen=True)
class Reply:
    text: str | None
    usage: dict | None  # the server's token counts, the requests it took and the finish reason


class EndpointClient:
    """Chat completions from an OpenAI-compatible server (module docstring)."""

    def __init__(self, base_url: str | None, model: str, *, api_key_env: str = "OPENAI_API_KEY",
                 temperature: float = 0.7, max_tokens: int = 8192, request_timeout: float = 600.0,
                 retries: int = 4, backoff_s: float = 2.0, max_backoff_s: float = 60.0):
        try:
            from openai import OpenAI
        except ImportError:
            raise KforgeError("the `openai` package is not installed: pip install 'kforge[machine]'") from None
        # a local server needs no key; the client insists on one, and "EMPTY" is vLLM's convention
        key = os.environ.get(api_key_env) or "EMPTY"
        self.client = OpenAI(base_url=base_url, api_key=key, timeout=request_timeout, max_retries=0)
        self.endpoint = str(self.client.base_url).rstrip("/")
        self.model = model
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.request_timeout = request_timeout
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s

    def complete(self, messages: list[dict], attempt_id: str) -> Reply:
        import openai

        last = "no request made"
        for request in range(self.retries + 1):
            wait = min(self.max_backoff_s, self.backoff_s * 2**request)
            try:
                response = self.client.chat.completions.create(
                    model=self.model, messages=messages, temperature=self.temperature, max_tokens=self.max_tokens,
                    extra_headers={ATTEMPT_HEADER: attempt_id})
            except openai.APITimeoutError:
                last = f"no reply within {self.request_timeout:g} s"
            except openai.APIConnectionError as exc:
                cause = exc.__cause__ or exc
                raise RequestFailed(f"cannot reach {self.endpoint}: {cause}") from None
            except openai.APIStatusError as exc:
                last = f"{self.endpoint} answered HTTP {exc.status_code}: {_message(exc)}"
                if exc.status_code != 429 and exc.status_code < 500:
                    raise RequestFailed(last) from None
                wait = min(self.max_backoff_s, _retry_after(exc) or wait)
            except openai.OpenAIError as exc:  # a reply that is not a chat completion
                raise RequestFailed(f"{self.endpoint} sent an unusable reply: {exc}") from None
            else:
                return _reply(response, request + 1)
            if request < self.retries:
                time.sleep(wait)
        raise RequestFailed(f"{last} (after {self.retries + 1} requests)")


def _reply(response, requests: int) -> Reply:
    choice = response.choices[0] if response.choices else None
    usage = response.usage.model_dump(exclude_none=True) if response.usage is not None else {}
    usage.update(requests=requests, finish_reason=choice.finish_reason if choice else None)
    return Reply(choice.message.content if choice and choice.message else None, usage)


def _message(exc) -> str:
    body = exc.body
    if isinstance(body, dict):
        error = body.get("error", body)
        text = error.get("message") if isinstance(error, dict) else error
        if text:
            return " ".join(str(text).split())[:300]
    return " ".join(str(exc.message).split())[:300]


def _retry_after(exc) -> float | None:
    try:
        return max(0.0, float(exc.response.headers.get("retry-after")))
    except (TypeError, ValueError, AttributeError):
        return None


class ManualClient:
    """A person answers: each prompt goes to DIR/<attempt>.prompt.md, its reply is read from
    DIR/<attempt>.reply.md once someone writes it there (an empty file counts as not yet)."""

    endpoint = "manual"

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def paths(self, attempt_id: str) -> tuple[Path, Path]:
        stem = attempt_id.replace("/", "-")
        return self.folder / f"{stem}.prompt.md", self.folder / f"{stem}.reply.md"

    def complete(self, messages: list[dict], attempt_id: str) -> Reply:
        prompt, reply = self.paths(attempt_id)
        self.folder.mkdir(parents=True, exist_ok=True)
        text = render_messages(messages)
        if not prompt.is_file() or prompt.read_text() != text:
            prompt.write_text(text)
        if reply.is_file() and reply.read_text().strip():
            return Reply(reply.read_text(), None)
        raise Waiting(prompt, reply)


def render_messages(messages: list[dict]) -> str:
    """The conversation as one Markdown file, each message under a line naming its role."""
    return "\n\n".join(f"<!-- {m['role']} -->\n\n{m['content']}" for m in messages) + "\n"

"""A loopback OpenAI-compatible server that replays recorded replies (tests/fixtures/machine/).

    with ReplayServer({"s0/t0": ["correct"], "s0/t1": [500, "wrong"]}) as server:
        client = EndpointClient(server.url, "replay")

Real HTTP on 127.0.0.1 at an ephemeral port, spoken to by the real `openai` client. Each
request names its attempt in the X-Kforge-Attempt header; the script maps the attempt's
tail ("s<k>/t<n>") to the answers to give, one per request: a fixture's name (its reply),
an HTTP status to fail with, or ("sleep", seconds, name) to answer late.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPLIES = Path(__file__).parents[1] / "fixtures" / "machine"


def reply_text(name: str) -> str:
    return (REPLIES / f"{name}.md").read_text()


class ReplayServer:
    def __init__(self, script: dict[str, list]):
        self.script = {key: list(answers) for key, answers in script.items()}
        self.requests: list[dict] = []  # {"attempt", "body", "answer"} per request received
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self) -> ReplayServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def answer_for(self, attempt: str):
        tail = "/".join(attempt.split("/")[-2:])
        with self.lock:
            answers = self.script.get(tail)
            return answers.pop(0) if answers else 400

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                attempt = self.headers.get("X-Kforge-Attempt", "")
                answer = server.answer_for(attempt)
                with server.lock:
                    server.requests.append({"attempt": attempt, "body": body, "answer": answer})
                if isinstance(answer, tuple):
                    _, seconds, answer = answer
                    time.sleep(seconds)
                if isinstance(answer, int):
                    self.send(answer, {"error": {"message": f"scripted HTTP {answer}", "type": "server_error"}})
                    return
                text = reply_text(answer)
                self.send(200, {
                    "id": "chatcmpl-replay", "object": "chat.completion", "created": int(time.time()),
                    "model": body["model"],
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": sum(len(m["content"]) for m in body["messages"]) // 4,
                              "completion_tokens": len(text) // 4,
                              "total_tokens": (sum(len(m["content"]) for m in body["messages"]) + len(text)) // 4},
                })

            def send(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up waiting (a timeout test)
                    pass

        return Handler

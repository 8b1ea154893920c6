"""JSON lines over pipes between the judge and its workers.

One message is one line of JSON, an object. The judge reads a worker's replies with a
deadline and a size limit, and anything that is not a well-formed object is an error it
records, never a reason to crash or hang: the candidate's worker is untrusted, and so is
every byte it writes.
"""

from __future__ import annotations

import json
import os
import select
import time

MAX_LINE = 1 << 20  # bytes: no honest message comes near this


class ChannelError(Exception):
    """The worker's pipe closed, timed out, or carried something that is not a message."""

    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind = kind  # "closed", "timeout" or "malformed"
        self.reason = reason


class Channel:
    """The judge's end of one worker's pipes: `send` a command, `receive` its reply."""

    def __init__(self, read_fd: int, write_fd: int, name: str):
        self.read_fd, self.write_fd, self.name = read_fd, write_fd, name
        self.buffer = b""

    def send(self, message: dict) -> None:
        data = (json.dumps(message, allow_nan=False) + "\n").encode()
        try:
            while data:
                data = data[os.write(self.write_fd, data):]
        except (BrokenPipeError, OSError) as exc:
            raise ChannelError("closed", f"the {self.name} worker's pipe is closed ({exc.strerror})") from None

    def receive(self, deadline: float) -> dict:
        """The next message; ChannelError when the pipe closes, the deadline passes, or
        the line is not a JSON object of at most MAX_LINE bytes."""
        while b"\n" not in self.buffer:
            if len(self.buffer) > MAX_LINE:
                raise ChannelError("malformed", f"the {self.name} worker sent a line over {MAX_LINE} bytes")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ChannelError("timeout", f"the {self.name} worker did not answer in time")
            ready, _, _ = select.select([self.read_fd], [], [], min(remaining, 1.0))
            if not ready:
                continue
            chunk = os.read(self.read_fd, 1 << 16)
            if not chunk:
                raise ChannelError("closed", f"the {self.name} worker's pipe closed")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        try:
            message = json.loads(line)
        except (ValueError, RecursionError):  # bad JSON, bad UTF-8, nesting or numbers past Python's limits
            raise ChannelError("malformed", f"the {self.name} worker sent a line that is not JSON: "
                                            f"{line[:120]!r}") from None
        if not isinstance(message, dict):
            raise ChannelError("malformed", f"the {self.name} worker sent {type(message).__name__}, not an object")
        return message

    def pending(self) -> bool:
        """Whether anything arrived that no command asked for yet."""
        return bool(self.buffer) or bool(select.select([self.read_fd], [], [], 0)[0])

    def request(self, message: dict, deadline: float) -> dict:
        self.send(message)
        return self.receive(deadline)

    def close(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            try:
                os.close(fd)
            except OSError:
                pass


class WorkerEnd:
    """A worker's end of its pipes: commands in, replies out (blocking; the worker trusts the judge)."""

    def __init__(self, read_fd: int, write_fd: int):
        self.reader = os.fdopen(read_fd, "rb", buffering=0)
        self.write_fd = write_fd

    def commands(self):
        line = b""
        while True:
            chunk = self.reader.readline()
            if not chunk:
                return
            line += chunk
            if line.endswith(b"\n"):
                yield json.loads(line)
                line = b""

    def reply(self, **message) -> None:
        data = (json.dumps(message) + "\n").encode()
        while data:
            data = data[os.write(self.write_fd, data):]


def serve(end: WorkerEnd, handlers: dict, on_error) -> None:
    """A worker's loop: each command {"op": name, ...} goes to handlers[name](**fields), whose
    dict is the reply; an exception becomes on_error(exc) as the reply. "exit" ends the loop."""
    for command in end.commands():
        op = command.pop("op", None)
        if op == "exit":
            end.reply(ok=True)
            return
        try:
            reply = handlers[op](**command)
        except Exception as exc:  # noqa: BLE001 - every failure is the judge's to record
            reply = on_error(exc)
        end.reply(**reply)

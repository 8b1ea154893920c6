"""Errors that mean "this input cannot be used", each with a one-line reason.

The CLI prints `reason` on one line, then `details` (the user's traceback, or what
was expected), and exits with status 2. Anything else that escapes is a kforge bug.
"""

from __future__ import annotations

import traceback
from pathlib import Path


class KforgeError(Exception):
    """An unusable input: `reason` is one line, `details` may be many.

    `kind` says what went wrong when user code raised: "error" (an exception), "oom"
    (out of memory) or "cuda_error" (the device reported an error; its context is lost).
    """

    def __init__(self, reason: str, details: str = "", kind: str = "error"):
        super().__init__(reason)
        self.reason = reason
        self.details = details
        self.kind = kind


class ProblemError(KforgeError):
    """The problem file is malformed or its reference fails to run."""


class CandidateError(KforgeError):
    """The candidate file is malformed, fails to build, or raises while running."""


class ModelError(KforgeError):
    """A model checkpoint or configuration cannot be used, or a request does not fit it."""


def describe_exception(exc: BaseException, user_file: str | Path | None = None) -> tuple[str, str]:
    """Return (one-line summary, full traceback) for an exception raised by user code.

    The summary names the innermost frame inside `user_file` (the problem or candidate),
    since that is the line the user has to fix; kforge's own frames are not the point.
    """
    frames = traceback.extract_tb(exc.__traceback__)
    where = ""
    if user_file is not None:
        target = str(Path(user_file).resolve())
        inside = [f for f in frames if str(Path(f.filename).resolve()) == target]
        if inside:
            where = f" ({Path(inside[-1].filename).name}:{inside[-1].lineno})"
    if isinstance(exc, SyntaxError) and exc.lineno is not None:
        where = f" ({Path(exc.filename or '?').name}:{exc.lineno})"
        message = exc.msg
    else:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    summary = f"{type(exc).__name__}: {message}{where}" if message else f"{type(exc).__name__}{where}"
    return summary, "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


def error_kind(exc: BaseException) -> str:
    """"oom", "cuda_error" or "error": how an exception from user code is classified."""
    import torch

    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or "can't allocate memory" in text:
        return "oom"  # the last: torch's CPU allocator raises a plain RuntimeError
    if "AcceleratorError" in text or "CUDA error" in text or "cudaError" in text:
        return "cuda_error"
    return "error"

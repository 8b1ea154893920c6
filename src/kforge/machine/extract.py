"""The code in a model's reply: the one fenced block that defines `class ModelNew`.

    extraction = extract_code(reply)   # .code, or .status "no_code" / "ambiguous_code" and .reason

The rule is strict on purpose: a candidate is a whole file, and guessing which of two
files the model meant would judge code it may not stand behind. A reply with no block
defining ModelNew, or with two, is an attempt of its own (a failed sample whose reason
goes back to the model), never a silent pick.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# A fence opens a line: three or more backticks, then an optional language tag (any tag:
# the rule is about ModelNew, not the label). It closes at a line holding the same run of
# backticks, so ```` can wrap text that shows ```.
_OPEN = re.compile(r"^ {0,3}(?P<fence>`{3,})[^\n`]*$")
_MODEL_NEW = re.compile(r"^[ \t]*class[ \t]+ModelNew\b", re.MULTILINE)
# A reasoning model's drafts, where a server leaves them in the reply: not the answer. An
# unclosed one (cut off at the token limit) runs to the end.
_THINKING = re.compile(r"<think>.*?(?:</think>|\Z)", re.DOTALL)


@dataclass(frozen=True)
class Block:
    code: str
    line: int  # the reply's line that opens the block, 1-based
    closed: bool  # False: the reply ended inside it (cut off at the token limit, say)


@dataclass(frozen=True)
class Extraction:
    code: str | None
    status: str | None  # None: code found; else "no_code" or "ambiguous_code"
    reason: str | None  # one line, for the record and the next turn's feedback


def fenced_blocks(text: str) -> list[Block]:
    """Every fenced block of a Markdown reply, in order."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        opened = _OPEN.match(lines[i])
        if not opened:
            i += 1
            continue
        fence, start, body = opened["fence"], i, []
        i += 1
        while i < len(lines) and lines[i].strip() != fence:
            body.append(lines[i])
            i += 1
        closed = i < len(lines)
        blocks.append(Block("\n".join(body) + "\n", start + 1, closed))
        i += 1
    return blocks


def defines_model_new(code: str) -> bool:
    return bool(_MODEL_NEW.search(code))


def extract_code(reply: str | None) -> Extraction:
    """The code of the one closed block that defines ModelNew (module docstring), outside
    any <think> section."""
    # the drafts give way to as many blank lines, so line numbers stay the reply's
    blocks = fenced_blocks(_THINKING.sub(lambda m: "\n" * m[0].count("\n"), reply or ""))
    candidates = [b for b in blocks if b.closed and defines_model_new(b.code)]
    if len(candidates) == 1:
        return Extraction(candidates[0].code, None, None)
    if len(candidates) > 1:
        lines = ", ".join(str(b.line) for b in candidates)
        return Extraction(None, "ambiguous_code", f"{len(candidates)} code blocks define class ModelNew "
                                                  f"(reply lines {lines}); reply with exactly one")
    if any(not b.closed and defines_model_new(b.code) for b in blocks):
        return Extraction(None, "no_code", "the code block defining class ModelNew never closes (the reply was "
                                           "cut off?)")
    if not blocks:
        return Extraction(None, "no_code", "the reply holds no fenced code block")
    return Extraction(None, "no_code", f"none of the reply's {len(blocks)} code block(s) defines class ModelNew")

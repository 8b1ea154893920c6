"""Chat prompts: a checkpoint's own chat template, or a plain transcript where it has none.

    template = load_chat_template(Path("path/to/Llama-3.2-1B-Instruct"))   # None without one
    text = template.render(messages) if template else plain_transcript(messages)

An instruct model answers in the format it was tuned on, which its checkpoint states as a Jinja
template: `chat_template` in tokenizer_config.json (a string, or a list of named templates whose
"default" is the one for plain chat), or a `chat_template.jinja` file beside it, the newer layout.
It is rendered as Hugging Face renders it: a sandboxed Jinja environment with trim_blocks and
lstrip_blocks, loop controls, `raise_exception` and `strftime_now`, the messages, the special tokens
the config names (bos_token, eos_token, ...) and add_generation_prompt=True, so the text ends where
the assistant's reply begins. The template writes the special tokens itself (Llama-3's begins with
<|begin_of_text|>), so the text is encoded without the tokenizer's own (`encode_rendered`).
jinja2 comes with torch, so this needs nothing new.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from kforge.errors import ModelError

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The template refused the messages (its raise_exception), or failed while rendering them."""


@dataclass
class ChatTemplate:
    """A compiled chat template and the special tokens it may name."""

    source: str
    special_tokens: dict[str, str] = field(default_factory=dict)
    origin: str = ""  # where it was read from, for messages

    def __post_init__(self):
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(self.source)
        except TemplateError as exc:
            where = self.origin or "the checkpoint"
            raise ModelError(f"the chat template in {where} does not compile: {exc}") from None

    def render(self, messages: list[dict]) -> str:
        """The prompt text of `messages` (dicts with "role" and string "content"), ending where the
        assistant's reply begins."""
        from jinja2 import TemplateError

        try:
            return self._template.render(messages=messages, add_generation_prompt=True, **self.special_tokens)
        except ChatTemplateError:
            raise
        except TemplateError as exc:
            raise ChatTemplateError(f"the chat template failed on these messages: {exc}") from None


def _raise_exception(message: str):
    raise ChatTemplateError(message)


def load_chat_template(directory: Path) -> ChatTemplate | None:
    """The chat template of a Hugging Face checkpoint directory, or None where it names none
    (ModelError for an unreadable tokenizer_config.json or a template that does not compile)."""
    from kforge.models.llama.checkpoint import read_json_object

    config_path = directory / "tokenizer_config.json"
    config = read_json_object(config_path) if config_path.is_file() else {}
    jinja_path = directory / "chat_template.jinja"
    if jinja_path.is_file():
        source, origin = jinja_path.read_text(), str(jinja_path)
    else:
        source, origin = config.get("chat_template"), str(config_path)
        if isinstance(source, list):  # named templates: "default" is plain chat's
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
    if source is None:
        return None
    if not isinstance(source, str):
        raise ModelError(f"the chat template in {origin} is not a string")
    special = {}
    for name in SPECIAL_TOKENS:
        token = config.get(name)
        if isinstance(token, dict):  # an AddedToken's fields
            token = token.get("content")
        if isinstance(token, str):
            special[name] = token
    return ChatTemplate(source, special, origin)


def messages_of(value: object) -> list[dict]:
    """OpenAI's chat messages checked and their content made strings (text parts joined); ValueError
    with a one-line reason otherwise."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"'messages' must be a non-empty array of messages, got {json.dumps(value)}")
    messages = []
    for message in value:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"each message must be an object with a 'role', got {json.dumps(message)}")
        content = message.get("content")
        if isinstance(content, list):  # content parts: only text ones can be read here
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ValueError("only text content parts are supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ValueError(f"a message's 'content' must be a string or text parts, got {json.dumps(content)}")
        messages.append({**message, "content": content})
    return messages


def plain_transcript(messages: list[dict]) -> str:
    """Checked messages as "role: content" lines, then "assistant:" for the model to continue: for a
    checkpoint with no chat template (an instruct model answers less well than in its own)."""
    return "\n".join([*(f"{m['role']}: {m['content']}" for m in messages), "assistant:"])


def encode_rendered(tokenizer, text: str) -> list[int]:
    """A rendered template's token ids: without the tokenizer's own special tokens, which the template
    wrote already (Hugging Face's apply_chat_template encodes the same way)."""
    return list(tokenizer.encode(text, add_special_tokens=False).ids)

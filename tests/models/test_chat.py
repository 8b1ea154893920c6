"""Chat templates (models/chat.py): read from a checkpoint directory in each of Hugging Face's layouts, rendered
as Hugging Face renders them (trim_blocks, lstrip_blocks, special tokens, the generation prompt, raise_exception,
loop controls, tojson), refused with a one-line error when they cannot be read or compiled; the messages checked
and the plain transcript for checkpoints without one."""

from __future__ import annotations

import json

import pytest

from kforge.errors import ModelError
from kforge.models.chat import ChatTemplate, ChatTemplateError, load_chat_template, messages_of, plain_transcript

LLAMA3_LIKE = ("{{ bos_token }}{% for message in messages %}\n"
               "    <|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
               "{{ message['content'] | trim }}<|eot_id|>\n"
               "{% endfor %}\n"
               "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


def test_render_follows_hugging_faces_whitespace_rules_and_special_tokens():
    template = ChatTemplate(LLAMA3_LIKE, {"bos_token": "<|begin_of_text|>"})
    text = template.render([{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "Hi"}])
    # trim_blocks drops the newline after each block tag, lstrip_blocks the indent before one
    assert text == ("<|begin_of_text|>    <|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>\n"
                    "    <|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>\n"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_render_has_loop_controls_tojson_and_raise_exception():
    source = ("{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}"
              "{{ m | tojson }};{% endfor %}"
              "{% if messages | length > 2 %}{{ raise_exception('at most two messages') }}{% endif %}")
    template = ChatTemplate(source)
    assert template.render([{"role": "system", "content": "x"}, {"role": "user", "content": "é"}]) == (
        '{"role": "user", "content": "é"};')  # ensure_ascii off, as Hugging Face's tojson
    with pytest.raises(ChatTemplateError, match="^at most two messages$"):
        template.render([{"role": "user", "content": "a"}] * 3)
    with pytest.raises(ChatTemplateError, match="failed on these messages"):
        ChatTemplate("{{ messages[5]['content'] }}").render([{"role": "user", "content": "a"}])


def test_a_template_cannot_reach_outside_its_sandbox():
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ messages.__class__.__mro__ }}").render([])


def test_load_reads_each_layout_and_the_special_tokens(tmp_path):
    assert load_chat_template(tmp_path) is None  # no tokenizer_config.json at all
    config = {"bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "</s>", "pad_token": None}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_chat_template(tmp_path) is None  # a config that names no template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{{ bos_token }}A"}))
    template = load_chat_template(tmp_path)
    assert template.render([]) == "<s>A" and template.special_tokens == {"bos_token": "<s>", "eos_token": "</s>"}
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ eos_token }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": named}))
    assert load_chat_template(tmp_path).render([]) == "D</s>"
    (tmp_path / "chat_template.jinja").write_text("J")  # the newer layout wins
    assert load_chat_template(tmp_path).render([]) == "J"


@pytest.mark.parametrize("config, message", [
    ("{not json", "is not valid JSON"),
    ("[1, 2]", "does not hold a JSON object"),
    (json.dumps({"chat_template": 7}), "is not a string"),
    (json.dumps({"chat_template": "{% for %}"}), "does not compile"),
])
def test_an_unreadable_template_is_one_clear_error(tmp_path, config, message):
    (tmp_path / "tokenizer_config.json").write_text(config)
    with pytest.raises(ModelError, match=message):
        load_chat_template(tmp_path)


def test_messages_are_checked_and_text_parts_joined():
    parts = [{"type": "text", "text": "a "}, {"type": "text", "text": "b"}]
    assert messages_of([{"role": "user", "content": parts}]) == [{"role": "user", "content": "a b"}]
    assert plain_transcript(messages_of([{"role": "user", "content": "hi"}])) == "user: hi\nassistant:"
    for bad, message in [([], "non-empty array"), ([{"content": "x"}], "with a 'role'"),
                         ([{"role": "user", "content": 3}], "must be a string or text parts"),
                         ([{"role": "user", "content": [{"type": "image_url"}]}], "only text content parts")]:
        with pytest.raises(ValueError, match=message):
            messages_of(bad)

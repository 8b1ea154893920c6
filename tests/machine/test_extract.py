"""Extraction: the one fenced block that defines class ModelNew, or a status saying why not."""

from replay_server import reply_text

from kforge.machine.extract import extract_code, fenced_blocks

MODEL_NEW = "class ModelNew(nn.Module):\n    pass\n"


def test_the_one_block_defining_model_new_is_taken_whatever_else_the_reply_holds():
    reply = (f"Plan:\n```text\nload, add, store\n```\nThe file:\n```python\n{MODEL_NEW}```\n"
             "A test:\n```python\nx = 1\n```\n")
    extraction = extract_code(reply)
    assert extraction.status is None and extraction.code == MODEL_NEW


def test_a_block_without_a_language_tag_counts():
    assert extract_code(f"```\n{MODEL_NEW}```").code == MODEL_NEW


def test_a_recorded_reply_gives_its_whole_file():
    code = extract_code(reply_text("correct")).code
    assert code.startswith("import torch\n") and "@triton.jit" in code and code.rstrip().endswith("return out")


def test_a_reply_with_no_block_is_no_code():
    extraction = extract_code(reply_text("no_code"))
    assert (extraction.code, extraction.status) == (None, "no_code")
    assert extraction.reason == "the reply holds no fenced code block"


def test_blocks_none_of_which_defines_model_new_are_no_code():
    extraction = extract_code("```python\nclass Model:\n    pass\n```\n```python\nx = 1\n```")
    assert extraction.status == "no_code" and "none of the reply's 2 code block(s)" in extraction.reason


def test_an_empty_reply_is_no_code():
    assert extract_code(None).status == "no_code" and extract_code("").status == "no_code"


def test_two_blocks_defining_model_new_are_ambiguous_and_name_their_lines():
    extraction = extract_code(reply_text("two_model_new"))
    assert (extraction.code, extraction.status) == (None, "ambiguous_code")
    assert extraction.reason.startswith("2 code blocks define class ModelNew (reply lines 3, 13)")
    assert "\n" not in extraction.reason


def test_a_block_cut_off_before_its_fence_closes_is_no_code_and_says_so():
    extraction = extract_code(f"Here:\n```python\nimport torch\n{MODEL_NEW}    def forward(self, x):\n")
    assert extraction.status == "no_code" and "never closes" in extraction.reason


def test_a_longer_fence_wraps_text_that_shows_a_shorter_one():
    reply = f"````python\n{MODEL_NEW}DOC = '''\n```\nnot a fence here\n```\n'''\n````\n"
    (block,) = fenced_blocks(reply)
    assert block.closed and "not a fence here" in block.code and extract_code(reply).status is None


def test_model_new_named_only_in_a_comment_or_a_longer_name_is_not_a_definition():
    extraction = extract_code("```python\n# class ModelNew would go here\nclass ModelNewer:\n    pass\n```")
    assert extraction.status == "no_code"


def test_a_reasoning_models_drafts_in_think_tags_are_not_the_answer():
    draft = "```python\nclass ModelNew:  # draft\n    pass\n```"
    extraction = extract_code(f"<think>\nFirst try:\n{draft}\n</think>\nThe file:\n```python\n{MODEL_NEW}```\n")
    assert extraction.status is None and extraction.code == MODEL_NEW
    assert extract_code(f"<think>\n{draft}\nstill thinking").status == "no_code"

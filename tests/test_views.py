"""What the CLI's views print: a failing candidate's traceback cut to the user's own frames."""

from pathlib import Path

import kforge.views as views

PACKAGE = Path(views.__file__).resolve().parent


def _traceback(*frames: str, last: str) -> list[str]:
    return ["Traceback (most recent call last):", *"\n".join(frames).splitlines(), last]


def test_kforge_torch_and_import_frames_are_left_out_and_the_users_stay():
    lines = _traceback(
        f'  File "{PACKAGE}/harness/loading.py", line 40, in import_user_file\n    spec.loader.exec_module(module)',
        '  File "<frozen importlib._bootstrap_external>", line 936, in exec_module',
        '  File "/home/me/kforge-work/candidate.py", line 9, in forward\n    return helper(x)\n           ^^^^^^^^^',
        '  File "/venv/lib/python3.12/site-packages/torch/nn/modules/module.py", line 1775, in _call_impl\n'
        '    return forward_call(*args, **kwargs)',
        '  File "/home/me/kforge-work/candidate.py", line 4, in helper\n    raise ValueError("bad")',
        last="ValueError: bad")
    assert views.user_traceback(lines) == [
        "Traceback (most recent call last):",
        '  File "/home/me/kforge-work/candidate.py", line 9, in forward', "    return helper(x)",
        "           ^^^^^^^^^",
        '  File "/home/me/kforge-work/candidate.py", line 4, in helper', '    raise ValueError("bad")',
        "ValueError: bad"]


def test_a_syntax_error_keeps_its_line_and_caret():
    lines = _traceback(
        f'  File "{PACKAGE}/harness/loading.py", line 40, in import_user_file\n    spec.loader.exec_module(module)',
        '  File "/work/syntax.py", line 2\n    def (\n        ^',
        last="SyntaxError: invalid syntax")
    assert views.user_traceback(lines)[1:] == ['  File "/work/syntax.py", line 2', "    def (", "        ^",
                                               "SyntaxError: invalid syntax"]


def test_kforges_own_problems_and_solutions_are_user_code_here():
    frame = f'  File "{PACKAGE}/solutions/level1/softmax.py", line 3, in forward'
    assert views.user_traceback(_traceback(frame, last="RuntimeError: x")) == _traceback(frame, last="RuntimeError: x")


def test_the_eval_view_says_what_it_left_out_and_verbose_shows_everything():
    details = "\n".join(_traceback(
        f'  File "{PACKAGE}/harness/candidate.py", line 80, in run\n    out = model(*inputs)',
        '  File "/work/candidate.py", line 4, in forward\n    raise ValueError("bad")', last="ValueError: bad"))
    record = {"status": "candidate_error", "reason": "ModelNew raised: ValueError: bad (candidate.py:4)",
              "details": details, "problem": {"name": "p", "path": "p.py"}, "candidate": {"path": "c.py"},
              "device": {"name": "cpu", "kind": "cpu"}}

    def printed(verbose):
        from rich.console import Console

        console = Console(width=200, record=True)
        console.print(views.eval_view(record, verbose=verbose))
        return console.export_text()

    short, whole = printed(False), printed(True)
    assert "frames left out: --verbose for all" in short and "harness/candidate.py" not in short
    assert '/work/candidate.py", line 4' in short and "ValueError: bad" in short
    assert "harness/candidate.py" in whole and "left out" not in whole

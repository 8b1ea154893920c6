"""Candidate files: ModelNew with the reference's constructor; errors name file and line."""

import pytest

from kforge.errors import CandidateError, KforgeError
from kforge.harness.candidate import load_candidate
from kforge.harness.evaluate import evaluate


@pytest.fixture
def run(write, problem_path, cpu, cpu_ceilings, fast_timing):
    def _run(problem: str, candidate_source: str):
        candidate = write("candidate.py", candidate_source)
        return evaluate(problem_path(problem), candidate, device=cpu, ceilings=cpu_ceilings, timing=fast_timing)

    return _run


def test_a_file_without_modelnew_is_a_candidate_error(run):
    record = run("add", "import torch\nclass Model(torch.nn.Module):\n    pass\n")
    assert record.status == "candidate_error" and record.exit_status == 2
    assert record.reason == "candidate defines no `ModelNew`"


def test_an_import_error_names_the_line(run):
    record = run("add", "import torch\nx = 1\nimport no_such_module_anywhere\n")
    assert record.status == "candidate_error"
    assert "ModuleNotFoundError" in record.reason and "candidate.py:3" in record.reason


def test_a_compile_error_at_import_is_a_candidate_error(run):
    record = run("add", "import torch\nclass ModelNew(torch.nn.Module)\n    pass\n")
    assert record.status == "candidate_error" and "SyntaxError" in record.reason


def test_a_constructor_mismatch_says_what_the_problem_passes(run):
    record = run("linear", """
        import torch
        class ModelNew(torch.nn.Module):
            def __init__(self):
                super().__init__()
            def forward(self, x):
                return x
    """)
    assert record.status == "candidate_error"
    assert record.reason.startswith("constructor mismatch")
    assert "[32, 24]" in record.details


def test_an_exception_in_forward_is_a_candidate_error_with_the_line(run):
    record = run("add", """
        import torch
        class ModelNew(torch.nn.Module):
            def forward(self, a, b):
                return a + b.reshape(2, -1)
    """)
    assert record.status == "candidate_error"
    assert record.reason.startswith("ModelNew raised: RuntimeError") and "candidate.py:4" in record.reason


def test_sys_exit_at_import_is_caught(run):
    record = run("add", "import sys\nsys.exit(0)\n")
    assert record.status == "candidate_error" and "SystemExit" in record.reason


def test_a_missing_file_is_refused_before_any_work(problem_path, cpu):
    with pytest.raises(KforgeError, match="candidate file not found"):
        evaluate(problem_path("add"), "/no/such/candidate.py", device=cpu)


def test_the_candidate_hash_identifies_its_content(write):
    one = load_candidate(write("a.py", "class ModelNew:\n    pass\n"))
    two = load_candidate(write("b.py", "class ModelNew:\n    pass\n"))
    three = load_candidate(write("c.py", "class ModelNew:\n    x = 1\n"))
    assert one.sha256 == two.sha256 != three.sha256


def test_candidates_may_import_helpers_from_their_own_folder(write):
    write("helpers_for_candidate.py", "SCALE = 3\n")
    candidate = load_candidate(write("cand.py", """
        from helpers_for_candidate import SCALE
        class ModelNew:
            scale = SCALE
    """))
    assert candidate.factory.scale == 3


def test_a_non_callable_modelnew_is_refused(write):
    with pytest.raises(CandidateError, match="not callable"):
        load_candidate(write("c.py", "ModelNew = 3\n"))


def test_a_folder_is_refused_as_a_folder_not_as_missing(tmp_path):
    from kforge.harness.loading import import_user_file

    with pytest.raises(KforgeError, match="is a folder, not a Python file"):
        import_user_file(tmp_path, KforgeError, "candidate")

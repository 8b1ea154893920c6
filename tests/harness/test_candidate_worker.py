"""The candidate's worker's own commands (kforge's code in it, no candidate needed), on a CPU."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import FIXTURES
from kforge.harness.candidate_worker import CandidateWorker
from kforge.harness.reference_worker import ReferenceWorker


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def workers(tmp_path, problem: str) -> tuple[ReferenceWorker, CandidateWorker]:
    """Both workers of one evaluation in this process, as judge.py sets them up."""
    arena = tmp_path / "arena"
    arena.touch()
    ref = ReferenceWorker({"problem": str(FIXTURES / "problems" / f"{problem}.py"), "size": "auto",
                           "device": "cpu", "baseline": "eager", "arena_file": str(arena)})
    setup = ref.setup(init_seed=1, probe_seed=2)
    cand = CandidateWorker(dict(candidate="unused", device="cpu", arena=setup["arena"], init=setup["init"],
                                inputs=setup["inputs"], mailboxes=setup["mailboxes"], init_seed=1,
                                forbidden_ops=[], own_inputs=not setup["mutates_inputs"]))
    return ref, cand


@pytest.mark.parametrize("problem, mutates", [("add", False), ("double_in_place", True)])
def test_prepare_does_the_same_work_in_both_workers_whether_or_not_the_reference_changes_its_inputs(
        tmp_path, problem, mutates):
    # On a GPU the device work of `prepare` decides when a timed call's window opens against
    # the judge's cover: a candidate's worker that copied nothing there (a reference that
    # changes its inputs) claimed ~0.65 ms of the cover as its own, and its honest calls
    # were rejected as forged (H200, 2026-11-29).
    ref, cand = workers(tmp_path, problem)
    assert ref.mutates_inputs is mutates
    ref.draw(seed=3)
    ref.prepare(), cand.prepare()  # the first allocates the candidate's buffers
    seen = {}
    for name, worker in (("reference", ref), ("candidate", cand)):
        with Ops() as ops:
            worker.prepare()
        seen[name] = ops.ops
    assert seen["candidate"] == seen["reference"] and seen["reference"], seen
    # and the timed call is fed the arena's views only where the reference changes its inputs
    arena_ptrs = {t.data_ptr() for t in cand.inputs if isinstance(t, torch.Tensor)}
    fed_ptrs = {t.data_ptr() for t in cand._feed() if isinstance(t, torch.Tensor)}
    assert (fed_ptrs == arena_ptrs) is mutates
    assert all(torch.equal(mine, shared) for mine, shared in zip(cand._feed(), cand.inputs))

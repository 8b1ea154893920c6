"""The reference worker's fingerprint of its own state: what the judge checks after every stage."""

import builtins
import sys

import torch
from torch.overrides import TorchFunctionMode

from conftest import FIXTURES
from kforge.harness.correctness import describe_output
from kforge.harness.reference_worker import ReferenceWorker


class Passthrough(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def worker(tmp_path) -> ReferenceWorker:
    arena = tmp_path / "arena"
    arena.touch()
    ref = ReferenceWorker({"problem": str(FIXTURES / "problems" / "linear.py"), "size": "auto", "device": "cpu",
                           "baseline": "eager", "arena_file": str(arena)})
    ref.setup(init_seed=1, probe_seed=2)
    return ref


def test_an_untouched_reference_keeps_its_fingerprint(tmp_path):
    ref = worker(tmp_path)
    ref.draw(seed=3)
    ref.reference()
    assert ref.state() == {"changed": []}


def test_zeroed_weights_a_mode_a_hook_or_a_flag_change_the_fingerprint(tmp_path):
    ref = worker(tmp_path)
    with torch.no_grad():
        next(ref.model.parameters()).zero_()
    assert ref.state()["changed"] == ["parameters"]

    ref = worker(tmp_path)
    with Passthrough():
        assert ref.state()["changed"] == ["torch_function_modes"]
    sys.setprofile(lambda *a: None)
    try:
        assert ref.state()["changed"] == ["profile_hook"]
    finally:
        sys.setprofile(None)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert ref.state()["changed"] == ["default_dtype"]
    finally:
        torch.set_default_dtype(default)


def test_running_out_of_memory_is_reported_as_such_not_as_a_bug():
    from kforge.harness.reference_worker import error_reply

    reply = error_reply(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 12.00 GiB"))["error"]
    assert reply["kind"] == "oom"
    assert "ran out of memory" in reply["reason"] and "12.00 GiB" in reply["reason"]
    assert error_reply(ValueError("boom"))["error"]["kind"] == "crash"


def _export(ref: ReferenceWorker, box: int, out: torch.Tensor) -> list[int]:
    """What the candidate's worker does after a timed call: its output into mailbox `box`."""
    from kforge.harness.shared import digest

    ref.mailboxes[box][0].copy_(out)
    return [digest(slot) for slot in ref.mailboxes[box]]


def test_each_mailbox_is_compared_on_its_own_and_a_bad_box_is_refused(tmp_path):
    ref = worker(tmp_path)
    ref.draw(seed=3)
    ref.reference()
    right, claims = ref.out, describe_output(ref.out)  # what the candidate's worker claims
    first = _export(ref, 0, torch.zeros_like(right))  # the round's first call: wrong
    second = _export(ref, 1, right)  # its second: right
    assert ref.compare(claims, second, box=1)["comparison"]["ok"]
    failed = ref.compare(claims, first, box=0)["comparison"]
    assert not failed["ok"] and failed["failure"] == "values", failed
    # a digest of one box does not vouch for the other, and a box that is not there fails
    assert ref.compare(claims, second, box=0)["comparison"]["failure"] == "late_output"
    assert ref.compare(claims, second, box=2)["comparison"]["failure"] == "structure"


def test_restore_writes_the_rounds_inputs_back_into_the_arena(tmp_path):
    ref = worker(tmp_path)
    ref.draw(seed=3)
    ref.slot[0].mul_(2)  # what a call on the arena's views of a mutating problem leaves
    assert not torch.equal(ref.slot[0], ref.pristine[0])
    ref.restore()
    assert torch.equal(ref.slot[0], ref.pristine[0])


def test_outputs_are_described_by_their_types_identity_not_their_names():
    # A subclass may take torch.Tensor's or tuple's name and do its work when the worker copies
    # or iterates it, after the clock: described as what it is, it fails the structure check.
    class Tensor(torch.Tensor):
        pass

    class tuple(builtins.tuple):  # noqa: A001  (named as the builtin it pretends to be)
        pass

    Tensor.__module__, Tensor.__qualname__ = "torch", "Tensor"
    plain = torch.ones(2)
    assert describe_output(plain)["output"]["type"] == "torch.Tensor"
    assert describe_output(plain.as_subclass(Tensor))["output"]["type"].startswith("subclass torch.Tensor")
    assert describe_output((plain, [plain])) == {"tuple": [describe_output(plain), {"list": [describe_output(plain)]}]}
    assert describe_output(tuple((plain,))) == {"other": "test_outputs_are_described_by_their_types_identity_not_"
                                                         "their_names.<locals>.tuple"}

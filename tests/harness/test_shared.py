"""The arena and the JSON that describes tensors in it: what crosses between the workers."""

import pytest
import torch

from kforge.harness.shared import ALIGN, Arena, Layout, SharedError, TensorSpec, describe, digest, rebuild, \
    tensor_leaves, write_values


@pytest.fixture
def arena(tmp_path):
    def make(values):
        layout = Layout()
        described = describe(values, layout.place)
        path = tmp_path / "arena"
        path.touch()
        return Arena.create(layout.size, torch.device("cpu"), path), described

    return make


def test_values_cross_with_their_shapes_strides_and_kinds(arena, tmp_path):
    x = torch.randn(5, 7)
    values = [x.t(), torch.arange(3, dtype=torch.int32), (2, 3.5, None, "tanh"), torch.float16]
    shared, described = arena(values)
    write_values(values, shared, described)
    other = Arena.open(shared.handle, torch.device("cpu"))  # as the candidate's worker maps it
    back = rebuild(described, other)
    assert back[0].stride() == x.t().stride() and torch.equal(back[0], x.t())
    assert torch.equal(back[1], values[1]) and back[2] == (2, 3.5, None, "tanh") and back[3] is torch.float16
    back[1][0] = 99  # the two mappings are one memory
    assert int(rebuild(described, shared)[1][0]) == 99


def test_an_expanded_view_is_laid_out_whole():
    spec = Layout().place(torch.randn(4).expand(3, 4))
    assert spec.stride == (4, 1), "a view whose elements share memory cannot be written element by element"


@pytest.mark.parametrize("spec", [
    {"offset": 0, "dtype": "float32", "shape": [2], "stride": [1], "extra": 1},
    {"offset": 0, "dtype": "torch.float32", "shape": [2], "stride": [1]},
    {"offset": -ALIGN, "dtype": "float32", "shape": [2], "stride": [1]},
    {"offset": 0, "dtype": "float32", "shape": [2, 2], "stride": [1]},
    {"offset": 0, "dtype": "float32", "shape": [-1], "stride": [1]},
    {"offset": 0, "dtype": "float32", "shape": [2], "stride": [-1]},
    {"offset": 0, "dtype": "float32", "shape": [True], "stride": [1]},
    {"offset": 0.0, "dtype": "float32", "shape": [2], "stride": [1]},
])
def test_a_malformed_spec_is_refused(spec):
    with pytest.raises(SharedError):
        TensorSpec.from_json(spec)


def test_a_spec_reaching_outside_the_arena_is_refused(arena):
    shared, _ = arena([torch.zeros(64)])
    size = shared.buffer.numel()
    for spec in (TensorSpec(size, "float32", (1,), (1,)), TensorSpec(0, "float32", (size,), (1,)),
                 TensorSpec(0, "float32", (2, 2), (size, 1)), TensorSpec(4, "float32", (1,), (1,))):
        with pytest.raises(SharedError):
            shared.view(spec)


@pytest.mark.parametrize("value", [{"tensor": {"offset": 0}}, {"list": 3}, {"value": [1]}, {"code": "1"},
                                   {"value": 1, "list": []}, [1]])
def test_a_malformed_description_is_refused(arena, value):
    shared, _ = arena([torch.zeros(4)])
    with pytest.raises(SharedError):
        rebuild(value, shared)


def test_only_shareable_values_are_described():
    with pytest.raises(SharedError, match="cannot cross"):
        describe([object()], Layout().place)


def test_the_digest_sees_a_single_changed_bit(arena):
    shared, described = arena([torch.zeros(1000, dtype=torch.float16)])
    (spec,) = tensor_leaves(described)
    view = shared.view(spec)
    view.copy_(torch.randn(1000).half())
    before = digest(view)
    view.view(torch.int16)[517] ^= 1
    assert digest(view) != before
    assert digest(torch.empty(0)) == 0

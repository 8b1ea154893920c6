"""GraphedCall: on the CPU fn is simply called; on a GPU, replays equal eager bit for bit on
fresh inputs (a Triton kernel of ours and torch ops inside), returned outputs stay as they
were, new shapes and moved parameters capture again, the cache stays bounded,
fresh_output=False hands back one buffer, an uncapturable fn runs eagerly after one warning
(leaving the allocator sound), and inside an outer capture fn is called directly."""

import warnings

import pytest
import torch
from torch import nn

from kforge.kernels.serving.norms import layer_norm_forward
from kforge.runtime.graphs import GraphedCall, parameter_addresses


class Counted:
    """fn, counting its calls: Python runs only in eager calls and captures, never in replays."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args):
        self.calls += 1
        return self.fn(*args)


def norm_then_torch(x, weight, bias):
    """One of our Triton kernels, then torch ops on its output and on an input."""
    return layer_norm_forward(x, weight, bias) * 2 + x


def inputs(seed, rows=64, hidden=256, device="cuda"):
    """x, a LayerNorm weight and bias: one input set of norm_then_torch, in bf16."""
    g = torch.Generator().manual_seed(seed)
    shapes = ((rows, hidden), (hidden,), (hidden,))
    return tuple(torch.randn(shape, generator=g).to(device=device, dtype=torch.bfloat16) for shape in shapes)


def test_on_the_cpu_fn_is_called_directly():
    fn, key_reads = Counted(norm_then_torch), []
    graphed = GraphedCall(fn, extra_key=lambda: key_reads.append(1))
    sets = [inputs(seed, device="cpu") for seed in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no capture attempted, so none failed
        outs = [graphed(*s) for s in sets]
    assert fn.calls == 3 and len(graphed) == 0 and not key_reads
    for out, s in zip(outs, sets):
        assert torch.equal(out, norm_then_torch(*s))


def test_parameter_addresses_follow_the_parameters():
    layer = nn.Linear(4, 3)
    addresses = parameter_addresses(layer)
    before = addresses()
    assert before == (layer.weight.data_ptr(), layer.bias.data_ptr())
    layer.weight.data = layer.weight.data.clone()  # what .to(device) does to every parameter
    assert addresses() != before and addresses()[1] == before[1]


def test_max_graphs_must_be_positive():
    with pytest.raises(ValueError, match="max_graphs"):
        GraphedCall(norm_then_torch, max_graphs=0)


# --- on the GPU ------------------------------------------------------------------------------

@pytest.mark.gpu
def test_replays_equal_eager_bit_for_bit_on_fresh_inputs():
    fn = Counted(norm_then_torch)
    graphed = GraphedCall(fn)
    sets = [inputs(seed) for seed in range(3)]
    expected = [norm_then_torch(*s) for s in sets]
    got = [graphed(*s) for s in sets] + [graphed(*s) for s in reversed(sets)]
    assert fn.calls == 2  # the first call's eager run and its capture; the other five were replays
    # a replay that did not copy its inputs in would give the first set's answer again
    for out, want in zip(got, expected + expected[::-1]):
        assert torch.equal(out, want)


@pytest.mark.gpu
def test_a_returned_output_is_not_changed_by_later_calls():
    graphed = GraphedCall(norm_then_torch)
    a, b, c = (inputs(seed) for seed in range(3))
    graphed(*a)
    replayed = graphed(*b)
    kept = replayed.clone()
    graphed(*c)
    graphed(*a)
    assert torch.equal(replayed, kept)


@pytest.mark.gpu
def test_a_new_shape_is_captured_again():
    fn = Counted(norm_then_torch)
    graphed = GraphedCall(fn)
    small, large = inputs(0, rows=16), inputs(1, rows=96)
    graphed(*small)
    graphed(*small)
    assert fn.calls == 2
    assert torch.equal(graphed(*large), norm_then_torch(*large))
    assert fn.calls == 4 and len(graphed) == 2
    assert torch.equal(graphed(*small), norm_then_torch(*small)) and fn.calls == 4


@pytest.mark.gpu
def test_the_cache_keeps_at_most_max_graphs_dropping_the_least_recently_used():
    fn = Counted(norm_then_torch)
    graphed = GraphedCall(fn, max_graphs=2)
    by_rows = {rows: inputs(rows, rows=rows) for rows in (16, 32, 48)}
    for rows in (16, 32, 48):
        graphed(*by_rows[rows])
    assert len(graphed) == 2 and fn.calls == 6  # 16 was dropped
    graphed(*by_rows[32])  # a replay, and now the most recently used
    assert fn.calls == 6
    assert torch.equal(graphed(*by_rows[16]), norm_then_torch(*by_rows[16]))  # captured again, dropping 48
    assert fn.calls == 8 and len(graphed) == 2
    graphed(*by_rows[32])
    assert fn.calls == 8
    graphed(*by_rows[48])
    assert fn.calls == 10


@pytest.mark.gpu
def test_fresh_output_false_hands_back_the_graphs_own_buffer():
    graphed = GraphedCall(norm_then_torch, fresh_output=False)
    a, b, c = (inputs(seed) for seed in range(3))
    first = graphed(*a)  # the eager run's own result
    second = graphed(*b)
    assert torch.equal(second, norm_then_torch(*b))
    second_values = second.clone()
    third = graphed(*c)
    assert torch.equal(third, norm_then_torch(*c))
    assert third.data_ptr() == second.data_ptr() != first.data_ptr()
    assert not torch.equal(second, second_values)  # overwritten: why the caller must use it at once


@pytest.mark.gpu
def test_moved_parameters_are_captured_again():
    norm = nn.LayerNorm(256, dtype=torch.bfloat16, device="cuda")

    def normed(x):
        return layer_norm_forward(x, norm.weight, norm.bias)

    fn = Counted(normed)
    graphed = GraphedCall(fn, extra_key=parameter_addresses(norm))
    x = inputs(0)[0]
    graphed(x)
    graphed(x)
    assert fn.calls == 2
    norm.weight.data = norm.weight.data * 2  # new memory, as .to(device) gives every parameter
    assert torch.equal(graphed(x), normed(x)) and fn.calls == 4  # a replay would read the old weight
    assert torch.equal(graphed(x), normed(x)) and fn.calls == 4


def scaled_by_the_mean(x, weight, bias):
    """Reads a value on the host: the sync in .item() cannot be captured."""
    return layer_norm_forward(x, weight, bias) * x.float().mean().item()


@pytest.mark.gpu
def test_a_function_that_cannot_be_captured_runs_eagerly_after_one_warning():
    graphed = GraphedCall(scaled_by_the_mean)
    sets = [inputs(seed) for seed in range(3)]
    with pytest.warns(RuntimeWarning) as caught:
        outs = [graphed(*s) for s in sets] + [graphed(*sets[0])]
    ours = [w for w in caught if "cannot capture a CUDA graph" in str(w.message)]
    assert len(ours) == 1 and "scaled_by_the_mean" in str(ours[0].message)
    assert len(graphed) == 1
    for out, s in zip(outs, sets + [sets[0]]):
        assert torch.equal(out, scaled_by_the_mean(*s))
    # the failed capture left the caching allocator sound: it empties, and the next capture works
    torch.cuda.empty_cache()
    fn = Counted(norm_then_torch)
    working = GraphedCall(fn)
    working(*sets[0])
    assert torch.equal(working(*sets[1]), norm_then_torch(*sets[1])) and fn.calls == 2


@pytest.mark.gpu
def test_inside_an_outer_capture_fn_is_called_directly():
    fn = Counted(norm_then_torch)
    graphed = GraphedCall(fn)
    a, b = inputs(0), inputs(1)
    norm_then_torch(*a)  # compile the Triton kernel before the capture
    static_x = a[0].clone()
    outer = torch.cuda.CUDAGraph()
    with torch.cuda.graph(outer):
        out = graphed(static_x, a[1], a[2])
    assert fn.calls == 1 and len(graphed) == 0  # captured into the outer graph, no graph of its own
    static_x.copy_(b[0])
    outer.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, norm_then_torch(b[0], a[1], a[2]))

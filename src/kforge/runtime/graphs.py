"""Replay a whole forward as one CUDA graph: `GraphedCall(fn)` behaves like `fn(*tensors) -> Tensor`.

    forward = GraphedCall(model.forward_on_kernels, extra_key=parameter_addresses(model))
    out = forward(x)      # first call per input key: eager (Triton compiles, autotunes), then a capture
    out = forward(x2)     # later calls: copy x2 into the graph's input, one replay, clone the output

What it saves. Launching from Python costs host time per kernel (Triton's JITFunction.run
specializes the arguments, an autotuner dispatches, torch.empty makes scratch: ~60-150 us a
launch), and the harness counts a call as max(device time, host time). A forward of 7 or
30 launches can spend longer issuing its work than the GPU spends doing it. A replay issues
every captured launch with one cudaGraphLaunch: microseconds of host time, not milliseconds.

What it costs, per call: one device copy of each input into the graph's static input
buffer, and by default one copy of the output (`fresh_output`): the graph writes the same
memory on every replay, so handing that memory out would let a later call change a tensor
already returned (the harness keeps outputs, and poisons freed memory). With
`fresh_output=False` the call returns the graph's output buffer itself: valid only until the
next call for the same input key overwrites it, so only for a caller that consumes it at
once, on the same stream (a final GEMM that writes a fresh tensor). Once per key: the eager
call, the clones of the inputs, the capture and its private memory pool (every intermediate
of the forward), kept for at most `max_graphs` keys (least recently used evicted).

When it is wrong. A graph replays the launches of the capture with the launch parameters of
the capture: the same grids, the same pointers, the same scalar arguments. So fn must not
 - choose its work from tensor VALUES read on the host (`.item()`, `.tolist()`, an `if` on a
   tensor, data-dependent shapes such as nonzero's): a replay repeats the capture's choice.
   Reading a CUDA tensor's value synchronizes, which fails the capture (see below); a host
   value that needs no sync (a CPU tensor's, a Python counter's) is frozen silently;
 - change its inputs in place: the replay changes the graph's static copies, never the
   caller's tensors. This is forbidden, not detected (a kernel's writes cannot be seen);
 - read module state whose memory moves: the graph holds the addresses of every tensor it
   read. `extra_key` is how a caller keys on them: `parameter_addresses(module)` makes a model
   moved with `.to(device)` capture again. State updated in place (same address) is fine.
The output carries no autograd history: the capture runs under torch.no_grad(). Inputs are
matched by shape, stride, dtype and device: a new shape or layout is a new capture.

Falling back. On a tensor not on a CUDA device (the CPU, Triton's interpreter), with no
tensor arguments, or inside someone else's capture, fn is called directly. If a capture
fails (an op that cannot be captured: a host sync, `.item()`), the key is remembered as
eager, `warnings.warn` says why once, and every call for it runs fn eagerly: a forward never
crashes for being graphed.

The harness's forbidden-op recorder (a TorchDispatchMode) sees the aten ops fn dispatches
during the eager call and the capture of each key, i.e. on the first calls only; a replay
dispatches only the input copies and the output clone.

One thread at a time; replays run on the caller's current stream, in order with its work.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch
from torch import nn

DEFAULT_MAX_GRAPHS = 4


@dataclass(frozen=True)
class _Captured:
    """One key's graph and the buffers it reads and writes on every replay."""

    graph: torch.cuda.CUDAGraph
    static_inputs: tuple[torch.Tensor, ...]
    static_output: torch.Tensor


_RUN_EAGERLY = None  # a key whose capture failed
_NOT_SEEN = object()


class GraphedCall:
    """`fn(*tensors) -> Tensor`, replayed as a CUDA graph per input key (see the module docstring).

    extra_key: called on every CUDA call, its result joins the key: the addresses of the state
        fn reads (e.g. `parameter_addresses(module)`), so that state moving means a new capture.
    fresh_output: True, each call returns new memory (a clone of the graph's output). False,
        the graph's own output buffer, which the next call for the same key overwrites.
    max_graphs: how many keys keep their graph (and its memory pool); the least recently
        used is dropped beyond that.
    """

    def __init__(self, fn: Callable[..., torch.Tensor], *, extra_key: Callable[[], Hashable] | None = None,
                 fresh_output: bool = True, max_graphs: int = DEFAULT_MAX_GRAPHS):
        if max_graphs < 1:
            raise ValueError(f"max_graphs must be at least 1, got {max_graphs}")
        self.fn, self.extra_key, self.fresh_output, self.max_graphs = fn, extra_key, fresh_output, max_graphs
        self._by_key: OrderedDict[Hashable, _Captured | None] = OrderedDict()

    def __len__(self) -> int:
        """How many input keys are remembered (captured, or failed and run eagerly)."""
        return len(self._by_key)

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        if not inputs or not all(isinstance(t, torch.Tensor) and t.is_cuda for t in inputs):
            return self.fn(*inputs)
        if torch.cuda.is_current_stream_capturing():  # an outer capture records fn's launches itself
            return self.fn(*inputs)
        key = (tuple((t.shape, t.stride(), t.dtype, t.device) for t in inputs),
               self.extra_key() if self.extra_key is not None else None)
        captured = self._by_key.get(key, _NOT_SEEN)
        if captured is _NOT_SEEN:
            return self._first_call(key, inputs)
        self._by_key.move_to_end(key)
        if captured is _RUN_EAGERLY:
            return self.fn(*inputs)
        for static, given in zip(captured.static_inputs, inputs):
            static.copy_(given)
        captured.graph.replay()
        return captured.static_output.clone() if self.fresh_output else captured.static_output

    def _first_call(self, key: Hashable, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Run fn eagerly (the warm-up: a capture cannot compile or autotune), then capture it."""
        with torch.no_grad():
            output = self.fn(*inputs)
        try:
            captured = self._capture(inputs)
        except Exception as error:
            shapes = ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in inputs)
            warnings.warn(f"GraphedCall({getattr(self.fn, '__qualname__', self.fn)!s}): cannot capture a CUDA graph "
                          f"for inputs {shapes} ({type(error).__name__}: {error}); calling it eagerly for them",
                          RuntimeWarning, stacklevel=3)
            captured = _RUN_EAGERLY
        self._by_key[key] = captured
        while len(self._by_key) > self.max_graphs:
            self._by_key.popitem(last=False)
        return output

    def _capture(self, inputs: tuple[torch.Tensor, ...]) -> _Captured:
        """Capture fn on clones of `inputs` on a side stream (capture refuses the default stream).
        Nothing runs during a capture; the first replay is the next call's."""
        device = inputs[0].device
        pool = torch.cuda.graph_pool_handle()
        with torch.no_grad():
            static_inputs = tuple(t.clone() for t in inputs)
        with torch.cuda.device(device):
            graph, static_output = capture_graph(lambda: self.fn(*static_inputs), pool=pool,
                                                 stream=torch.cuda.Stream(device), device_index=device.index)
        if not isinstance(static_output, torch.Tensor):
            raise TypeError(f"fn must return one tensor to be graphed, it returned {type(static_output).__name__}")
        return _Captured(graph, static_inputs, static_output)


def capture_graph(fn: Callable[[], object], *, pool, stream: torch.cuda.Stream, device_index: int
                  ) -> tuple[torch.cuda.CUDAGraph, object]:
    """fn's launches captured into a new graph on `stream` (capture refuses the default
    stream), its allocations in `pool`, and fn's return value. If the capture fails, the
    pool's allocator bookkeeping is mended (`_stop_allocating_to`) and the error raised."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.no_grad():
        try:
            # thread_local: an unsafe call from this thread fails the capture; other threads are left alone
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                output = fn()
            except BaseException:
                with contextlib.suppress(Exception):  # fn's exception is the one to report
                    graph.capture_end()
                raise
            graph.capture_end()
        except BaseException:
            _stop_allocating_to(pool, device_index)
            raise
    return graph, output


def _stop_allocating_to(pool, device_index: int) -> None:
    """After a failed capture, the allocator bookkeeping CUDAGraph.capture_end skipped.

    When CUDA invalidated a capture, capture_end raises at cudaStreamEndCapture, before it
    tells the caching allocator that the capture is over, and the graph never releases the
    pool it allocated into. Left so, the allocator would count a capture underway forever:
    it stops recycling memory freed across streams (and some torch versions fail an internal
    assert in torch.cuda.empty_cache()). These are the calls torch.cuda.use_mem_pool makes on
    leaving."""
    try:
        torch._C._cuda_endAllocateToPool(device_index, pool)
    except RuntimeError:  # not recording to it: capture_begin never got that far, or capture_end
        return  # got past it, so the graph releases the pool (or, failing in between, leaks it: never twice)
    torch._C._cuda_releasePool(device_index, pool)


def parameter_addresses(module: nn.Module) -> Callable[[], tuple[int, ...]]:
    """An `extra_key` for a module's forward: where each of its parameters lives now, so a model
    moved (`.to(device)`) or given new parameter tensors captures again instead of replaying on
    memory it no longer owns. Parameters only: a module whose buffers move on their own needs
    its own key. ~1 us a parameter of host time per call."""
    return lambda: tuple(p.data_ptr() for p in module.parameters())

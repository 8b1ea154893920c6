"""Programmatic dependent launch (PDL): a kernel may start while the kernel before it in its
stream finishes, and waits in place for that kernel's results.

Why: a Llama-3-8B decode step at batch 1 is ~330 kernels of 1-60 us (scripts/decode_profile.py),
and each starts cold: its blocks are scheduled once the kernel before has completed, and its
first weight bytes arrive a DRAM round trip after that. The weights do not depend on the kernel
before; only the activations do. On Hopper (sm_90+) a kernel launched with the programmatic-
stream-serialization attribute may begin once every block of the kernel before it has run
`griddepcontrol.launch_dependents` or exited, before that kernel's completion is settled.

The contract every kernel built for PDL keeps (`kernels/hopper/pdl.cuh` for CUDA, `gdc_wait` in
the Triton kernels):
1. before `griddepcontrol.wait` it reads nothing another kernel of the step writes and writes
   nothing: it may only prefetch its own weights, read-only for the whole step;
2. it waits, in every thread that reads or writes step data. The wait returns once the kernel
   before it has completed with its writes visible, which, each kernel having waited for the one
   before, covers every earlier kernel;
3. it never runs `launch_dependents`: the next kernel launches as this one's blocks exit. Run
   right after the wait, the signal let the next kernel's blocks sit resident through this
   one's main loop and its prefetch compete with this one's stream: the bf16 step lost 0.16 ms
   (H200, docs/worklogs/models.md).
A launcher attaches the attribute only to the build that keeps the contract (`enabled` chooses
both). A kernel launched without it, torch's or ours outside `chained`, is serialized as usual,
and a PDL kernel after it waits for it like for any other.

`chained()` turns it on for the launches made under it, on a GPU that has it: the Llama engine's
decode step (kforge.models.llama.model.PDL_DECODE). Outside, every launch is as before.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

# CUlaunchAttributeID: CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (cuda.h, CUDA 12 and 13)
PROGRAMMATIC_STREAM_SERIALIZATION = 6
MIN_CAPABILITY = (9, 0)

_CHAINED: contextvars.ContextVar[bool] = contextvars.ContextVar("kforge_pdl_chained", default=False)
_CAPABLE: dict[int, bool] = {}


@contextlib.contextmanager
def chained(on: bool = True) -> Iterator[None]:
    """Launch the kernels that support it with PDL inside the block (`on` False: without)."""
    token = _CHAINED.set(on)
    try:
        yield
    finally:
        _CHAINED.reset(token)


def enabled(device: torch.device) -> bool:
    """Whether a launch on `device` made now goes with PDL: inside `chained()`, on a CUDA GPU of
    compute capability 9.0 or later."""
    if not _CHAINED.get() or device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    capable = _CAPABLE.get(index)
    if capable is None:
        capable = _CAPABLE[index] = torch.cuda.get_device_capability(index) >= MIN_CAPABILITY
    return capable


def triton_options(on: bool) -> dict:
    """The launch keywords of a Triton kernel that takes `PDL: tl.constexpr`: the build with
    `gdc_wait` and the attribute together, or nothing (the kernel's default build)."""
    return {"PDL": True, "launch_pdl": True} if on else {}

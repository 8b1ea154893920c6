"""Weights into L2 ahead of the kernel that reads them: `prefetch_l2(tensors, max_bytes)`.

A decode step at batch 1 streams every weight once, but not all the time: between the GEMVs run
kernels that barely touch HBM (attention over a short context reads ~2 MB a layer of llama3-8b,
the norms and RoPE kilobytes), and each GEMV spends its first microseconds ramping up to the read
rate. `l2_prefetch.cu` asks the memory system to bring the next GEMV's first bytes into L2 during
those kernels: one launch of a few blocks, each thread issuing `cp.async.bulk.prefetch.L2` for its
chunks and exiting. Nothing waits; the copy engine fills L2 while the step goes on, and the GEMV
then finds its first rows there. Only a hint: the same bytes, the same results.

`max_bytes` caps the total taken from the ranges in order (a tensor's prefix, the first rows of a
row-major weight: the ones the GEMV's first blocks read), so that the prefetched bytes fit L2
with room for what the kernels in between touch.

On a GPU without the instruction (before sm_90), on the CPU, or for tensors whose storage does not
start on 16 bytes, the call does nothing: it never changes a result.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("l2_prefetch.cu")
KINDS = ("ptr",) * 4 + ("i32",) * 5
MAX_RANGES = 4
CHUNK_BYTES = 16 * 1024  # one instruction's range
THREADS = 32
MAX_BLOCKS = 64

_KERNEL = None
_LAUNCHES: dict[tuple[int, int], object] = {}


def plan_ranges(tensors: Sequence[torch.Tensor], max_bytes: int | None) -> list[tuple[int, int]]:
    """(address, bytes) of each tensor's prefix to prefetch: in order, their total at most `max_bytes`
    (None: all), each a multiple of 16 bytes and under 2 GiB (the kernel's int sizes). Raises
    ValueError for more than four tensors or a negative budget."""
    if len(tensors) > MAX_RANGES:
        raise ValueError(f"prefetch_l2 takes at most {MAX_RANGES} tensors, got {len(tensors)}")
    if max_bytes is not None and max_bytes < 0:
        raise ValueError(f"prefetch_l2: max_bytes must be >= 0, got {max_bytes}")
    left = float("inf") if max_bytes is None else max_bytes
    ranges = []
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError(f"prefetch_l2 takes contiguous tensors (a byte range each), got strides {t.stride()}")
        size = int(min(t.numel() * t.element_size(), left, 2**31 - 16)) // 16 * 16
        ranges.append((t.data_ptr(), size))
        left -= size
    return ranges


def supported(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.get_device_capability(t.device) >= (9, 0)


def prefetch_l2(tensors: Sequence[torch.Tensor], max_bytes: int | None = None) -> None:
    """Ask for the tensors' bytes (a prefix of `max_bytes` in all, None: every byte) to be brought into
    L2 asynchronously, on the current stream; capturable in a CUDA graph. A no-op where unsupported
    (see the module docstring)."""
    tensors = [t for t in tensors if t.numel()]
    if not tensors or not supported(tensors[0]):
        return
    ranges = [(address, size) for address, size in plan_ranges(tensors, max_bytes) if size and address % 16 == 0]
    if not ranges:
        return
    total = sum(size for _, size in ranges)
    blocks = min(MAX_BLOCKS, -(-total // (CHUNK_BYTES * THREADS)))
    index = tensors[0].device.index
    launch = _launch(index, blocks)
    ranges += [(0, 0)] * (MAX_RANGES - len(ranges))
    launch(torch._C._cuda_getCurrentRawStream(index), *(a for a, _ in ranges), *(s for _, s in ranges), CHUNK_BYTES)


def _launch(index: int, blocks: int):
    global _KERNEL
    launch = _LAUNCHES.get((index, blocks))
    if launch is None:
        if _KERNEL is None:
            from kforge.runtime.cuda import CudaKernel

            _KERNEL = CudaKernel.from_file(SOURCE, "l2_prefetch")
        launch = _LAUNCHES[(index, blocks)] = _KERNEL.lean(blocks, THREADS, index, kinds=KINDS)
    return launch

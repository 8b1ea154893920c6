"""The decode step as CUDA graphs, one per batch bucket: a step of decodes alone is one replay.

    graphs = DecodeGraphs(model, cache, max_batch=8, max_context=2048)
    logits = graphs([(slot, position, token), ...])   # (n, vocab) fp32; advances the slots' lengths

Why: at small batch a decode step is bound by the host, not the GPU. Each layer launches
about ten kernels from Python, tens of microseconds of host time apiece on Triton's launch
path (runtime/graphs.py), and `Llama.forward` builds its index tensors from Python lists,
while the GPU spends a few microseconds on most of those kernels. A replay issues every
launch of the step with one cudaGraphLaunch.

How:
- Buckets. A graph replays fixed shapes, so a step of n decodes runs the graph of the
  smallest bucket >= n (`decode_buckets`: 1, 2, 4, 8, 16, 24, 32, 48, 64, 96, ... up to
  max_batch); its other rows are padding.
- Static inputs. Each bucket's graph reads one (3, bucket) int64 tensor: the tokens, the
  positions and the slots. A step copies its rows there from the host in one transfer;
  the rest is computed on the device inside the graph (`Llama.decode`): the block-table
  rows gathered by slot, the lengths before the append equal to the positions. The logits
  land in one (max_batch, vocab) fp32 buffer shared by every bucket; a step returns its
  first n rows, valid until the next step.
- Padding. A padded row is token 0 at position 0 of the cache's pad slot, whose
  block-table row names only the scratch page (`KVCache`): it appends its K and V at
  position 0 of that page and attends over that one token. No sequence's page is
  written, every op is row by row (a real row's result never reads a padded one), and
  only the real slots' lengths are advanced.
- Capture, per bucket at its first step (or every bucket up front: `warmup`, largest
  first): one eager run with every row padding (Triton compiles and autotunes, the GEMMs
  make their launch plans; it writes only the scratch page), then the capture on a side
  stream, into one memory pool shared by all buckets. Sharing is safe because one graph
  replays at a time and nothing allocated in the pool outlives a replay.
- What the captured code must not do, and why it does not: read a device value on the
  host (every op is called with validate=False; the paged decode kernel sizes its
  partitions from the block table's width, not the lengths), build a tensor from host
  values, or size anything by the step's values (the RoPE table is built once for
  max_context and held here, so its address never moves).
- Weight formats: each captures as it runs eagerly. bf16 takes the decode GEMV up to 16
  rows and the GEMM ladder beyond; W4A16 its CUDA kernels up to 32 rows, and beyond that
  dequantizes each weight inside the graph, a transient in the pool as large as the
  largest weight in bf16; FP8 quantizes the activations and runs the block-scaled GEMM.
  Their launch plans and TMA descriptors are made on the host at the eager run or at
  capture, and a captured launch keeps its arguments by value.

A graph holds the addresses of everything it reads: the weights, the cache, the RoPE
table, the static buffers. The model must not move (`.to`) or be quantized again while
the graphs live. If a capture fails (an op that cannot be captured), that bucket runs the
same padded step eagerly, with one warning. Off CUDA (a CPU) every step runs the padded
step eagerly: the path the CPU tests compare with the unpadded forward.
"""

from __future__ import annotations

import bisect
import warnings

import torch

from kforge.models.llama.model import KVCache, Llama
from kforge.runtime.graphs import capture_graph


def decode_buckets(max_batch: int) -> tuple[int, ...]:
    """The batch sizes that get a graph: 1, 2, 4, 8, 16, then 1.5x and 2x each power of two
    (24, 32, 48, 64, 96, ...), those past max_batch replaced by max_batch itself. Beyond 16
    rows at most a third of a replay is padding."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes, power = [1, 2, 4, 8, 16], 16
    while sizes[-1] < max_batch:
        sizes += [power * 3 // 2, power * 2]
        power *= 2
    return (*(s for s in sizes if s < max_batch), max_batch)


class DecodeGraphs:
    """Decode steps of up to `max_batch` rows on `model` and `cache`, padded to a bucket and
    replayed as CUDA graphs on a GPU, run eagerly elsewhere (module docstring)."""

    def __init__(self, model: Llama, cache: KVCache, *, max_batch: int, max_context: int):
        self.model, self.cache = model, cache
        self.buckets = decode_buckets(max_batch)
        self.device = cache.k.device
        self.capture = self.device.type == "cuda"
        self.rope = model.rope(max_context)  # held: a graph reads it where it lies
        self._inputs = {b: torch.zeros((3, b), dtype=torch.long, device=self.device) for b in self.buckets}
        self._logits = torch.zeros((max_batch, model.config.vocab_size), dtype=torch.float32, device=self.device)
        self._graphs: dict[int, torch.cuda.CUDAGraph | None] = {}  # None: the capture failed, run eagerly
        if self.capture:
            self._pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream(self.device)

    @property
    def captured(self) -> tuple[int, ...]:
        """The buckets replayed as graphs so far (one whose capture failed runs eagerly: not among them)."""
        return tuple(b for b in self.buckets if self._graphs.get(b) is not None)

    def bucket(self, n: int) -> int:
        """The smallest bucket that holds n rows."""
        if not 1 <= n <= self.buckets[-1]:
            raise ValueError(f"a decode step takes 1 to {self.buckets[-1]} rows, got {n}")
        return self.buckets[bisect.bisect_left(self.buckets, n)]

    def __call__(self, decodes: list[tuple[int, int, int]]) -> torch.Tensor:
        """Logits (len(decodes), vocab) in fp32 for decodes given as (slot, position, token),
        a view of a buffer the next call overwrites. Appends their K and V to the cache and
        advances their slots' lengths."""
        n = len(decodes)
        bucket = self.bucket(n)
        if self.capture and bucket not in self._graphs:
            self._graphs[bucket] = self._capture(bucket)
        pad = bucket - n
        rows = [[token for _, _, token in decodes] + [0] * pad,
                [position for _, position, _ in decodes] + [0] * pad,
                [slot for slot, _, _ in decodes] + [self.cache.pad_slot] * pad]
        self._inputs[bucket].copy_(torch.tensor(rows, dtype=torch.long))
        graph = self._graphs.get(bucket)
        if graph is not None:
            graph.replay()
        else:
            self._step(bucket)
        for slot, _, _ in decodes:
            self.cache.lengths[slot] += 1
        return self._logits[:n]

    def warmup(self) -> None:
        """Capture every bucket's graph now, largest first (the shared pool is sized once, by
        the largest), instead of at each bucket's first step. Nothing to do off CUDA."""
        if self.capture:
            for bucket in reversed(self.buckets):
                if bucket not in self._graphs:
                    self._graphs[bucket] = self._capture(bucket)

    def _step(self, bucket: int) -> None:
        """The padded step on the bucket's static buffers: what a graph captures and replays."""
        tokens, positions, slots = self._inputs[bucket]
        self._logits[:bucket].copy_(self.model.decode(tokens, positions, slots, self.cache, self.rope))

    def _padding(self, bucket: int) -> torch.Tensor:
        rows = torch.zeros((3, bucket), dtype=torch.long)
        rows[2] = self.cache.pad_slot
        return rows

    def _capture(self, bucket: int) -> torch.cuda.CUDAGraph | None:
        """The bucket's graph, after one eager run (a capture cannot compile, autotune or make
        launch plans), both with every row padding; None, with a warning, if it cannot be captured."""
        self._inputs[bucket].copy_(self._padding(bucket))
        self._step(bucket)
        torch.cuda.synchronize(self.device)
        try:
            graph, _ = capture_graph(lambda: self._step(bucket), pool=self._pool, stream=self._stream,
                                     device_index=self.device.index)
        except Exception as error:  # noqa: BLE001  (whatever stops a capture, the step still runs, eagerly)
            warnings.warn(f"decode steps of {bucket} rows cannot be captured as a CUDA graph "
                          f"({type(error).__name__}: {error}); they run eagerly", RuntimeWarning, stacklevel=3)
            return None
        return graph

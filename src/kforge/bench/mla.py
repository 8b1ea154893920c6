"""MLA decode benchmark: `mla_decode`'s default (on an sm_90 GPU the CUDA kernel, decode_hopper.cu;
elsewhere the Triton split-KV kernels) against a PyTorch
composition (gather the paged latent cache, SDPA over it with the heads folded into the query
axis), at FlashMLA's shapes: B = 128, S_K in {4096, 8192, 16384}, H_Q in {16, 32, 64, 128},
S_Q in {1, 2}, causal.

Each shape is `problems/deepseek/mla_decode_bf16.py` sized, evaluated like `kforge bench
serving`: ours against the eager composition and against its torch.compile, each its own
interleaved timing; the record's roofline holds the FLOPs and the minimum bytes, so TFLOP/s,
GB/s and the % of the measured roof (copy bandwidth for the memory-bound shapes, the bf16
matmul rate for the compute-bound ones) come from it. `mla_jobs(mla_shapes())` is what a
`kforge bench mla` command runs; `mla_label` names a record's shape for `bench_rows`. Measured
on all 26 shapes (H200, the CUDA kernel): 2-9x the compositions, 77-91% of copy where
memory-bound, 435-513 TFLOP/s where compute-bound (docs/deepseek.md).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from kforge.bench import BenchJob, size_constants

PROBLEM = Path(__file__).parent.parent / "problems" / "deepseek" / "mla_decode_bf16.py"
KERNELS = [Path(__file__).parent.parent / "kernels" / "mla" / name
           for name in ("decode.py", "decode_hopper.py", "decode_hopper.cu")]  # what "ours" runs
BASELINES = ("eager", "compile")
BASELINE = "eager"  # the column `bench_rows` and `bench_view` compare against
BATCH = 128
CONTEXTS = (4096, 8192, 16384)
HEADS = (16, 32, 64, 128)
QUERY_TOKENS = (1, 2)


@dataclass(frozen=True)
class MlaShape:
    batch: int
    s_k: int
    h_q: int
    s_q: int
    ragged: bool = False

    @property
    def label(self) -> str:
        return f"mla B={self.batch} s_k={self.s_k} h_q={self.h_q} s_q={self.s_q}{' ragged' if self.ragged else ''}"

    @property
    def sizes(self) -> dict[str, int]:
        return {"B": self.batch, "S_K": self.s_k, "H_Q": self.h_q, "S_Q": self.s_q, "RAGGED": int(self.ragged)}


def mla_shapes() -> list[MlaShape]:
    """FlashMLA's 24 shapes, then two ragged batches (the split planner's case)."""
    shapes = [MlaShape(BATCH, s_k, h_q, s_q) for s_k in CONTEXTS for h_q in HEADS for s_q in QUERY_TOKENS]
    return shapes + [MlaShape(BATCH, 8192, 16, 1, ragged=True), MlaShape(BATCH, 8192, 128, 2, ragged=True)]


class OursMla:
    """mla_decode (not the op: no custom-op dispatch, no device read), the problem's scale, causal."""

    def __call__(self, q, kv_cache, block_table, cache_seqlens):
        from kforge.kernels.mla.decode import mla_decode
        from kforge.problems.deepseek.mla_decode_bf16 import SCALE

        return mla_decode(q, kv_cache, block_table, cache_seqlens, 512, softmax_scale=SCALE, causal=True,
                          validate=False)[0]


def mla_jobs(shapes: Sequence[MlaShape]) -> Iterator[BenchJob]:
    """Ours against the eager composition, then against its torch.compile, shape by shape."""
    from kforge.harness.problem import load_problem
    from kforge.ladder import source_candidate

    for shape in shapes:
        problem = load_problem(PROBLEM, "full", shape.sizes)
        candidate = source_candidate("ours", OursMla, [*KERNELS, Path(__file__)], shape.sizes)
        for baseline in BASELINES:
            yield BenchJob(f"{shape.label} vs {baseline}", problem, candidate, baseline)


def mla_label(record: dict) -> str:
    sizes = size_constants(record)
    return MlaShape(sizes["B"], sizes["S_K"], sizes["H_Q"], sizes["S_Q"], bool(sizes.get("RAGGED", 0))).label

"""`kforge bench gemm`: our best bf16 GEMM and the Triton kernel against cuBLAS, shape by shape.

Squares 1024-8192 (C = A @ B) and the Llama-3 8B/70B projections (y = x W^T) at 16, 128
and 4096 tokens; the reference is cuBLAS through torch (`problems/level1/matmul_bf16.py`,
`linear_bf16.py`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from kforge.bench import BenchJob, size_constants
from kforge.harness.candidate import Candidate

PROBLEMS = Path(__file__).parent.parent / "problems" / "level1"

# Llama-3 projections as (N, K) = (out_features, in_features) of the weight.
LLAMA3 = {
    "8B": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
    "70B": {"qkv": (10240, 8192), "o": (8192, 8192), "gate_up": (57344, 8192), "down": (8192, 28672)},
}
TOKENS = (16, 128, 4096)
SQUARES = (1024, 2048, 4096, 8192)


@dataclass(frozen=True)
class GemmShape:
    label: str
    m: int
    n: int
    k: int
    b_layout: str  # "kn": C = A @ B (squares); "nk": y = x @ W^T (LLM projections)

    @property
    def problem(self) -> Path:
        return PROBLEMS / ("matmul_bf16.py" if self.b_layout == "kn" else "linear_bf16.py")


def gemm_shapes() -> list[GemmShape]:
    shapes = [GemmShape(f"{s}^3", s, s, s, "kn") for s in SQUARES]
    for model, projections in LLAMA3.items():
        for name, (n, k) in projections.items():
            shapes += [GemmShape(f"{model} {name} M={m}", m, n, k, "nk") for m in TOKENS]
    return shapes


def gemm_methods(b_layout: str, m: int, n: int, k: int) -> dict[str, Candidate]:
    """The methods timed against cuBLAS: ours (the kernel kforge.ops.matmul picks for the
    shape on an H100's 132 SMs) and Triton."""
    from kforge.kernels import gemm_bf16
    from kforge.ladder import source_candidate
    from kforge.ops.matmul import best_kernel

    number, defines = best_kernel(m, n, k)
    step = gemm_bf16.rung(number)
    return {
        "ours": source_candidate("ours", lambda: gemm_bf16.RungModel(step, b_layout, defines), [step.source], defines),
        "triton": source_candidate("triton", lambda: gemm_bf16.TritonMatmul(b_layout), [gemm_bf16.TRITON_SOURCE]),
    }


def gemm_jobs(shapes: Sequence[GemmShape]) -> Iterator[BenchJob]:
    from kforge.harness.problem import load_problem

    for shape in shapes:
        problem = load_problem(shape.problem, "full", {"M": shape.m, "N": shape.n, "K": shape.k})
        for method, candidate in gemm_methods(shape.b_layout, shape.m, shape.n, shape.k).items():
            yield BenchJob(f"{shape.label} {method}", problem, candidate)


BASELINE = "cuBLAS"


def gemm_label(record: dict) -> str:
    size = size_constants(record)
    kind = "linear" if record["problem"]["name"].startswith("linear") else "matmul"
    return f"{kind} M={size['M']} N={size['N']} K={size['K']}"

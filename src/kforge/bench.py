"""`kforge bench gemm`: our best bf16 GEMM and the Triton kernel against cuBLAS, shape by shape.

Every (shape, method) is one `evaluate()`: gate 1 on fresh inputs, gate 2 timed against
the problem's reference (cuBLAS through torch) interleaved in the same run, so each ratio
compares two timings taken side by side. One EvalRecord per evaluation goes to the
results file; the table and the chart are drawn from those records (`--replot` redraws
them anywhere).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kforge.errors import KforgeError
from kforge.harness.candidate import Candidate

PROBLEMS = Path(__file__).parent / "problems" / "level1"

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


def gemm_methods(b_layout: str, m: int) -> dict[str, Candidate]:
    """The methods timed against cuBLAS: ours (the rung kforge.ops.matmul picks for M) and Triton."""
    from kforge.kernels import gemm_bf16
    from kforge.ladder import source_candidate
    from kforge.ops.matmul import best_rung

    step = gemm_bf16.rung(best_rung(m))
    return {
        "ours": source_candidate("ours", lambda: gemm_bf16.RungModel(step, b_layout), [step.source]),
        "triton": source_candidate("triton", lambda: gemm_bf16.TritonMatmul(b_layout), [gemm_bf16.TRITON_SOURCE]),
    }


def run_gemm_bench(shapes: Sequence[GemmShape], *, time_budget: float, results: Path | None,
                   command: str | None = None, on_step: Callable[[str], None] | None = None) -> list[dict]:
    from kforge.device import current_device
    from kforge.harness.evaluate import evaluate
    from kforge.harness.problem import load_problem
    from kforge.harness.record import append_record
    from kforge.harness.roofline import get_ceilings
    from kforge.harness.timing import TimingConfig
    from kforge.ladder import require_gpu

    require_gpu()
    device = current_device("cuda")
    ceilings = get_ceilings(device)
    records = []
    for shape in shapes:
        problem = load_problem(shape.problem, "full", {"M": shape.m, "N": shape.n, "K": shape.k})
        for method, candidate in gemm_methods(shape.b_layout, shape.m).items():
            if on_step:
                on_step(f"{shape.label} {method}")
            record = evaluate(problem, candidate, device=device, ceilings=ceilings,
                              timing=TimingConfig(budget_s=time_budget), command=command)
            if results is not None:
                append_record(results, record)
            records.append(record.to_dict())
    return records


@dataclass(frozen=True)
class BenchRow:
    shape: str
    tflops: dict[str, float | None]  # per method, and "cuBLAS" (its median over the method's runs)
    vs_cublas: dict[str, float | None]  # cuBLAS time / method time, timed in the same evaluation
    status: dict[str, str]


def bench_rows(records: Sequence[dict]) -> list[BenchRow]:
    """One row per problem size, in the order first seen; the latest record per (size, method)."""
    latest: dict[tuple[str, str], dict] = {}
    order: list[str] = []
    for r in records:
        size = _shape_label(r)
        if size not in order:
            order.append(size)
        latest[(size, r["candidate"]["name"])] = r
    rows = []
    for size in order:
        tflops, ratios, status, lib = {}, {}, {}, []
        for (s, method), r in latest.items():
            if s != size:
                continue
            stats = (r.get("gate2") or {}).get("stats") or {}
            flops = (r.get("roofline") or {}).get("flops")
            ms = stats.get("candidate", {}).get("median_ms")
            ref_ms = stats.get("reference", {}).get("median_ms")
            tflops[method] = flops / ms / 1e9 if flops and ms else None
            ratios[method] = ref_ms / ms if ms and ref_ms else None
            status[method] = r["status"]
            if flops and ref_ms:
                lib.append(flops / ref_ms / 1e9)
        tflops["cuBLAS"] = sorted(lib)[len(lib) // 2] if lib else None
        rows.append(BenchRow(size, tflops, ratios, status))
    return rows


def geomean(values: Sequence[float]) -> float | None:
    values = [v for v in values if v]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def _shape_label(record: dict) -> str:
    size = dict(part.split("=") for part in record["problem"]["size"].split(","))
    kind = "linear" if record["problem"]["name"].startswith("linear") else "matmul"
    return f"{kind} M={size['M']} N={size['N']} K={size['K']}"


def save_bench_chart(rows: Sequence[BenchRow], path: Path, *, title: str) -> Path:
    """Bars of speedup over cuBLAS per shape, one colour per method; 1.0 marked."""
    try:
        import matplotlib
    except ImportError:
        raise KforgeError("the chart needs matplotlib, which is not installed here") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = sorted({m for r in rows for m in r.vs_cublas})
    if not methods:
        raise KforgeError("nothing to chart: no method was timed")
    fig, ax = plt.subplots(figsize=(max(8, 0.55 * len(rows) + 2), 5.5), dpi=120)
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        xs = [j + i * width for j in range(len(rows))]
        ax.bar(xs, [r.vs_cublas.get(method) or 0 for r in rows], width, label=method)
    ax.axhline(1.0, color="#c44e52", linestyle="--", linewidth=1.2)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))], [r.shape for r in rows], rotation=60, ha="right",
                  fontsize=7)
    ax.set_ylabel("speedup over cuBLAS (same run, median, L2 flushed)")
    ax.set_title(title, fontsize=11)
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path

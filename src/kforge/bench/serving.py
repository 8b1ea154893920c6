"""`kforge bench serving`: the serving kernels against eager PyTorch and torch.compile of the
same computation, at Llama-3 sizes, judged by the share of HBM bandwidth they reach.

Each shape is one problem file (`problems/level1/rms_norm_bf16.py`, ...,
`problems/level2/rms_norm_qkv_bf16.py`) whose Model is the eager computation, and our op is
evaluated against it twice: once with the eager reference as the baseline and once with
torch.compile of it, each evaluation its own interleaved timing. The bytes are the
problem's `bytes_moved`, the fewest a kernel must move through HBM.

Two times per method, both from the one timing engine: the harness time (per call the
longer of device and host time, what an eager caller waits for, and what the speedups
compare) and the device time alone (what a CUDA graph would replay, and what GB/s and
the % of the measured copy bandwidth are computed from). Decode-sized calls are often
host-bound; both columns say so.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from statistics import median
from dataclasses import dataclass
from pathlib import Path

from kforge.bench import BenchJob, size_constants

PROBLEMS = Path(__file__).parent.parent / "problems"
KERNELS = Path(__file__).parent.parent / "kernels"
BASELINES = ("eager", "compile")


@dataclass(frozen=True)
class ServingShape:
    op: str  # group name on the command line: norms, swiglu, rope, gemv, paged, norm_qkv, varlen
    label: str
    problem: Path
    sizes: dict
    ours: Callable[[], Callable]  # builds our candidate's forward
    kernel: str  # the kernel's module under kforge/kernels (its bytes identify the candidate)


# --- our kernels, shaped as the problems' forwards ------------------------------------------
# Each calls the kernel's launcher, not the kforge.ops custom op (as the attention bench
# does): at decode sizes the op's dispatch is host time a serving loop would not pay in a
# CUDA graph. The ops themselves are tested in tests/kernels.

class OursRmsNorm:
    def __init__(self, residual: bool, eps: float = 1e-6):
        self.residual, self.eps = residual, eps

    def __call__(self, x, *rest):
        from kforge.kernels.serving.norms import rms_norm_forward

        if self.residual:
            residual, weight = rest
            return rms_norm_forward(x, weight, self.eps, residual)
        return rms_norm_forward(x, rest[0], self.eps)


class OursLayerNorm:
    def __init__(self, residual: bool, eps: float = 1e-5):
        self.residual, self.eps = residual, eps

    def __call__(self, x, *rest):
        from kforge.kernels.serving.norms import layer_norm_forward

        if self.residual:
            residual, weight, bias = rest
            return layer_norm_forward(x, weight, bias, self.eps, residual)
        weight, bias = rest
        return layer_norm_forward(x, weight, bias, self.eps)


class OursSwiglu:
    def __call__(self, x):
        from kforge.kernels.serving.swiglu import swiglu_forward

        return swiglu_forward(x)


class OursRope:
    def __init__(self, half_split: bool, max_position: int = 8192, base: float = 500000.0):
        self.interleaved, self.max_position, self.base = not half_split, max_position, base

    def __call__(self, q, k, positions):
        from kforge.kernels.serving.rope import apply_rope_, cos_sin_table

        table = cos_sin_table(self.max_position, q.shape[-1], self.base, q.device)  # built once, then cached
        apply_rope_(q, k, positions, table, interleaved=self.interleaved)
        return q, k


class OursGemv:
    def __call__(self, x, w):
        from kforge.kernels.serving.gemv import gemv

        return gemv(x, w)


class OursPagedDecode:
    def __call__(self, q, k_cache, v_cache, block_tables, context_lens):
        from kforge.kernels.serving.paged_decode import paged_decode

        return paged_decode(q, k_cache, v_cache, block_tables, context_lens, validate=False)


class OursRmsNormQkv:
    def __call__(self, x, gamma, w):
        from kforge.kernels.serving.norm_qkv import rms_norm_qkv

        return rms_norm_qkv(x, gamma, w, eps=1e-6)


class OursVarlen:
    def __init__(self, max_len: int, causal: bool):
        self.max_len, self.causal = max_len, causal

    def __call__(self, q, k, v, cu_seqlens):
        from kforge.kernels.attention.flash_varlen import flash_attention_varlen

        return flash_attention_varlen(q, k, v, cu_seqlens, cu_seqlens, self.max_len, self.max_len,
                                      causal=self.causal, check_lengths=False)[0]


# --- the shapes ----------------------------------------------------------------------------

def serving_shapes() -> list[ServingShape]:
    l1, l2 = PROBLEMS / "level1", PROBLEMS / "level2"
    shapes = []
    for rows, hidden, residual in ((16384, 4096, 0), (16384, 4096, 1), (8192, 8192, 1), (64, 4096, 1)):
        shapes.append(ServingShape("norms", f"rms_norm {rows}x{hidden}{' +residual' if residual else ''}",
                                   l1 / "rms_norm_bf16.py", {"ROWS": rows, "HIDDEN": hidden, "RESIDUAL": residual},
                                   lambda residual=residual: OursRmsNorm(bool(residual)), "serving/norms.py"))
    for rows, hidden, residual in ((16384, 4096, 0), (16384, 4096, 1), (8192, 8192, 1)):
        shapes.append(ServingShape("norms", f"layer_norm {rows}x{hidden}{' +residual' if residual else ''}",
                                   l1 / "layer_norm_bf16.py", {"ROWS": rows, "HIDDEN": hidden, "RESIDUAL": residual},
                                   lambda residual=residual: OursLayerNorm(bool(residual)), "serving/norms.py"))
    for rows, hidden in ((16384, 14336), (4096, 28672), (64, 14336)):
        shapes.append(ServingShape("swiglu", f"swiglu {rows}x{hidden}", l1 / "swiglu_bf16.py",
                                   {"ROWS": rows, "HIDDEN": hidden}, OursSwiglu, "serving/swiglu.py"))
    for tokens, q_heads, kv_heads, half in ((16384, 32, 8, 1), (16384, 32, 8, 0), (8192, 64, 8, 1)):
        shapes.append(ServingShape("rope", f"rope {tokens} tok {q_heads}/{kv_heads}x128 "
                                   f"{'half-split' if half else 'interleaved'}", l1 / "rope_bf16.py",
                                   {"TOKENS": tokens, "Q_HEADS": q_heads, "KV_HEADS": kv_heads, "HALF_SPLIT": half},
                                   lambda half=half: OursRope(bool(half)), "serving/rope.py"))
    for batch, n, k in ((1, 4096, 4096), (1, 6144, 4096), (1, 14336, 4096), (1, 28672, 4096), (1, 4096, 14336),
                        (1, 10240, 8192), (16, 6144, 4096), (16, 28672, 4096)):
        shapes.append(ServingShape("gemv", f"gemv B={batch} N={n} K={k}", l1 / "gemv_bf16.py",
                                   {"BATCH": batch, "N": n, "K": k}, OursGemv, "serving/gemv.py"))
    for batch, context, ragged in ((64, 4096, 0), (64, 4096, 1), (64, 512, 0), (16, 8192, 0), (1, 32768, 0)):
        shapes.append(ServingShape("paged", f"paged decode B={batch} ctx={context}{' ragged' if ragged else ''}",
                                   l1 / "paged_decode_bf16.py", {"BATCH": batch, "CONTEXT": context, "RAGGED": ragged},
                                   OursPagedDecode, "serving/paged_decode.py"))
    for m, n, k in ((1, 6144, 4096), (16, 6144, 4096), (4096, 6144, 4096), (1, 10240, 8192), (4096, 10240, 8192)):
        shapes.append(ServingShape("norm_qkv", f"rms_norm+qkv M={m} N={n} K={k}", l2 / "rms_norm_qkv_bf16.py",
                                   {"M": m, "N": n, "K": k}, OursRmsNormQkv, "serving/norm_qkv.py"))
    for causal in (1, 0):
        shapes.append(ServingShape("varlen", f"varlen prefill 8 seqs <=4096 {'causal' if causal else 'full'}",
                                   l1 / "varlen_attention_bf16.py", {"CAUSAL": causal},
                                   lambda causal=causal: OursVarlen(4096, bool(causal)), "attention/flash_varlen.py"))
    return shapes


def serving_groups(shapes: Sequence[ServingShape]) -> dict[str, list[ServingShape]]:
    groups: dict[str, list[ServingShape]] = {}
    for s in shapes:
        groups.setdefault(s.op, []).append(s)
    return groups


def serving_jobs(shapes: Sequence[ServingShape]) -> Iterator[BenchJob]:
    """Ours against the eager reference, then against its torch.compile, shape by shape."""
    from kforge.harness.problem import load_problem
    from kforge.ladder import source_candidate

    for shape in shapes:
        problem = load_problem(shape.problem, "full", shape.sizes)
        candidate = source_candidate("ours", shape.ours, [KERNELS / shape.kernel, Path(__file__)], shape.sizes)
        for baseline in BASELINES:
            yield BenchJob(f"{shape.label} vs {baseline}", problem, candidate, baseline)


def serving_label(record: dict) -> str:
    """The shape a record measured, as serving_shapes() names it."""
    sizes = size_constants(record)
    for shape in serving_shapes():
        if shape.problem.stem == record["problem"]["name"] and all(sizes.get(k) == v for k, v in shape.sizes.items()):
            return shape.label
    return f"{record['problem']['name']} {record['problem']['size']}"


@dataclass(frozen=True)
class ServingRow:
    shape: str
    bytes: int | None
    ours_ms: float | None  # harness time: per call max(device, host), median
    ours_device_ms: float | None
    baseline_ms: dict[str, float | None]  # eager / compile, harness time
    baseline_device_ms: dict[str, float | None]
    speedup: dict[str, float | None]  # baseline time / ours, same evaluation
    status: dict[str, str]
    copy_gbps: float | None  # the measured copy ceiling the record was judged against
    flops: float | None = None  # the problem's FLOP count, where it has one
    bound: str | None = None  # "memory" or "compute": which ceiling is the roof
    compute_tflops: float | None = None  # the measured matmul ceiling of the problem's dtype

    def gbps(self, device_ms: float | None) -> float | None:
        return self.bytes / device_ms / 1e6 if self.bytes and device_ms else None

    def tflops(self, device_ms: float | None) -> float | None:
        return self.flops / device_ms / 1e9 if self.flops and device_ms else None

    def pct_of_copy(self, device_ms: float | None) -> float | None:
        rate = self.gbps(device_ms)
        return 100 * rate / self.copy_gbps if rate and self.copy_gbps else None

    def pct_of_roof(self, device_ms: float | None) -> float | None:
        """% of the ceiling that bounds the problem: copy bandwidth, or the matmul rate."""
        if self.bound == "compute":
            rate = self.tflops(device_ms)
            return 100 * rate / self.compute_tflops if rate and self.compute_tflops else None
        return self.pct_of_copy(device_ms)


def serving_rows(records: Sequence[dict], label: Callable[[dict], str] | None = None) -> list[ServingRow]:
    """One row per shape (`label(record)`, serving_label by default; `kforge bench mla` passes
    its own), in the order first seen; the latest record per (shape, baseline). Our own times
    are the medians over both evaluations' runs of our op."""
    label = label or serving_label
    latest: dict[tuple[str, str], dict] = {}
    order: list[str] = []
    for r in records:
        shape = label(r)
        if shape not in order:
            order.append(shape)
        latest[(shape, r.get("baseline", "eager"))] = r
    rows = []
    for shape in order:
        ours, ours_device, base, base_device, speedup, status = [], [], {}, {}, {}, {}
        size, copy, flops, bound, compute = None, None, None, None, None
        for baseline in BASELINES:
            r = latest.get((shape, baseline))
            if r is None:
                continue
            gate2 = r.get("gate2") or {}
            stats, profile = gate2.get("stats") or {}, gate2.get("profile") or {}
            roofline = r.get("roofline") or {}
            size = roofline.get("bytes", size)
            copy = (roofline.get("ceilings") or {}).get("copy_gbps", copy)
            flops, bound = roofline.get("flops", flops), roofline.get("bound", bound)
            compute = roofline.get("compute_tflops", compute)
            status[baseline] = r["status"]
            base[baseline] = (stats.get("reference") or {}).get("median_ms")
            base_device[baseline] = (profile.get("reference") or {}).get("median_device_ms")
            speedup[baseline] = gate2.get("speedup")
            if (stats.get("candidate") or {}).get("median_ms"):
                ours.append(stats["candidate"]["median_ms"])
            if (profile.get("candidate") or {}).get("median_device_ms"):
                ours_device.append(profile["candidate"]["median_device_ms"])
        rows.append(ServingRow(shape, size, median(ours) if ours else None,
                               median(ours_device) if ours_device else None, base, base_device, speedup, status,
                               copy, flops, bound, compute))
    return rows


def save_serving_chart(rows: Sequence[ServingRow], path: Path, *, title: str) -> Path:
    """Bars of the % of the roof per shape (device time): the measured copy bandwidth, or
    for the compute-bound shapes (marked *) the measured matmul rate; ours, eager, compiled;
    the issue's 90% and 80% bars dashed."""
    from kforge.views import pyplot, save_figure

    plt = pyplot()
    series = {"ours": [r.pct_of_roof(r.ours_device_ms) for r in rows]}
    for baseline in BASELINES:
        series[baseline] = [r.pct_of_roof(r.baseline_device_ms.get(baseline)) for r in rows]
    fig, ax = plt.subplots(figsize=(max(9, 0.5 * len(rows) + 3), 5.5), dpi=120)
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        ax.bar([j + i * width for j in range(len(rows))], [v or 0 for v in values], width, label=name)
    for level in (90, 80):
        ax.axhline(level, color="#c44e52", linestyle="--", linewidth=1, alpha=0.7)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))],
                  [r.shape + (" *" if r.bound == "compute" else "") for r in rows], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("% of roof, device time (copy bandwidth; * matmul rate)")
    ax.set_title(title, fontsize=11)
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    return save_figure(fig, path)

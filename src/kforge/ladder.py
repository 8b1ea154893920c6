"""`kforge ladder`: every rung of a kernel ladder through the harness, in one table and one chart.

Each rung is a candidate against the ladder's problem (for fp32 GEMM: torch.matmul with
TF32 off, i.e. cuBLAS SGEMM), evaluated by `evaluate()` like any other candidate: gate 1
on fresh random inputs, gate 2 timed by the one timing engine against the library in
the same run. So "% of cuBLAS" is gate 2's speedup, and every row is an EvalRecord.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kforge.errors import KforgeError
from kforge.harness.candidate import Candidate
from kforge.harness.record import EvalRecord

PROBLEMS = Path(__file__).parent / "problems"


@dataclass(frozen=True)
class Ladder:
    family: str
    dtype: str
    problem: Path
    library: str  # what the rungs are measured against, by name
    size_names: tuple[str, ...]  # the problem's constants that --size sets
    peak: str = "datasheet"  # "% of peak" against the data sheet's rate, or the measured one ("measured")
    kernel: str = "gemm"  # what each step computes (the abstraction ladder also has "softmax")
    default_size: int = 4096  # --size when none is given

    def steps(self, rungs: Sequence[str] | None) -> list[tuple[str, Candidate]]:
        if self.family == "abstraction":
            every = _abstraction_steps(self.kernel)
        else:
            every = _fp32_steps() if self.dtype == "fp32" else _bf16_steps()
        if not rungs:
            return every
        chosen = [(label, c) for wanted in rungs for label, c in every if _matches(label, wanted)]
        unknown = [w for w in rungs if not any(_matches(label, w) for label, _ in every)]
        if unknown:
            skipped = [level.missing() for level in self.levels() if level.tool == unknown[0] and level.missing()]
            raise KforgeError(skipped[0] if skipped else f"no rung {unknown[0]!r} in the {self.name} ladder "
                              f"(rungs: {', '.join(label for label, _ in every)})")
        return chosen

    @property
    def name(self) -> str:
        return f"{self.family} {self.kernel}" if self.family == "abstraction" else f"{self.family} {self.dtype}"

    def levels(self) -> tuple:
        """The abstraction ladder's levels (kforge.kernels.abstraction), installed or not; none for the others."""
        if self.family != "abstraction":
            return ()
        from kforge.kernels.abstraction import levels

        return levels(self.kernel)

    def sweep(self) -> list[tuple[str, Candidate]]:
        if self.family == "abstraction":
            raise KforgeError("--sweep is for the gemm ladders (kforge ladder gemm --sweep)")
        if self.dtype == "fp32":
            from kforge.kernels import gemm_fp32

            return [(sweep_label(number, d), rung_candidate(gemm_fp32.rung(number), d))
                    for number, d in gemm_fp32.SWEEP]
        from kforge.kernels import gemm_bf16

        candidates = [rung_candidate(gemm_bf16.rung(number), d) for number, d in gemm_bf16.SWEEP]
        return [(c.name, c) for c in candidates]


def _matches(label: str, wanted: str) -> bool:
    """A rung is named by its label (05_clusters), its name (clusters) or its number (5, 05)."""
    number, _, name = label.partition("_")
    return wanted in (label, name) or (wanted.isdigit() and number.isdigit() and int(wanted) == int(number))


def _fp32_steps() -> list[tuple[str, Candidate]]:
    from kforge.kernels import gemm_fp32

    return [(step.label, rung_candidate(step)) for step in gemm_fp32.RUNGS]


def _bf16_steps() -> list[tuple[str, Candidate]]:
    """The best fp32 rung (on bf16 data, converted), every tensor-core rung, and Triton."""
    from kforge.kernels import gemm_bf16, gemm_fp32

    best_fp32 = gemm_fp32.BEST
    steps = [("fp32_" + best_fp32.label, source_candidate("fp32_" + best_fp32.label, gemm_bf16.Fp32RungOnBf16,
                                                   [best_fp32.source]))]
    steps += [(step.label, rung_candidate(step)) for step in gemm_bf16.RUNGS]
    steps.append(("triton", source_candidate("triton", gemm_bf16.TritonMatmul, [gemm_bf16.TRITON_SOURCE])))
    return steps


def _abstraction_steps(kernel: str) -> list[tuple[str, Candidate]]:
    """Each level whose tool is installed, most abstract first (Level.missing says how to add the others)."""
    from kforge.kernels.abstraction import LevelModel, levels

    return [(level.tool, source_candidate(level.tool, lambda level=level: LevelModel(level), [level.source]))
            for level in levels(kernel) if level.missing() is None]


LADDERS = {
    ("gemm", "fp32"): Ladder("gemm", "fp32", PROBLEMS / "level1" / "matmul_fp32.py", "cuBLAS SGEMM", ("M", "N", "K")),
    ("gemm", "bf16"): Ladder("gemm", "bf16", PROBLEMS / "level1" / "matmul_bf16.py", "cuBLAS bf16", ("M", "N", "K"),
                             peak="measured"),
}
# The same kernel in each tool (kforge/kernels/abstraction), by kernel: the GEMM against cuBLAS, and
# the softmax of Llama 3's 128256-entry rows (2048 of them; --size sets the row length) against torch.softmax.
ABSTRACTION_LADDERS = {
    "gemm": Ladder("abstraction", "bf16", PROBLEMS / "level1" / "matmul_bf16.py", "cuBLAS bf16", ("M", "N", "K"),
                   peak="measured"),
    "softmax": Ladder("abstraction", "bf16", PROBLEMS / "level1" / "softmax_bf16.py", "torch.softmax", ("VOCAB",),
                      kernel="softmax", default_size=128256),
}


def get_ladder(family: str, dtype: str | None = None, kernel: str | None = None) -> Ladder:
    """A ladder by family and dtype (default fp32 for gemm; the abstraction ladder is bf16)
    and, for the abstraction ladder, kernel (default gemm)."""
    if family == "abstraction":
        if dtype not in (None, "bf16"):
            raise KforgeError(f"the abstraction ladder is bf16 only, got --dtype {dtype}")
        if (kernel or "gemm") not in ABSTRACTION_LADDERS:
            raise KforgeError(f"no abstraction ladder for kernel {kernel!r} (kernels: {', '.join(ABSTRACTION_LADDERS)})")
        return ABSTRACTION_LADDERS[kernel or "gemm"]
    if kernel is not None:
        raise KforgeError(f"--kernel is for the abstraction ladder; the {family} ladder's kernel is itself")
    dtype = dtype or "fp32"
    ladder = LADDERS.get((family, dtype))
    if ladder is None:
        known = ", ".join(f"{f} --dtype {d}" for f, d in LADDERS)
        raise KforgeError(f"no ladder {family!r} for dtype {dtype!r} (ladders: {known}, abstraction)")
    return ladder


def source_candidate(label: str, factory: Callable, sources: Sequence[Path], defines: Mapping[str, int] | None = None
               ) -> Candidate:
    """A candidate identified by the bytes of its sources (and what they include) and its defines."""
    from kforge.runtime.cuda import source_files

    digest = hashlib.sha256()
    for source in sources:
        for path in source_files(source) if source.suffix in (".cu", ".cuh") else [source]:
            digest.update(path.read_bytes())
    digest.update(repr(sorted((defines or {}).items())).encode())
    return Candidate(name=label, factory=factory, path=sources[0], sha256=digest.hexdigest())


def rung_candidate(step, defines: Mapping[str, int] | None = None) -> Candidate:
    """A rung (of either GEMM ladder) as a harness candidate, named after its defines if any."""
    from kforge.kernels import gemm_bf16, gemm_fp32

    fp32 = isinstance(step, gemm_fp32.Rung)
    model = gemm_fp32.RungModel if fp32 else gemm_bf16.RungModel
    if defines is None:
        name = step.label
    else:
        name = sweep_label(step.number, defines) if fp32 else f"{step.label} " + (
            " ".join(f"{k}={v}" for k, v in defines.items()) or "defaults")
    return source_candidate(name, lambda: model(step, defines=defines), [step.source], defines)


def sweep_label(number: int, defines: Mapping[str, int]) -> str:
    """An fp32 sweep point by rung and shape: "r9 128x256x16 warp 64x32/2 thread 4x4 n512 mb1 g1 s3 [pad4]"."""
    d = defines
    stages = (f" s{d['STAGES']}" if "STAGES" in d else "") + (f" pad{d['APAD']}" if "APAD" in d else "")
    return (f"r{number} {d['BM']}x{d['BN']}x{d['BK']} warp {d['WM']}x{d['WN']}/{d['WNITER']} thread {d['TM']}x{d['TN']} "
            f"n{d['NUM_THREADS']} mb{d['MIN_BLOCKS']} g{d['GROUP_M']}{stages}")



def require_gpu(hint: str = "On a CPU machine, --replot redraws the chart from the records already there, and "
                             "`kforge resources` compiles the CUDA kernels and reports their registers.") -> None:
    """Raise a one-line KforgeError (with `hint`, what a CPU machine can do instead) when there is no GPU."""
    import torch

    if not torch.cuda.is_available():
        raise KforgeError("this command runs CUDA kernels and this machine has no CUDA device", hint)


def run_ladder(ladder: Ladder, size: int, steps: list[tuple[str, Candidate]], *, time_budget: float,
               results: Path | None, command: str | None = None,
               on_step: Callable[[str, EvalRecord | None], None] | None = None) -> list[EvalRecord]:
    """Evaluate each step on the current GPU; append each record to `results` as it ends.
    `command` is kept in every record (the CLI passes the command line that ran it)."""
    from kforge.device import current_device
    from kforge.harness.evaluate import evaluate
    from kforge.harness.problem import load_problem
    from kforge.harness.record import append_record
    from kforge.harness.roofline import get_ceilings
    from kforge.harness.timing import TimingConfig

    require_gpu()
    if size < 1:
        raise KforgeError(f"--size must be positive, got {size}")
    device = current_device("cuda")
    ceilings = get_ceilings(device)
    problem = load_problem(ladder.problem, "full", {name: size for name in ladder.size_names})
    records = []
    for label, candidate in steps:
        if on_step:
            on_step(label, None)
        record = evaluate(problem, candidate, device=device, ceilings=ceilings,
                          timing=TimingConfig(budget_s=time_budget), command=command)
        if results is not None:
            append_record(results, record)
        records.append(record)
        if on_step:
            on_step(label, record)
    return records


def latest_per_step(records: Sequence[dict]) -> list[dict]:
    """The latest record of each step (candidate name), in the order steps first appeared."""
    latest: dict[str, dict] = {}
    for record in records:
        name = record["candidate"].get("name")
        latest[name] = record  # a later record replaces an earlier one in its place
    return list(latest.values())


@dataclass(frozen=True)
class LadderRow:
    label: str
    status: str
    ms: float | None
    gflops: float | None
    pct_library: float | None  # the library's time over this rung's, in %
    pct_peak: float | None  # of the dtype's peak (data sheet or measured, as the ladder says)
    step_speedup: float | None  # over the previous rung in the table
    library_ms: float | None
    reason: str | None


def ladder_rows(records: Sequence[EvalRecord | dict], dtype: str, peak: str = "datasheet") -> list[LadderRow]:
    """One row per record; "% of peak" against the data sheet's rate for `dtype`, or (peak
    "measured") the rate `kforge roofline` measured with the library on this machine."""
    rows, previous_ms = [], None
    for record in records:
        r = record if isinstance(record, dict) else record.to_dict()
        gate2, roof = r.get("gate2") or {}, r.get("roofline") or {}
        stats = gate2.get("stats") or {}
        ms = stats.get("candidate", {}).get("median_ms")
        library_ms = stats.get("reference", {}).get("median_ms")
        flops = roof.get("flops")
        ceilings = roof.get("ceilings") or {}
        rates = ceilings.get("matmul_tflops", {}) if peak == "measured" else (ceilings.get("datasheet") or {}).get("tflops", {})
        peak_tflops = rates.get(dtype)
        gflops = flops / ms / 1e6 if ms and flops else None
        rows.append(LadderRow(
            label=r["candidate"].get("name") or "?", status=r["status"], ms=ms, gflops=gflops,
            pct_library=100 * library_ms / ms if ms and library_ms else None,
            pct_peak=100 * gflops / (peak_tflops * 1e3) if gflops and peak_tflops else None,
            step_speedup=previous_ms / ms if ms and previous_ms else None,
            library_ms=library_ms, reason=r.get("reason"),
        ))
        previous_ms = ms if ms else previous_ms
    return rows


@dataclass(frozen=True)
class AbstractionRow:
    level: str  # the tool
    status: str  # the record's status; "not_run" with --compile-only
    ms: float | None
    rate: float | None  # TFLOP/s for the GEMM, GB/s for the softmax (memory-bound)
    pct_library: float | None
    lines: int  # lines of code of the kernel's own file (kernels.abstraction.lines_of_code)
    compile_s: float | None  # compile for sm_90a from a cold cache (kernels.abstraction.compiling)
    controls: str  # what this level lets you control
    reason: str | None  # why a status is not passed/slower/tie, or why it did not compile


def abstraction_rows(ladder: Ladder, records: Sequence[EvalRecord | dict], compiled: Mapping[str, object]
                     ) -> list[AbstractionRow]:
    """One row per level, most abstract first: every level with a record or a compile report
    (`compiled`: tool -> CompileReport). The rate is TFLOP/s for the GEMM and GB/s (the bytes
    the roofline counts) for the softmax."""
    from kforge.kernels.abstraction import lines_of_code

    by_level = {}
    for record in records:
        r = record if isinstance(record, dict) else record.to_dict()
        by_level[r["candidate"].get("name")] = r
    rows = []
    for level in ladder.levels():
        record, report = by_level.get(level.tool), compiled.get(level.tool)
        if record is None and report is None:
            continue
        timed = ladder_rows([record], ladder.dtype, ladder.peak)[0] if record else None
        rate = None
        if timed and timed.ms:
            moved = (record.get("roofline") or {}).get("bytes")
            rate = timed.gflops / 1e3 if ladder.kernel == "gemm" and timed.gflops else \
                moved / timed.ms / 1e6 if moved else None
        rows.append(AbstractionRow(
            level=level.tool, status=timed.status if timed else "not_run", ms=timed.ms if timed else None, rate=rate,
            pct_library=timed.pct_library if timed else None, lines=lines_of_code(level.source),
            compile_s=getattr(report, "seconds", None), controls=level.controls,
            reason=(timed.reason if timed else None) or getattr(report, "error", None)))
    return rows


def save_chart(rows: Sequence[LadderRow], path: Path, *, title: str, library: str) -> Path:
    """A bar per rung: GFLOP/s, with the library's rate as a line and % of it on each bar."""
    from kforge.views import pyplot, save_figure

    plt = pyplot()

    timed = [r for r in rows if r.gflops]
    if not timed:
        raise KforgeError("nothing to chart: no rung was timed (all failed gate 1 or crashed)")
    library_gflops = [r.gflops * 100 / r.pct_library for r in timed if r.pct_library]
    fig, ax = plt.subplots(figsize=(10, 5.5), dpi=120)
    bars = ax.bar([r.label for r in timed], [r.gflops for r in timed], color="#4878a8")
    for bar, r in zip(bars, timed):
        ax.annotate(f"{r.pct_library:.1f}%" if r.pct_library else "", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=9, xytext=(0, 2), textcoords="offset points")
    if library_gflops:
        level = sorted(library_gflops)[len(library_gflops) // 2]  # the median of its per-rung timings
        ax.axhline(level, color="#c44e52", linestyle="--", linewidth=1.2)
        ax.annotate(f"{library} {level:,.0f} GFLOP/s", (0, level), xytext=(4, 4), textcoords="offset points",
                    color="#c44e52", fontsize=9)
    ax.set_ylabel("GFLOP/s (median, L2 flushed)")
    ax.set_title(title, fontsize=11)
    ax.tick_params(axis="x", labelrotation=30)
    for label in ax.get_xticklabels():
        label.set_horizontalalignment("right")
    ax.grid(axis="y", alpha=0.3)
    return save_figure(fig, path)

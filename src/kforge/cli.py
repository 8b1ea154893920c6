"""The `kforge` command. It only parses and formats: the work is in the Python API.

Exit status of `kforge eval`: 0 both gates passed; 1 a gate failed (incorrect, slower,
faster than the hardware allows, or rejected by a defence); 2 the input is unusable (a
missing or malformed file, a constructor mismatch, an exception, a crash, out of
memory, a CUDA error or a time limit while building or running). 3 means kforge itself
failed: that is a bug. `kforge suite` exits 0 when every pair passed, else 1.
"""

from __future__ import annotations

import shlex
import sys
import warnings
from contextlib import contextmanager
from enum import Enum
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from kforge.errors import KforgeError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="kforge: is this kernel correct AND faster, and what % of the hardware's peak is it at?",
)
out = Console()
err = Console(stderr=True, soft_wrap=True)  # an error stays one line, however long

DEFAULT_RESULTS = Path("kforge-results.jsonl")


@contextmanager
def _store_warnings():
    """Show each line a JSONL store left out (read_records warns StoreWarning) as one warning
    line on stderr, once per command; other warnings are shown as before."""
    from kforge.harness.record import StoreWarning

    shown = set()
    with warnings.catch_warnings():
        warnings.simplefilter("always", StoreWarning)
        show_other = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if not isinstance(message, StoreWarning):
                return show_other(message, category, filename, lineno, file, line)
            for note in message.reading.notes():
                if note not in shown:
                    shown.add(note)
                    err.print(f"[bold yellow]warning:[/] {escape(note)}", highlight=False)

        warnings.showwarning = show
        yield


class Baseline(str, Enum):
    eager = "eager"
    compile = "compile"


class Size(str, Enum):
    full = "full"
    tiny = "tiny"
    auto = "auto"


@app.command("eval")
def eval_command(
    problem: Path = typer.Argument(..., help="Problem file: Model, get_inputs(), get_init_inputs()."),
    candidate: Path = typer.Argument(..., help="Candidate file: ModelNew with Model's constructor."),
    baseline: Baseline = typer.Option(Baseline.eager, help="What the candidate must beat: the reference "
                                      "run eagerly, or torch.compile of it."),
    trials: int = typer.Option(5, min=5, help="Gate 1 trials, each on fresh random inputs."),
    time_budget: float = typer.Option(10.0, min=0.1, help="Seconds of timed rounds at most (gate 2)."),
    size: Size = typer.Option(None, help="Problem size: full, tiny (its tiny_sizes) or auto. "
                              "Default: full on a GPU, auto on a CPU.", show_default=False),
    seed: int = typer.Option(None, help="Run seed, to reproduce a run (default: secret and random; "
                             "needs --in-process)."),
    results: Path = typer.Option(DEFAULT_RESULTS, help="JSONL file the record is appended to."),
    save: bool = typer.Option(True, help="Append the record to --results."),
    json_output: bool = typer.Option(False, "--json", help="Print the record as JSON, and nothing else."),
    in_process: bool = typer.Option(False, "--in-process", help="Run the candidate in this process, not a fresh "
                                    "worker: for a debugger; a crash then takes kforge down with it."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Show whole tracebacks."),
) -> None:
    """Evaluate CANDIDATE against PROBLEM: gate 1 (correct), gate 2 (faster), % of roofline."""
    from kforge.harness.evaluate import evaluate
    from kforge.harness.isolation import evaluate_isolated
    from kforge.harness.record import append_record
    from kforge.harness.timing import TimingConfig
    from kforge.views import eval_view

    options = dict(baseline=baseline.value, trials=trials, timing=TimingConfig(budget_s=time_budget),
                   size=size.value if size else None, command=shlex.join(["kforge", *sys.argv[1:]]))
    if in_process:
        record = evaluate(problem, candidate, seed=seed, **options)
    else:
        if seed is not None:
            raise KforgeError("--seed needs --in-process: a worker draws its own secret seed")
        record = evaluate_isolated(problem, candidate, **options)
    if save:
        append_record(results, record)
    if json_output:
        print(record.to_json())
    else:
        out.print(eval_view(record.to_dict(), str(results) if save else None, verbose=verbose))
    raise typer.Exit(record.exit_status)


class SuiteBaseline(str, Enum):
    eager = "eager"
    compile = "compile"
    both = "both"


BUILTIN_LEVELS = ("level1", "level2", "level3")


def _suite_pairs(problems: str, solutions: str, only: str | None):
    """The pairs of a suite: PROBLEMS (a built-in level or a folder), --solutions (builtin or a
    folder), restricted to the --only names."""
    from kforge.harness.suite import discover

    package = Path(__file__).parent
    if problems in BUILTIN_LEVELS:
        problems_dir = package / "problems" / problems
    else:
        problems_dir = Path(problems)
    if solutions == "builtin":
        if problems not in BUILTIN_LEVELS:
            raise KforgeError(f"--solutions builtin needs PROBLEMS to be one of {', '.join(BUILTIN_LEVELS)}, "
                              f"got {problems!r}")
        solutions_dir = package / "solutions" / problems
    else:
        solutions_dir = Path(solutions)
    pairs = discover(problems_dir, solutions_dir)
    if only:
        wanted = [name.strip() for name in only.split(",") if name.strip()]
        unknown = sorted(set(wanted) - {pair.name for pair in pairs})
        if unknown:
            raise KforgeError(f"--only names no problem in {problems_dir}: {', '.join(unknown)} (problems: "
                              f"{', '.join(pair.name for pair in pairs)})")
        pairs = [pair for pair in pairs if pair.name in wanted]
    return pairs


@app.command("suite")
def suite_command(
    problems: str = typer.Argument(..., help="level1, level2 or level3 (kforge's built-in suites), or a folder of "
                                   "problem files (write ./level1 for a folder of that name)."),
    solutions: str = typer.Option(..., "--solutions", help="builtin (kforge's own solutions to a built-in level), "
                                  "or a folder of candidates: one per problem, same file name."),
    only: str = typer.Option(None, "--only", help="Run only these problems, by file name without .py, separated "
                             "by commas (e.g. softmax_bf16,topk_fp32).", show_default=False),
    gpus: str = typer.Option(None, help="GPUs to use, e.g. 0,1: one worker on each at a time. "
                             "Default: every visible GPU, or the CPU where there is none.", show_default=False),
    resume: bool = typer.Option(False, help="Continue the run stored in --results (it must exist)."),
    force: bool = typer.Option(False, help="Evaluate every pair again; new records are appended and "
                               "the latest counts."),
    results: Path = typer.Option(Path("kforge-suite.jsonl"), help="JSONL store of the suite's records."),
    baseline: SuiteBaseline = typer.Option(SuiteBaseline.eager, help="What the candidates must beat: eager "
                                           "PyTorch, torch.compile of the reference, or both (each pair runs "
                                           "against each; a table and scores for each)."),
    time_budget: float = typer.Option(10.0, min=0.1, help="Seconds of timed rounds per pair at most."),
    size: Size = typer.Option(None, help="Problem size (default: full on a GPU, auto on a CPU).", show_default=False),
    stage_timeout: float = typer.Option(None, min=1.0, help="Seconds each stage (load, gate 1, gate 2) may take "
                                        "before its worker is killed. Default: 600, 600, 3x the budget + 300.",
                                        show_default=False),
    json_output: bool = typer.Option(False, "--json", help="Print the scores and rows as JSON."),
) -> None:
    """Evaluate every problem in PROBLEMS against its solution; print fast_p and a table.
    Exit status 0 when every pair passed both gates, 1 otherwise.

    `kforge suite level1 --solutions builtin` runs kforge's Level 1 suite with its own
    solutions. Pairs already in --results are skipped, so an interrupted suite resumes where
    it stopped; with --baseline both the eager and the torch.compile records share the store.
    """
    import json
    from dataclasses import asdict

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.text import Text

    from kforge.harness.isolation import StageLimits
    from kforge.harness.suite import ResultStore, run_suite
    from kforge.harness.timing import TimingConfig
    from kforge.views import suite_view

    if resume and force:
        raise KforgeError("--resume and --force contradict each other: choose one")
    if resume and not results.is_file():
        raise KforgeError(f"nothing to resume: {results} does not exist")
    pairs = _suite_pairs(problems, solutions, only)
    slots, device_name = _slots(gpus)
    store = ResultStore(results)
    baselines = ["eager", "compile"] if baseline is SuiteBaseline.both else [baseline.value]
    summaries = {}
    with _store_warnings(), Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                    TimeElapsedColumn(), console=err, disable=json_output) as progress:
        task = progress.add_task("suite", total=len(pairs) * len(baselines))
        for against in baselines:
            options = dict(baseline=against, timing=TimingConfig(budget_s=time_budget),
                           size=size.value if size else None,
                           limits=StageLimits(stage_timeout, stage_timeout, stage_timeout) if stage_timeout else None)
            summaries[against] = run_suite(
                pairs, store, slots=slots, device_name=device_name, force=force, options=options,
                on_start=lambda pair, gpu, against=against: progress.update(
                    task, description=f"{pair.name} vs {against} on " + ("the CPU" if gpu is None else f"GPU {gpu}")),
                on_done=lambda pair, record: progress.advance(task),
            )
        progress.update(task, completed=len(pairs) * len(baselines), description="suite")

    def as_json(summary):
        return {"fast_p": {f"fast_{p:g}": v for p, v in summary.fast_p.items()},
                "geomean_speedup": summary.geomean_speedup, "ran": summary.ran,
                "rows": [asdict(row) for row in summary.rows]}

    if json_output:
        if len(baselines) == 1:
            print(json.dumps(as_json(summaries[baselines[0]])))
        else:
            print(json.dumps({"baselines": {name: as_json(summary) for name, summary in summaries.items()}}))
    else:
        for against, summary in summaries.items():
            if len(baselines) > 1:
                out.print(Text(f"against {'eager PyTorch' if against == 'eager' else 'torch.compile'}", style="bold"))
            out.print(suite_view(summary, device_name, str(results)))
    # 0 only when every pair passed both gates: a suite is a check CI can rely on
    failed = any(row.status != "passed" for summary in summaries.values() for row in summary.rows)
    raise typer.Exit(1 if failed else 0)


class LadderFamily(str, Enum):
    gemm = "gemm"


@app.command("ladder")
def ladder_command(
    family: LadderFamily = typer.Argument(..., help="Which ladder: gemm."),
    dtype: str = typer.Option("fp32", help="Data type of the ladder (fp32: CUDA cores; bf16: tensor cores)."),
    size: int = typer.Option(4096, min=1, help="M = N = K."),
    rungs: str = typer.Option(None, help="Rungs to run, e.g. 1,5,9 (default: all).", show_default=False),
    sweep: bool = typer.Option(False, help="Instead of the rungs, time every shape in the tuned rung's sweep."),
    time_budget: float = typer.Option(5.0, min=0.1, help="Seconds of timed rounds per rung at most."),
    results: Path = typer.Option(None, help="JSONL file the records are appended to "
                                 "(default: ladder-<family>-<dtype>[-sweep].jsonl).", show_default=False),
    chart: Path = typer.Option(None, help="PNG chart of the climb (default: the results path with .png).",
                               show_default=False),
    replot: bool = typer.Option(False, help="Measure nothing: redraw the table and chart from the records in "
                                "--results (the latest record of each rung)."),
) -> None:
    """Run every rung of a kernel ladder through the harness: one table, one chart."""
    from dataclasses import replace

    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from kforge.harness.record import read_records
    from kforge.ladder import get_ladder, ladder_rows, latest_per_step, require_gpu, run_ladder, save_chart
    from kforge.views import ladder_view

    ladder = get_ladder(family.value, dtype)
    stem = f"ladder-{ladder.family}-{ladder.dtype}" + ("-sweep" if sweep else "")
    results = results or Path(f"{stem}.jsonl")
    chart = chart or results.with_suffix(".png")
    if replot:
        if not results.is_file():
            raise KforgeError(f"nothing to replot: {results} does not exist")
        with _store_warnings():
            records = latest_per_step(read_records(results))
        if not records:
            raise KforgeError(f"nothing to replot: {results} holds no records")
        device_name, size_text = records[0]["device"]["name"], records[0]["problem"].get("size")
    else:
        require_gpu()
        steps = ladder.sweep() if sweep else ladder.steps(rungs.split(",") if rungs else None)
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                      console=err) as progress:
            task = progress.add_task("ladder", total=len(steps))
            records = run_ladder(ladder, size, steps, time_budget=time_budget, results=results,
                                 command=shlex.join(["kforge", *sys.argv[1:]]), on_step=lambda label, record: progress.update(
                                     task, description=f"{label}" if record is None else "ladder",
                                     advance=0 if record is None else 1))
        device_name, size_text = records[0].device["name"], f"{size}^3"
    rows = ladder_rows(records, ladder.dtype, ladder.peak)
    if sweep:  # fastest first; a step over the previous row means nothing here
        rows = [replace(r, step_speedup=None) for r in sorted(rows, key=lambda r: -(r.gflops or 0))]
    title = (f"{ladder.family} {ladder.dtype}{' sweep' if sweep else ''}, {size_text} on {device_name}: "
             f"vs {ladder.library}")
    out.print(ladder_view(rows, title=title, library=ladder.library, results_path=None if replot else str(results)))
    save_chart(rows, chart, title=title, library=ladder.library)
    err.print(f"chart saved to {chart}", style="dim")


class BenchFamily(str, Enum):
    gemm = "gemm"
    attention = "attention"
    serving = "serving"
    quant = "quant"


@app.command("bench")
def bench_command(
    family: BenchFamily = typer.Argument(..., help="What to benchmark: gemm, attention, serving or quant."),
    shapes: str = typer.Option("all", help="all; for gemm also squares or llm; for serving an op group (norms, "
                               "swiglu, rope, gemv, paged, norm_qkv, varlen); for quant a group (fp8, w4a16, "
                               "nvfp4-gemv, nvfp4-gemm); or a comma list of shape labels "
                               "(gemm: 1024^3, '8B qkv M=16', ...; attention: 'full N=4096 D=128', "
                               "'causal N=512 D=64', ...)."),
    time_budget: float = typer.Option(1.0, min=0.1, help="Seconds of timed rounds per evaluation at most."),
    results: Path = typer.Option(None, help="JSONL file the records are appended to (default: bench-FAMILY.jsonl).",
                                 show_default=False),
    chart: Path = typer.Option(None, help="PNG chart (default: the results path with .png).", show_default=False),
    replot: bool = typer.Option(False, help="Measure nothing: redraw the table and chart from --results."),
    sweep: bool = typer.Option(False, help="attention: time our kernel in each of its autotuner's configs "
                               "instead of the methods."),
) -> None:
    """Our kernels against the best library over a sweep of shapes, in one run: GEMM vs
    cuBLAS (ours and Triton), attention vs SDPA's flash backend (ours, naive, cuDNN,
    efficient), serving kernels vs eager PyTorch and torch.compile (GB/s, % of copy),
    low-precision kernels vs torch._scaled_mm and bf16 cuBLAS on the same numbers."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from kforge.bench import bench_rows, run_bench, save_bench_chart
    from kforge.harness.record import read_records

    results = results or Path(f"bench-{family.value}.jsonl")
    chart = chart or results.with_suffix(".png")
    if family == BenchFamily.gemm:
        from kforge.bench import gemm as bench
        every = bench.gemm_shapes()
        groups = {"squares": [s for s in every if s.b_layout == "kn"], "llm": [s for s in every if s.b_layout == "nk"]}
        make_jobs, label = bench.gemm_jobs, bench.gemm_label
    elif family == BenchFamily.serving:
        from kforge.bench import serving as bench
        every = bench.serving_shapes()
        groups, make_jobs, label = bench.serving_groups(every), bench.serving_jobs, bench.serving_label
    elif family == BenchFamily.quant:
        from kforge.bench import quant as bench
        every = bench.quant_shapes()
        groups, make_jobs, label = bench.quant_groups(every), bench.quant_jobs, bench.quant_label
    else:
        from kforge.bench import attention as bench
        every, groups = bench.attention_shapes(), {}
        make_jobs, label = bench.sweep_jobs if sweep else bench.attention_jobs, bench.attention_label
    if sweep and family != BenchFamily.attention:
        raise KforgeError("--sweep is for attention (the GEMM sweep is `kforge ladder gemm --sweep`)")
    if replot:
        if not results.is_file():
            raise KforgeError(f"nothing to replot: {results} does not exist")
        with _store_warnings():
            records = read_records(results)
    else:
        if shapes == "all":
            chosen = every
        elif all(w.strip() in groups for w in shapes.split(",")):
            chosen = [s for w in shapes.split(",") for s in groups[w.strip()]]
        else:
            wanted = [w.strip() for w in shapes.split(",")]
            chosen = [s for s in every if s.label in wanted]
            if len(chosen) != len(wanted):
                raise KforgeError(f"unknown shape in {shapes!r} (shapes: {', '.join(s.label for s in every)})")
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=err) as progress:
            task = progress.add_task("bench", total=None)
            records = run_bench(make_jobs(chosen), time_budget=time_budget, results=results,
                                command=shlex.join(["kforge", *sys.argv[1:]]),
                                on_step=lambda text: progress.update(task, description=text))
    if not records:
        raise KforgeError(f"no records in {results}")
    device_name = records[0]["device"]["name"]
    results_path = None if replot else str(results)
    if family == BenchFamily.serving:
        from kforge.views import serving_bench_view

        rows = bench.serving_rows(records)
        title = f"serving kernels bf16 on {device_name}: ours vs eager PyTorch and torch.compile (same run)"
        out.print(serving_bench_view(rows, title=title, results_path=results_path))
        bench.save_serving_chart(rows, chart, title=title)
        err.print(f"chart saved to {chart}", style="dim")
        return
    if family == BenchFamily.quant:
        from kforge.views import quant_bench_view

        title = f"low-precision kernels on {device_name}: ours vs the best PyTorch path on the same numbers"
        out.print(quant_bench_view(bench.quant_rows(records), title=title, results_path=results_path))
        return
    rows = bench_rows(records, bench.BASELINE, label)
    if family == BenchFamily.gemm:
        from kforge.views import bench_view

        title = f"GEMM bf16 on {device_name}: ours and Triton vs cuBLAS (same run)"
        out.print(bench_view(rows, title=title, baseline=bench.BASELINE, results_path=results_path))
        save_bench_chart(rows, chart, title=title, baseline=bench.BASELINE)
    else:
        from kforge.views import attention_bench_view

        title = f"attention forward bf16 on {device_name}: vs SDPA flash (same run)"
        out.print(attention_bench_view(rows, title=title, records=records, results_path=results_path))
        bench.save_attention_chart(rows, chart, title=title, records=records)
    err.print(f"chart saved to {chart}", style="dim")


trace_app = typer.Typer(no_args_is_help=True, help="Step through an algorithm and print every intermediate.")
app.add_typer(trace_app, name="trace")


@trace_app.command("online-softmax", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def trace_online_softmax_command(ctx: typer.Context) -> None:
    """The online softmax tile by tile: tile max, running max m, rescale exp(m_old - m_new),
    running denominator l, then the check against the softmax of all scores at once.

    Usage: kforge trace online-softmax --tiles "1,3" "2,5" [--values ["10,20,30,40"]]
    Each tile is a comma list of scores. --values adds one value per score (default 1, 2,
    ...) and the running attention output.
    """
    from kforge.kernels.attention.online_softmax import trace_online_softmax
    from kforge.views import online_softmax_view

    tiles, values = parse_trace_args(ctx.args)
    try:
        trace = trace_online_softmax(tiles, values)
    except ValueError as exc:
        raise KforgeError(str(exc)) from None
    out.print(online_softmax_view(trace))
    if not trace.agrees():
        raise typer.Exit(1)


@trace_app.command("accumulate")
def trace_accumulate_command(
    terms: int = typer.Option(64, min=1, max=4096, help="How many products near 1.0 to add up."),
    seed: int = typer.Option(20, help="Seed of the products (20 reproduces the seed document's table)."),
) -> None:
    """Why the accumulator must be wide: products of e4m3 pairs near 1.0 summed step by step
    with an FP8 (e4m3), an FP16 and an FP32 accumulator, each rounded after every add,
    against the exact sum. FP8's step at 32 is 16: adding ~1 rounds back, and it freezes."""
    from kforge.kernels.quant.trace import accumulate_trace, render_accumulate_trace

    out.print(render_accumulate_trace(accumulate_trace(n_terms=terms, seed=seed)))


@trace_app.command("formats")
def trace_formats_command() -> None:
    """Each quantized format's bits per value (scales included) and relative error against
    bf16 on Gaussian and heavy-tailed weights and on activations with outlier channels."""
    from kforge.kernels.quant.trace import format_error_table, render_format_error_table

    out.print(render_format_error_table(format_error_table()))


def parse_trace_args(tokens: list[str]) -> tuple[list[list[float]], list[float] | None]:
    """`--tiles A B ...` (each a comma list of numbers) and `--values [LIST]` into numbers.
    Parsed by hand because --tiles takes any number of tiles and --values an optional list."""
    tiles: list[str] = []
    values: str | None = None
    current = None
    for token in tokens:
        if token in ("--tiles", "--values"):
            current = token
            if token == "--values":
                values = "auto"
        elif token.startswith("--"):
            raise KforgeError(f"unknown option {token} (options: --tiles, --values)")
        elif current == "--tiles":
            tiles.append(token)
        elif current == "--values" and values == "auto":
            values, current = token, None
        else:
            raise KforgeError(f"unexpected {token!r}: tiles follow --tiles, values follow --values")
    if not tiles:
        raise KforgeError('give the tiles: --tiles "1,3" "2,5"')

    def numbers(text: str, what: str) -> list[float]:
        try:
            return [float(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise KforgeError(f"{what} {text!r} is not a comma list of numbers") from None

    parsed = [numbers(t, "tile") for t in tiles]
    if any(not t for t in parsed):
        raise KforgeError("a tile is empty")
    if values == "auto":
        return parsed, [float(i + 1) for i in range(sum(len(t) for t in parsed))]
    return parsed, None if values is None else numbers(values, "--values")


@app.command("resources")
def resources_command(
    sources: list[Path] = typer.Argument(None, help=".cu files (default: every one in kforge's kernels).",
                                         show_default=False),
    arch: str = typer.Option("sm_90a", help="Architecture to compile for (no GPU needed)."),
) -> None:
    """Compile CUDA sources with NVRTC and report registers, shared memory and spills per kernel."""
    from rich.table import Table

    from kforge.runtime.cuda import compile_cuda, resources

    sources = sources or sorted((Path(__file__).parent / "kernels").rglob("*.cu"))
    table = Table(title=f"kernel resources for {arch} (ptxas via NVRTC; cuobjdump)", title_justify="left")
    for column in ("source", "kernel", "registers", "shared B", "stack B", "spill stores B", "spill loads B"):
        table.add_column(column, justify="left" if column in ("source", "kernel") else "right")
    for source in sources:
        for name, r in resources(compile_cuda(source, arch=arch)).items():
            table.add_row(source.name, name, str(r.registers), f"{r.shared_bytes:,}", str(r.stack_bytes),
                          str(r.spill_stores), str(r.spill_loads),
                          style="red" if r.spill_stores or r.spill_loads else None)
    out.print(table)


def _slots(gpus: str | None) -> tuple[list[int | None], str]:
    """The GPUs a suite may use, and the device name its pairs are keyed by."""
    import torch

    if not torch.cuda.is_available():
        if gpus:
            raise KforgeError("--gpus was given but torch sees no CUDA device")
        from kforge.device import current_device

        return [None], current_device("cpu").name
    count = torch.cuda.device_count()
    try:
        slots = [int(g) for g in gpus.split(",")] if gpus else list(range(count))
    except ValueError:
        raise KforgeError(f"--gpus takes GPU numbers separated by commas, got {gpus!r}") from None
    if any(not 0 <= g < count for g in slots) or len(set(slots)) != len(slots):
        raise KforgeError(f"--gpus {gpus}: this machine has GPUs 0..{count - 1}, each listed once at most")
    names = {torch.cuda.get_device_name(g) for g in slots}
    if len(names) > 1:
        raise KforgeError(f"--gpus mixes GPU models ({', '.join(sorted(names))}): their timings would not compare")
    return slots, names.pop()


@app.command("roofline")
def roofline_command(
    remeasure: bool = typer.Option(False, help="Measure again even if this device's ceilings are cached."),
    json_output: bool = typer.Option(False, "--json", help="Print the ceilings as JSON."),
) -> None:
    """Measure (once, then cached) this device's copy bandwidth and matmul rates per dtype."""
    import json

    from kforge.device import current_device
    from kforge.harness.roofline import ceilings_path, get_ceilings
    from kforge.views import ceilings_view

    device = current_device()
    if remeasure or not ceilings_path(device).is_file():
        err.print(f"measuring the ceilings of {device.name} ...", style="dim")
    ceilings = get_ceilings(device, remeasure=remeasure)
    if json_output:
        print(json.dumps(ceilings.to_dict(), indent=2))
    else:
        out.print(ceilings_view(ceilings, str(ceilings_path(device))))


@app.command("report")
def report_command(
    results_dir: Path = typer.Argument(Path("benchmarks/results"), help="Folder of <device>/<bench>.jsonl records."),
    output: Path = typer.Option(Path("benchmarks/RESULTS.md"), "--output", "-o", help="Markdown file to write."),
) -> None:
    """Regenerate the Markdown results tables from the records (a view; measures nothing)."""
    from kforge.views import results_markdown

    if not results_dir.is_dir():
        raise KforgeError(f"no results folder: {results_dir}")
    with _store_warnings():
        text = results_markdown(results_dir)
    output.write_text(text)
    err.print(f"wrote {output}", style="dim")


def main() -> None:
    """Console entry point: a clear one-line error instead of a traceback, always."""
    import traceback

    try:
        code = app(standalone_mode=False)
    except KforgeError as exc:
        err.print(f"[bold red]error:[/] {exc.reason}", highlight=False)
        if exc.details:
            err.print(exc.details, style="dim", highlight=False)
        sys.exit(2)
    except typer.Abort:
        err.print("aborted")
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001 - the last line of defence is a readable message
        if hasattr(exc, "show") and hasattr(exc, "exit_code"):  # click's usage errors (typer may vendor click)
            exc.show()
            sys.exit(exc.exit_code)
        err.print(f"[bold red]kforge internal error:[/] {type(exc).__name__}: {exc}", highlight=False)
        err.print("this is a bug in kforge; its traceback:", style="dim")
        err.print("".join(traceback.format_exception(exc)), style="dim", highlight=False)
        sys.exit(3)
    sys.exit(code if isinstance(code, int) else 0)

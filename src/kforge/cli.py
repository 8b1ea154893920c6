"""The `kforge` command. It only parses and formats: the work is in the Python API.

Exit status of `kforge eval`: 0 both gates passed; 1 a gate failed (incorrect, slower,
not measurably faster (tie), faster than the hardware allows, or rejected by a defence);
2 the input is unusable (a missing or malformed file, a constructor mismatch, an
exception, a crash, out of memory, a CUDA error or a time limit while building or running). 3 means kforge itself
failed: that is a bug. `kforge suite` exits 0 when every pair passed, else 1 (with
--require-fast-1 X: 0 when fast_1 >= X). Usage errors (an unknown option, a bad value)
exit 2 with one `error: ...` line, as unusable inputs do.

Result files go to $KFORGE_RESULTS_DIR, else ./kforge-results/, unless --results names one.
"""

from __future__ import annotations

import os
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
    help="kforge: is this kernel correct AND faster, and what % of the hardware's peak is it at?\n\n"
    "Exit status: 0 passed; 1 a gate failed (suite: not every pair passed, or fast_1 under "
    "--require-fast-1); 2 an unusable input or a usage error (one `error: ...` line); 3 a bug in kforge.\n\n"
    "Result files go to $KFORGE_RESULTS_DIR, else ./kforge-results/, unless --results names one.",
)
out = Console()
err = Console(stderr=True, soft_wrap=True)  # an error stays one line, however long

RESULTS_DIR_ENV = "KFORGE_RESULTS_DIR"
DEFAULT_RESULTS_DIR = Path("kforge-results")
_quiet = False  # --quiet: no spinner or progress line


def default_results(name: str) -> Path:
    """Where a result file goes unless --results names one: NAME in $KFORGE_RESULTS_DIR, else in
    ./kforge-results/ (ignored by git)."""
    return Path(os.environ.get(RESULTS_DIR_ENV) or DEFAULT_RESULTS_DIR) / name


def show(view) -> None:
    """Print VIEW on stdout, its tables laid out for the terminal's width (80 off a terminal):
    text wraps at spaces, never inside a name or a number (kforge/fit.py)."""
    from kforge.fit import Fitted

    out.print(Fitted(view))


def show_progress(json_output: bool = False) -> bool:
    """A spinner or progress line goes to stderr only on a terminal, never with --json or --quiet."""
    return err.is_terminal and not (json_output or _quiet)


def working(description: str, json_output: bool = False):
    """A spinner with the elapsed time on stderr while a long step runs (see show_progress);
    it disappears when the step ends. Use as a context manager."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=err,
                        transient=True, disable=not show_progress(json_output))
    progress.add_task(description, total=None)
    return progress


def print_json(value: object) -> None:
    """VALUE as one line of JSON on stdout: dataclasses and named tuples as objects, paths as
    strings, non-finite floats as null."""
    import json
    import math
    from dataclasses import asdict, is_dataclass

    def plain(v):
        if is_dataclass(v) and not isinstance(v, type):
            return plain(asdict(v))
        if hasattr(v, "_asdict"):
            return plain(v._asdict())
        if isinstance(v, dict):
            return {str(k): plain(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if v is None or isinstance(v, (str, int, float, bool)):
            return v
        return str(v)

    print(json.dumps(plain(value)))


def save_chart_or_say(save, *args, **kwargs) -> None:
    """Draw a chart with SAVE(*args, path, ...) unless matplotlib is missing (the `plot` extra):
    then one line says so, and the table printed before it stands."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        err.print("note: no chart: matplotlib is not installed (pip install 'kforge[plot]')", markup=False,
                  highlight=False)
        return
    path = save(*args, **kwargs)
    err.print(f"chart saved to {path}", style="dim", markup=False, highlight=False)


def _version(value: bool) -> None:
    if not value:
        return
    import platform
    from importlib import metadata

    def version_of(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    import torch  # (imported with kforge already) its own version says the build: +cpu, +cu130, ...

    from kforge import __version__

    print(f"kforge {__version__} (torch {torch.__version__}, triton {version_of('triton')}, "
          f"python {platform.python_version()})")
    raise typer.Exit()


@app.callback()
def _global_options(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print kforge's version (and torch's, triton's, python's) and exit."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No spinner or progress line on stderr (there is "
                               "none off a terminal or with --json either)."),
) -> None:
    global _quiet
    _quiet = quiet


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


STAGE_TIMEOUT_HELP = ("Seconds each stage (load, gate 1, gate 2) may take before the workers are killed and the "
                      "record says `timeout` and the stage (gate 2: this plus --time-budget). "
                      "Default: 600, 600, 3x the budget + 300.")
MIN_SPEEDUP_HELP = ("The bar the lower end of the speedup's 95% interval must clear for PASSED "
                    "(default: 1 + the noise floor the A/A rounds measure, at least 1%).")


WORKER_CPU_HELP = ("The CPU both workers are held to on a GPU: auto (one per GPU, from the top), a CPU number, or "
                   "none (free to move: launch-bound calls then time differently from run to run).")


def worker_cpu_setting(text: str) -> int | str | None:
    """--worker-cpu as TimingConfig.worker_cpu."""
    if text in ("auto", "none"):
        return None if text == "none" else text
    if not text.isdigit():
        raise KforgeError(f"--worker-cpu takes auto, none or a CPU number, not {text!r}")
    return int(text)


def stage_limits(stage_timeout: float | None, time_budget: float):
    """--stage-timeout as the judge's stage limits (None: the judge's defaults)."""
    from kforge.harness.isolation import StageLimits

    if stage_timeout is None:
        return StageLimits()
    return StageLimits(load_s=stage_timeout, gate1_s=stage_timeout, gate2_s=stage_timeout + time_budget)


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
    stage_timeout: float = typer.Option(None, min=1.0, help=STAGE_TIMEOUT_HELP, show_default=False),
    min_speedup: float = typer.Option(None, min=0.0, help=MIN_SPEEDUP_HELP, show_default=False),
    worker_cpu: str = typer.Option("auto", help=WORKER_CPU_HELP),
    size: Size = typer.Option(None, help="Problem size: full, tiny (its tiny_sizes) or auto. "
                              "Default: full on a GPU, auto on a CPU.", show_default=False),
    seed: int = typer.Option(None, help="Run seed, to reproduce a run (default: secret and random; "
                             "needs --in-process)."),
    results: Path = typer.Option(None, dir_okay=False,
                                 help="JSONL file the record is appended to (default: kforge-results.jsonl "
                                 "in $KFORGE_RESULTS_DIR, else in ./kforge-results/).", show_default=False),
    save: bool = typer.Option(True, help="Append the record to --results."),
    json_output: bool = typer.Option(False, "--json", help="Print the record as JSON, and nothing else."),
    in_process: bool = typer.Option(False, "--in-process", help="Run the candidate in this process, not a fresh "
                                    "worker: for a debugger; a crash then takes kforge down with it."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Show whole tracebacks."),
) -> None:
    """Evaluate CANDIDATE against PROBLEM: gate 1 (correct), gate 2 (faster), % of roofline.

    Exit status: 0 both gates passed; 1 a gate failed (incorrect, slower, a tie: not
    measurably faster, or refused by a defence); 2 an unusable input (a missing or broken
    file, a crash, a time limit) or a
    usage error; 3 a bug in kforge.
    """
    from kforge.harness.evaluate import evaluate
    from kforge.harness.isolation import evaluate_isolated
    from kforge.harness.record import append_record
    from kforge.harness.timing import TimingConfig
    from kforge.views import eval_view

    results = results or default_results("kforge-results.jsonl")
    options = dict(baseline=baseline.value, trials=trials,
                   timing=TimingConfig(budget_s=time_budget, worker_cpu=worker_cpu_setting(worker_cpu)),
                   size=size.value if size else None, command=shlex.join(["kforge", *sys.argv[1:]]),
                   min_speedup=min_speedup)
    if seed is not None and not in_process:
        raise KforgeError("--seed needs --in-process: a worker draws its own secret seed")
    if stage_timeout is not None and in_process:
        raise KforgeError("--stage-timeout needs a worker to kill: it cannot be used with --in-process")
    if not in_process:
        options["limits"] = stage_limits(stage_timeout, time_budget)
    with working(f"evaluating {candidate.name} against {problem.name}", json_output):
        if in_process:
            record = evaluate(problem, candidate, seed=seed, **options)
        else:
            record = evaluate_isolated(problem, candidate, **options)
    if save:
        append_record(results, record)
    if json_output:
        print(record.to_json())
    else:
        show(eval_view(record.to_dict(), str(results) if save else None, verbose=verbose))
    raise typer.Exit(record.exit_status)


class SuiteBaseline(str, Enum):
    eager = "eager"
    compile = "compile"
    both = "both"


class SuiteExecutor(str, Enum):
    local = "local"
    ray = "ray"


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
    resume: bool = typer.Option(False, help="Insist that --results exists (every run skips the pairs recorded "
                                "there; this makes a mistyped path an error, not a fresh run)."),
    force: bool = typer.Option(False, help="Evaluate every pair again; new records are appended and "
                               "the latest counts."),
    results: Path = typer.Option(None, dir_okay=False,
                                 help="JSONL store of the suite's records (default: kforge-suite.jsonl in "
                                 "$KFORGE_RESULTS_DIR, else in ./kforge-results/).", show_default=False),
    baseline: SuiteBaseline = typer.Option(SuiteBaseline.eager, help="What the candidates must beat: eager "
                                           "PyTorch, torch.compile of the reference, or both (each pair runs "
                                           "against each; a table and scores for each)."),
    time_budget: float = typer.Option(10.0, min=0.1, help="Seconds of timed rounds per pair at most."),
    size: Size = typer.Option(None, help="Problem size (default: full on a GPU, auto on a CPU).", show_default=False),
    stage_timeout: float = typer.Option(None, min=1.0, help=STAGE_TIMEOUT_HELP, show_default=False),
    min_speedup: float = typer.Option(None, min=0.0, help=MIN_SPEEDUP_HELP, show_default=False),
    worker_cpu: str = typer.Option("auto", help=WORKER_CPU_HELP),
    json_output: bool = typer.Option(False, "--json", help="Print the scores and rows as JSON."),
    require_fast_1: float = typer.Option(None, "--require-fast-1", min=0.0, max=1.0, help="For CI: exit 0 when "
                                         "fast_1 (the share of pairs correct and faster than the baseline) is at "
                                         "least this, for each baseline, instead of only when every pair passed.",
                                         show_default=False),
    executor: SuiteExecutor = typer.Option(SuiteExecutor.local, help="Where the pairs run: local (this machine's "
                                           "GPUs, --gpus) or ray (one judge per GPU of a cluster; "
                                           "pip install 'kforge\\[ray]'; docs/scale-out.md)."),
    address: str = typer.Option(None, help="With --executor ray: the cluster's address (auto: the cluster this "
                                "machine belongs to). Default: start a Ray instance on this machine for the run.",
                                show_default=False),
    ray_resources: str = typer.Option(None, "--ray-resources", help="With --executor ray: what each pair's task "
                                      "holds, NAME=AMOUNT separated by commas (CPU, GPU or a custom resource). "
                                      "Default: GPU=1.", show_default=False),
    mix_devices: bool = typer.Option(False, "--mix-devices", help="Score pairs that ran on different devices "
                                     "in one fast_p (refused otherwise: their speedups do not compare)."),
) -> None:
    """Evaluate every problem in PROBLEMS against its solution; print fast_p and a table.
    Exit status 0 when every pair passed both gates (with --require-fast-1 X: when fast_1 >= X),
    1 otherwise; 2 an unusable input or a usage error; 3 a bug in kforge.

    `kforge suite level1 --solutions builtin` runs kforge's Level 1 suite with its own
    solutions. Pairs already in --results are skipped, so an interrupted suite resumes where
    it stopped; with --baseline both the eager and the torch.compile records share the store.
    With --executor ray the pairs run on a Ray cluster, one judge per GPU, and this process
    alone writes --results (docs/scale-out.md).
    """
    import json
    from dataclasses import asdict

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.text import Text

    from kforge.harness.executors import LocalExecutor
    from kforge.harness.suite import ResultStore, run_suite
    from kforge.harness.timing import TimingConfig
    from kforge.views import suite_view

    results = results or default_results("kforge-suite.jsonl")
    if resume and force:
        raise KforgeError("--resume and --force contradict each other: choose one")
    if resume and not results.is_file():
        raise KforgeError(f"nothing to resume: {results} does not exist")
    pairs = _suite_pairs(problems, solutions, only)
    cpu_setting = worker_cpu_setting(worker_cpu)
    runner = _ray_executor(executor, gpus, address, ray_resources, mix_devices) or LocalExecutor(*_slots(gpus))
    store = ResultStore(results)
    baselines = ["eager", "compile"] if baseline is SuiteBaseline.both else [baseline.value]
    summaries = {}
    running: set[str] = set()

    def started(pair, where, against, task) -> None:
        running.add(pair.name)
        others = f" ({len(running)} running)" if len(running) > 1 else ""
        progress.update(task, description=f"{pair.name} vs {against} on {where}{others}")

    def done(pair, record, task) -> None:
        running.discard(pair.name)
        progress.advance(task)

    with runner, _store_warnings(), Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                             TimeElapsedColumn(), console=err,
                                             disable=not show_progress(json_output)) as progress:
        task = progress.add_task("suite", total=len(pairs) * len(baselines))
        device_name = runner.device_name  # on Ray: a task on each node reports its device
        for against in baselines:
            options = dict(baseline=against, timing=TimingConfig(budget_s=time_budget, worker_cpu=cpu_setting),
                           size=size.value if size else None, min_speedup=min_speedup,
                           limits=stage_limits(stage_timeout, time_budget))
            summaries[against] = run_suite(
                pairs, store, executor=runner, device_name=device_name, force=force, options=options,
                mix_devices=mix_devices,
                on_start=lambda pair, where, against=against: started(pair, where, against, task),
                on_done=lambda pair, record: done(pair, record, task),
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
            show(suite_view(summary, device_name, str(results)))
    # 0 only when every pair passed both gates: a suite is a check CI can rely on
    failed = any(row.status != "passed" for summary in summaries.values() for row in summary.rows)
    if require_fast_1 is not None:  # or, for CI, when enough of them are correct and faster
        failed = any(summary.fast_p.get(1.0, 0.0) < require_fast_1 for summary in summaries.values())
    raise typer.Exit(1 if failed else 0)


class LadderFamily(str, Enum):
    gemm = "gemm"
    abstraction = "abstraction"


@app.command("ladder")
def ladder_command(
    family: LadderFamily = typer.Argument(..., help="Which ladder: gemm (CUDA rungs), or abstraction (the same "
                                          "kernel in Triton, TileLang, Gluon, CuTe DSL and CUDA)."),
    dtype: str = typer.Option(None, help="Data type of the ladder (gemm: fp32, CUDA cores, the default; bf16: "
                              "tensor cores). The abstraction ladder is bf16.", show_default=False),
    size: int = typer.Option(None, min=1, help="M = N = K (default 4096); for the softmax, the row length "
                             "(default 128256).", show_default=False),
    kernel: str = typer.Option(None, help="The abstraction ladder's kernel: gemm (the default) or softmax.",
                               show_default=False),
    compile_only: bool = typer.Option(False, help="The abstraction ladder without a GPU: lines of code and "
                                      "compile time of each level, nothing run."),
    rungs: str = typer.Option(None, help="Rungs to run, e.g. 1,5,9, or levels, e.g. triton,gluon (default: all).",
                              show_default=False),
    sweep: bool = typer.Option(False, help="Instead of the rungs, time every shape in the tuned rung's sweep."),
    time_budget: float = typer.Option(5.0, min=0.1, help="Seconds of timed rounds per rung at most."),
    results: Path = typer.Option(None, dir_okay=False, help="JSONL file the records are appended to (default: "
                                 "ladder-<family>-<dtype>[-sweep].jsonl in $KFORGE_RESULTS_DIR, else in "
                                 "./kforge-results/).", show_default=False),
    chart: Path = typer.Option(None, dir_okay=False,
                               help="PNG chart of the climb (default: the results path with .png).",
                               show_default=False),
    replot: bool = typer.Option(False, help="Measure nothing: redraw the table and chart from the records in "
                                "--results (the latest record of each rung)."),
    json_output: bool = typer.Option(False, "--json", help="Print the table's rows as JSON instead of the table."),
) -> None:
    """Run every rung of a kernel ladder through the harness: one table, one chart."""
    from dataclasses import replace

    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from kforge.ladder import get_ladder, ladder_rows, require_gpu, run_ladder, save_chart
    from kforge.views import ladder_view

    ladder = get_ladder(family.value, dtype, kernel)
    size = size or ladder.default_size
    if ladder.family == "abstraction":
        abstraction_ladder(ladder, size, rungs, time_budget, results, chart, replot, compile_only, json_output)
        return
    if compile_only:
        raise KforgeError("--compile-only is for the abstraction ladder (for the CUDA rungs: kforge resources)")
    stem = f"ladder-{ladder.family}-{ladder.dtype}" + ("-sweep" if sweep else "")
    results = results or default_results(f"{stem}.jsonl")
    chart = chart or results.with_suffix(".png")
    if replot:
        records, device_name, size_text = _ladder_records(results)
    else:
        require_gpu("On a CPU machine, `kforge resources` compiles the rungs and reports their registers, and "
                    "--replot redraws the chart from the records already there.")
        steps = ladder.sweep() if sweep else ladder.steps(rungs.split(",") if rungs else None)
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                      console=err, disable=not show_progress(json_output)) as progress:
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
    if json_output:
        print_json({"title": title, "library": ladder.library, "rows": rows})
    else:
        show(ladder_view(rows, title=title, library=ladder.library,
                              results_path=None if replot else str(results)))
    save_chart_or_say(save_chart, rows, chart, title=title, library=ladder.library)


def _ladder_records(results: Path) -> tuple[list, str, str]:
    """A ladder's latest record per step from its store, for --replot: (records, device, size)."""
    from kforge.harness.record import read_records
    from kforge.ladder import latest_per_step

    if not results.is_file():
        raise KforgeError(f"nothing to replot: {results} does not exist")
    with _store_warnings():
        records = latest_per_step(read_records(results))
    if not records:
        raise KforgeError(f"nothing to replot: {results} holds no records")
    return records, records[0]["device"]["name"], records[0]["problem"].get("size")


def abstraction_ladder(ladder, size: int, rungs: str | None, time_budget: float, results: Path | None,
                       chart: Path | None, replot: bool, compile_only: bool, json_output: bool) -> None:
    """`kforge ladder abstraction`: each installed level through both gates (or, --replot, from
    the records; --compile-only, none), each compiled for sm_90a from a cold cache, one table."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from kforge.kernels.abstraction.compiling import measure
    from kforge.ladder import abstraction_rows, ladder_rows, require_gpu, run_ladder, save_chart
    from kforge.views import abstraction_view

    if replot and compile_only:
        raise KforgeError("--replot redraws measured records and --compile-only measures none: pick one")
    steps = ladder.steps(rungs.split(",") if rungs else None)  # unknown or missing levels stop here
    chosen = {label for label, _ in steps}
    skipped = [level.missing() for level in ladder.levels() if level.missing()]
    results = results or default_results(f"ladder-abstraction-{ladder.kernel}.jsonl")
    chart = chart or results.with_suffix(".png")
    records, device_name, size_text = [], "this machine", f"{size:,}"
    if replot:
        records, device_name, size_text = _ladder_records(results)
    elif not compile_only:
        require_gpu("On a CPU machine, --compile-only compiles every rung and reports its registers.")
    for line in skipped:
        err.print(line, markup=False, highlight=False)
    compiled = {}
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=err,
                  disable=not show_progress(json_output)) as progress:
        task = progress.add_task("compiling", total=len(steps))
        for level in ladder.levels():
            if level.tool in chosen:
                progress.update(task, description=f"compiling {level.tool} for sm_90a")
                compiled[level.tool] = measure(level, size)
                progress.advance(task)
        if not (replot or compile_only):
            progress.update(task, total=len(steps), completed=0)
            records = run_ladder(ladder, size, steps, time_budget=time_budget, results=results,
                                 command=shlex.join(["kforge", *sys.argv[1:]]), on_step=lambda label, record: progress.update(
                                     task, description=label if record is None else "ladder",
                                     advance=0 if record is None else 1))
            device_name = records[0].device["name"]
    rows = abstraction_rows(ladder, records, compiled)
    rate_unit = "TFLOP/s" if ladder.kernel == "gemm" else "GB/s"
    title = (f"abstraction ladder, {ladder.kernel} bf16: compiled for sm_90a, nothing run" if compile_only
             else f"abstraction ladder, {ladder.kernel} bf16, {size_text} on {device_name}: vs {ladder.library}")
    if json_output:
        print_json({"title": title, "library": ladder.library, "rate_unit": rate_unit, "rows": rows,
                    "skipped": skipped})
    else:
        show(abstraction_view(rows, title=title, library=ladder.library, rate_unit=rate_unit, skipped=skipped,
                              results_path=None if replot or compile_only else str(results)))
    if records and ladder.kernel == "gemm":
        save_chart_or_say(save_chart, ladder_rows(records, ladder.dtype, ladder.peak), chart, title=title,
                          library=ladder.library)


class BenchFamily(str, Enum):
    gemm = "gemm"
    attention = "attention"
    serving = "serving"
    quant = "quant"
    model = "model"
    mla = "mla"
    moe = "moe"


@app.command("bench")
def bench_command(
    family: BenchFamily = typer.Argument(..., help="What to benchmark: gemm, attention, serving, quant, model, mla "
                                         "or moe."),
    shapes: str = typer.Option("all", help="all; for gemm also squares or llm; for serving an op group (norms, "
                               "swiglu, rope, gemv, paged, norm_qkv, varlen); for quant a group (fp8, w4a16, "
                               "nvfp4-gemv, nvfp4-gemm); for moe a group (bf16, fp8, gemm, layer, deepgemm, "
                               "experts); or a comma list of shape labels "
                               "(gemm: 1024^3, '8B qkv M=16', ...; attention: 'full N=4096 D=128', "
                               "'causal N=512 D=64', ...)."),
    time_budget: float = typer.Option(1.0, min=0.1, help="Seconds of timed rounds per evaluation at most."),
    results: Path = typer.Option(None, dir_okay=False,
                                 help="JSONL file the records are appended to (default: bench-FAMILY.jsonl "
                                 "in $KFORGE_RESULTS_DIR, else in ./kforge-results/).", show_default=False),
    chart: Path = typer.Option(None, dir_okay=False,
                               help="PNG chart (default: the results path with .png).", show_default=False),
    replot: bool = typer.Option(False, help="Measure nothing: redraw the table and chart from --results."),
    sweep: bool = typer.Option(False, help="attention: time our kernel in each of its autotuner's configs "
                               "instead of the methods."),
    backward: bool = typer.Option(False, help="attention: time the backward pass and a training step (forward + "
                                  "backward) of ours, SDPA flash and SDPA cuDNN instead of the forward (default "
                                  "results: bench-attention-backward.jsonl)."),
    json_output: bool = typer.Option(False, "--json", help="Print the table's rows as JSON instead of the table."),
    model: str = typer.Option(None, "--model", help="model: a preset, random weights (default llama3-8b; "
                              "llama3-1b or tiny for quick runs).", show_default=False),
    parts: str = typer.Option(None, help="model: a comma list of decode, batch, prefill, trace (default all).",
                              show_default=False),
    weights: str = typer.Option(None, help="model: our weight formats, a comma list of bf16, w4a16, fp8 (default "
                                "all; batch, prefill and trace run the first).", show_default=False),
    baselines: str = typer.Option(None, help="model: transformers, compiled, both (default) or none.",
                                  show_default=False),
    sizes: str = typer.Option(None, help="model: KEY=VALUE,... over the defaults: prompt=512, steps=128, warmup=8, "
                              "batch=64, context=4096, batch_steps=32, prefill_batch=8, prefill_len=2048, "
                              "prefill_reps=5, requests=64, rate=4, trace_prompt=128:1024, trace_output=64:256, "
                              "slots=32, step_tokens=2048.", show_default=False),
    max_seconds: float = typer.Option(None, help="model: start no part or method after this many seconds (the "
                                      "rest are recorded as skipped).", show_default=False),
    compile_mode: str = typer.Option(None, help="model: torch.compile mode of the compiled baseline's decode: "
                                     "max-autotune (default), reduce-overhead or default.", show_default=False),
) -> None:
    """Our kernels against the best library over a sweep of shapes, in one run: GEMM vs
    cuBLAS (ours and Triton), attention vs SDPA's flash backend (ours, naive, cuDNN,
    efficient), serving kernels vs eager PyTorch and torch.compile (GB/s, % of copy),
    low-precision kernels vs torch._scaled_mm and bf16 cuBLAS on the same numbers; the
    Llama engine vs transformers and a compiled gpt-fast-style model (tok/s, % of the
    weight-bandwidth floor); MoE grouped GEMMs (bf16, FP8) vs torch._grouped_mm and
    per-expert loops, and DeepSeek-V3's MoE layer vs a PyTorch composition, split by stage."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from kforge.bench import bench_rows, run_bench, save_bench_chart
    from kforge.harness.record import read_records

    if backward and (family != BenchFamily.attention or sweep):
        raise KforgeError("--backward is for kforge bench attention, without --sweep")
    results = results or default_results(f"bench-{family.value}{'-backward' if backward else ''}.jsonl")
    chart = chart or results.with_suffix(".png")
    model_only = {"--model": model, "--parts": parts, "--weights": weights, "--baselines": baselines,
                  "--sizes": sizes, "--max-seconds": max_seconds, "--compile-mode": compile_mode}
    if family == BenchFamily.model:
        if shapes != "all" or sweep or time_budget != 1.0:
            raise KforgeError("kforge bench model takes --parts, --sizes and --max-seconds, not --shapes, --sweep "
                              "or --time-budget")
        _bench_model(model_only, results=results, chart=chart, replot=replot, json_output=json_output)
        return
    if any(value is not None for value in model_only.values()):
        given = ", ".join(name for name, value in model_only.items() if value is not None)
        raise KforgeError(f"{given}: for kforge bench model only")
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
    elif family == BenchFamily.mla:
        from kforge.bench import mla as bench
        every, groups, make_jobs, label = bench.mla_shapes(), {}, bench.mla_jobs, bench.mla_label
    elif family == BenchFamily.moe:
        from kforge.bench import moe as bench
        every = bench.moe_shapes()
        groups, make_jobs, label = bench.moe_groups(every), bench.moe_jobs, bench.moe_label
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
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=err,
                      disable=not show_progress(json_output)) as progress:
            task = progress.add_task("bench", total=None)
            command = shlex.join(["kforge", *sys.argv[1:]])
            if backward:
                records = bench.run_attention_backward(chosen, time_budget=time_budget, results=results,
                                                       command=command,
                                                       on_step=lambda text: progress.update(task, description=text))
            else:
                records = run_bench(make_jobs(chosen), time_budget=time_budget, results=results, command=command,
                                    on_step=lambda text: progress.update(task, description=text))
            if family == BenchFamily.moe:  # the layer's time by stage, in process (bench/moe.py)
                records += bench.run_moe_stages(chosen, time_budget=time_budget, results=results,
                                                command=shlex.join(["kforge", *sys.argv[1:]]),
                                                on_step=lambda text: progress.update(task, description=text))
    if not records:
        raise KforgeError(f"no records in {results}")
    device_name = records[0]["device"]["name"]
    results_path = None if replot else str(results)
    if backward:
        _show_attention_backward(records, device_name, chart=chart, json_output=json_output,
                                 results_path=results_path)
        return
    if family in (BenchFamily.serving, BenchFamily.mla):
        from kforge.bench.serving import save_serving_chart, serving_rows
        from kforge.views import serving_bench_view

        rows = serving_rows(records, label)
        what = "serving kernels bf16" if family == BenchFamily.serving else "MLA decode bf16"
        title = f"{what} on {device_name}: ours vs eager PyTorch and torch.compile (same run)"
        if json_output:
            print_json({"title": title, "rows": rows})
        else:
            show(serving_bench_view(rows, title=title, results_path=results_path))
        save_chart_or_say(save_serving_chart, rows, chart, title=title)
        return
    if family == BenchFamily.moe:
        from kforge.views import moe_bench_view

        rows, stages = bench.moe_rows(records), bench.moe_stage_tables(records)
        title = f"MoE grouped GEMMs and DeepSeek-V3 layer on {device_name}: ours vs PyTorch (same run)"
        if json_output:
            print_json({"title": title, "rows": rows, "stages": stages})
        else:
            show(moe_bench_view(rows, stages, title=title, results_path=results_path))
        if rows:
            save_chart_or_say(bench.save_moe_chart, rows, chart, title=title)
        return
    if family == BenchFamily.quant:
        from kforge.views import quant_bench_view

        title = f"low-precision kernels on {device_name}: ours vs the best PyTorch path on the same numbers"
        if json_output:
            print_json({"title": title, "rows": bench.quant_rows(records)})
        else:
            show(quant_bench_view(bench.quant_rows(records), title=title, results_path=results_path))
        return
    rows = bench_rows(records, bench.BASELINE, label)
    if family == BenchFamily.gemm:
        from kforge.views import bench_view

        title = f"GEMM bf16 on {device_name}: ours and Triton vs cuBLAS (same run)"
        if not json_output:
            show(bench_view(rows, title=title, baseline=bench.BASELINE, results_path=results_path))
        save, kwargs = save_bench_chart, dict(title=title, baseline=bench.BASELINE)
    else:
        from kforge.views import attention_bench_view

        title = f"attention forward bf16 on {device_name}: vs SDPA flash (same run)"
        if not json_output:
            show(attention_bench_view(rows, title=title, records=records, results_path=results_path))
        save, kwargs = bench.save_attention_chart, dict(title=title, records=records)
    if json_output:
        print_json({"title": title, "baseline": bench.BASELINE, "rows": rows})
    save_chart_or_say(save, rows, chart, **kwargs)


def _show_attention_backward(records: list[dict], device_name: str, *, chart: Path, json_output: bool,
                             results_path: str | None) -> None:
    """`kforge bench attention --backward`: the table (or --json) and the chart of the backward records."""
    from kforge.bench import attention as bench
    from kforge.views import attention_backward_view

    lines = bench.backward_lines(records)
    if not lines:
        raise KforgeError("no backward records: the file holds other benchmarks' records")
    title = f"attention backward and training step bf16 on {device_name}: vs SDPA flash (same run)"
    if json_output:
        print_json({"title": title, "baseline": bench.BASELINE, "rows": lines})
    else:
        show(attention_backward_view(lines, title=title, results_path=results_path))
    rows = bench.backward_bench_rows(records, "backward")
    if rows:
        save_chart_or_say(bench.save_attention_chart, rows, chart, title=f"{title}: backward", records=records)


def _bench_model(given: dict, *, results: Path, chart: Path, replot: bool, json_output: bool) -> None:
    """`kforge bench model`: run (or, with --replot, read) the records, then the table and the chart."""
    from kforge.bench import model as bench
    from kforge.harness.record import read_records

    if replot:
        if not results.is_file():
            raise KforgeError(f"nothing to replot: {results} does not exist")
        with _store_warnings():
            records = [r for r in read_records(results) if r.get("bench") == "model"]
    else:
        options = bench.ModelBenchOptions.parse(**{name[2:].replace("-", "_"): value for name, value in given.items()})
        # progress on stdout as it happens, so a run cut short still shows how far it got; stderr under --json
        log = (lambda line: err.print(line, markup=False, highlight=False)) if json_output else \
            (lambda line: print(line, flush=True))
        records = bench.ModelBench(options, results=results, command=shlex.join(["kforge", *sys.argv[1:]]),
                                   log=log).run()
    if not records:
        raise KforgeError(f"no records in {results}")
    rows = bench.model_rows(records)
    title = bench.model_title(records)
    if json_output:
        print_json({"title": title, "rows": rows})
    else:
        show(bench.model_view(rows, title=title, copy=records[-1].get("copy"),
                              results_path=None if replot else str(results)))
    save_chart_or_say(bench.save_model_chart, rows, chart, title=title)


tune_app = typer.Typer(no_args_is_help=True, help="Time the kernels an op may choose on this GPU and write its "
                       "dispatch table.")
app.add_typer(tune_app, name="tune")


@tune_app.command("gemm")
def tune_gemm_command(
    shapes: str = typer.Option("bench", help="bench (kforge bench gemm's squares and Llama-3 projections), or "
                               "'M,N,K[:kn|nk];...' (nk: y = x W^T)."),
    time_budget: float = typer.Option(1.0, min=0.1, help="Seconds of timed rounds per evaluation at most."),
    results: Path = typer.Option(None, dir_okay=False,
                                 help="JSONL file the records are appended to (default: tune-gemm.jsonl in "
                                 "$KFORGE_RESULTS_DIR, else in ./kforge-results/).", show_default=False),
    from_records: Path = typer.Option(None, "--from-records", help="Time nothing: build the table from these "
                                      "records (any machine).", show_default=False),
    device_name: str = typer.Option(None, "--device-name", help="With --from-records: whose records (default: the "
                                    "only device in them).", show_default=False),
    out: Path = typer.Option(None, dir_okay=False,
                             help="Where the table goes (default: where kforge.ops.matmul reads it, "
                             "$KFORGE_CACHE_DIR/dispatch/).", show_default=False),
) -> None:
    """Which bf16 GEMM kernel kforge.ops.matmul runs for each shape: every candidate (rungs 4-6
    and rung 4's variants) judged against cuBLAS, both gates; per shape the fastest that is
    faster than cuBLAS, else cuBLAS itself. Shapes no table holds keep the built-in rules.
    See src/kforge/tune.py."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from kforge import tune
    from kforge.harness.record import read_records

    command = shlex.join(["kforge", *sys.argv[1:]])
    if from_records is not None:
        if not from_records.is_file():
            raise KforgeError(f"--from-records: {from_records} does not exist")
        with _store_warnings():
            records = read_records(from_records)
        devices = sorted({r["device"]["name"] for r in records})
        if device_name is None:
            if len(devices) != 1:
                raise KforgeError(f"--from-records: records of {len(devices)} devices ({', '.join(devices) or 'none'});"
                                  " name one with --device-name")
            device_name = devices[0]
    else:
        import torch

        from kforge.bench import run_bench
        from kforge.device import current_device

        if not torch.cuda.is_available():
            raise KforgeError("kforge tune gemm times kernels on a GPU, and this machine has no CUDA device",
                              "Build a table from records on any machine: --from-records FILE.")
        device_name = current_device("cuda").name
        results = results or default_results("tune-gemm.jsonl")
        jobs = tune.tune_jobs(tune.tune_shapes(shapes))
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=err,
                      disable=not show_progress()) as progress:
            task = progress.add_task("tune", total=None)
            records = run_bench(jobs, time_budget=time_budget, results=results, command=command,
                                on_step=lambda text: progress.update(task, description=text))
    table = tune.table_from_records(records, device_name, command)
    if not table.entries:
        raise KforgeError(f"no tune records of {device_name} (candidates named 'rung N ...' on matmul_bf16 or "
                          "linear_bf16)")
    path = table.save(out or tune.user_table_path(device_name))
    tune.load_table.cache_clear()
    view = Table(title=f"GEMM dispatch on {device_name}: {path}", title_justify="left")
    for column in ("M", "N", "K", "B", "runs", "vs cuBLAS (95% interval)"):
        view.add_column(column, justify="right" if column in "MNK" else "left")
    for e in table.entries:
        ratio = "" if e.speedup is None else f"{e.speedup:.3f}x" + (
            f" ({e.low:.3f}-{e.high:.3f})" if e.low is not None and e.high is not None else "")
        view.add_row(str(e.m), str(e.n), str(e.k), e.b_layout, e.choice, ratio or "none of ours faster")
    show(view)


trace_app = typer.Typer(no_args_is_help=True, help="Step through an algorithm and print every intermediate.")
app.add_typer(trace_app, name="trace")


@trace_app.command("online-softmax", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def trace_online_softmax_command(ctx: typer.Context) -> None:
    """The online softmax tile by tile: tile max, running max m, rescale exp(m_old - m_new),
    running denominator l, then the check against the softmax of all scores at once.

    Usage: kforge trace online-softmax --tiles "1,3" "2,5" [--values ["10,20,30,40"]] [--json]
    Each tile is a comma list of scores. --values adds one value per score (default 1, 2,
    ...) and the running attention output. --json prints the trace as JSON instead.
    """
    from kforge.kernels.attention.online_softmax import trace_online_softmax
    from kforge.views import online_softmax_view

    json_output = "--json" in ctx.args
    tiles, values = parse_trace_args([token for token in ctx.args if token != "--json"])
    try:
        trace = trace_online_softmax(tiles, values)
    except ValueError as exc:
        raise KforgeError(str(exc)) from None
    if json_output:
        print_json({"trace": trace, "agrees": trace.agrees()})
    else:
        show(online_softmax_view(trace))
    if not trace.agrees():
        raise typer.Exit(1)


@trace_app.command("accumulate")
def trace_accumulate_command(
    terms: int = typer.Option(64, min=1, max=4096, help="How many products near 1.0 to add up."),
    seed: int = typer.Option(20, help="Seed of the products (20 reproduces the seed document's table)."),
    json_output: bool = typer.Option(False, "--json", help="Print the steps as JSON instead of the table."),
) -> None:
    """Why the accumulator must be wide: products of e4m3 pairs near 1.0 summed step by step
    with an FP8 (e4m3), an FP16 and an FP32 accumulator, each rounded after every add,
    against the exact sum. FP8's step at 32 is 16: adding ~1 rounds back, and it freezes."""
    from kforge.kernels.quant.trace import accumulate_trace, render_accumulate_trace

    steps = accumulate_trace(n_terms=terms, seed=seed)
    if json_output:
        print_json(steps)
    else:
        show(render_accumulate_trace(steps))


@trace_app.command("formats")
def trace_formats_command(
    json_output: bool = typer.Option(False, "--json", help="Print the rows as JSON instead of the table."),
) -> None:
    """Each quantized format's bits per value (scales included) and relative error against
    bf16 on Gaussian and heavy-tailed weights and on activations with outlier channels."""
    from kforge.kernels.quant.trace import format_error_table, render_format_error_table

    with working("quantizing the test tensors in each format", json_output):
        rows = format_error_table()
    if json_output:
        print_json(rows)
    else:
        show(render_format_error_table(rows))


class MoeScoring(str, Enum):
    softmax = "softmax"
    sigmoid = "sigmoid"


@trace_app.command("moe")
def trace_moe_command(
    logits: Path = typer.Argument(None, help="Router logits, (tokens, experts): a .pt (torch.save of a tensor) or "
                                  ".npy file. Or --random.", show_default=False),
    random: str = typer.Option(None, "--random", help="Random N(0, 1) logits of T tokens and E experts: T,E.",
                               show_default=False),
    seed: int = typer.Option(0, help="Seed of --random."),
    top_k: int = typer.Option(2, "--top-k", min=1, help="Experts a token goes to."),
    capacity_factor: float = typer.Option(None, "--capacity-factor", help="Cap each expert at ceil(factor * "
                                          "tokens * top_k / experts) assignments, dropping the rest in token order "
                                          "(default: no cap).", show_default=False),
    align: int = typer.Option(128, min=1, help="Tile height: each expert's rows are padded to a multiple of it."),
    gating: MoeScoring = typer.Option(MoeScoring.softmax, help="softmax (Mixtral) or sigmoid (DeepSeek-V3)."),
    groups: int = typer.Option(1, min=1, help="sigmoid: expert groups (group-limited routing)."),
    topk_groups: int = typer.Option(None, "--topk-groups", min=1, help="sigmoid: groups kept per token (default: "
                                    "all).", show_default=False),
    json_output: bool = typer.Option(False, "--json", help="Print the rows and totals as JSON instead of the table."),
) -> None:
    """Route tokens to experts and show what the grouped GEMM gets: per expert the
    assignments routed, kept and dropped, its tiles, their padding rows and utilization."""
    from kforge.kernels.moe.gating import Gating
    from kforge.kernels.moe.trace import load_logits, random_logits, render_moe_trace, trace_moe

    try:
        if (logits is None) == (random is None):
            raise ValueError("give a logits file or --random T,E (one of them)")
        if random is not None:
            try:
                tokens, experts = (int(x) for x in random.split(","))
            except ValueError:
                raise ValueError(f"--random takes T,E (two integers), got {random!r}") from None
            scores = random_logits(tokens, experts, seed)
        else:
            scores = load_logits(logits)
        gate = Gating(gating.value, top_k, groups, topk_groups or groups)
        trace = trace_moe(scores, gate, align, capacity_factor)
    except ValueError as exc:
        raise KforgeError(str(exc)) from None
    if json_output:
        total = trace.total._asdict()
        del total["expert"]
        print_json({"tokens": trace.tokens, "experts": trace.experts, "top_k": top_k, "align": align,
                    "capacity": trace.capacity, "rows": trace.loads, "total": total})
    else:
        show(render_moe_trace(trace))


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
    json_output: bool = typer.Option(False, "--json", help="Print one JSON object per kernel, in a list."),
) -> None:
    """Compile CUDA sources with NVRTC and report registers, shared memory and spills per kernel."""
    from dataclasses import asdict

    from rich.table import Table

    from kforge.runtime.cuda import compile_cuda, resources

    sources = sources or sorted((Path(__file__).parent / "kernels").rglob("*.cu"))
    for source in sources:
        if not source.is_file():
            raise KforgeError(f"no such file: {source}")
        if source.suffix not in (".cu", ".cuh"):
            raise KforgeError(f"{source} is not a CUDA source (.cu): `kforge resources` compiles CUDA with NVRTC")
    table = Table(title=f"kernel resources for {arch} (ptxas via NVRTC; cuobjdump)", title_justify="left")
    for column in ("source", "kernel", "registers", "shared B", "stack B", "spill stores B", "spill loads B"):
        table.add_column(column, justify="left" if column in ("source", "kernel") else "right")
    found = []
    with working(f"compiling {len(sources)} source(s) for {arch}", json_output) as progress:
        for source in sources:
            progress.update(progress.task_ids[0], description=f"compiling {source.name} for {arch}")
            found += [(source, name, r) for name, r in resources(compile_cuda(source, arch=arch)).items()]
    if json_output:
        print_json([{"source": str(source), "kernel": name, **asdict(r)} for source, name, r in found])
        return
    for source, name, r in found:
        table.add_row(source.name, name, str(r.registers), f"{r.shared_bytes:,}", str(r.stack_bytes),
                      str(r.spill_stores), str(r.spill_loads), style="red" if r.spill_stores or r.spill_loads else None)
    show(table)


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


class Weights(str, Enum):
    bf16 = "bf16"
    w4a16 = "w4a16"
    fp8 = "fp8"


WEIGHTS_HELP = "Linear weights as bf16, INT4 group-128 (w4a16) or block-scaled FP8, quantized at load time."
QUANTIZE_HEAD_HELP = ("The LM head in --weights' format too, as gpt-fast quantizes it: fewer bytes a step, more "
                      "error in the logits.")


def _load_llama(model: str, json_output: bool = False, weights: str = "bf16", quantize_head: bool = False):
    """(model, tokenizer or None, "cuda" or "cpu") for --model: a preset's random weights or a checkpoint directory,
    on the GPU when there is one, its linear weights in `weights`' format (and its LM head, with `quantize_head`)."""
    import torch

    from kforge.errors import ModelError
    from kforge.models.llama import PRESETS, from_pretrained, random_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    # a CPU has no fast bf16 matmul, but the quantized formats' ops take bf16 activations
    dtype = torch.bfloat16 if device == "cuda" or weights != "bf16" else torch.float32
    if model in PRESETS and device == "cpu":
        from kforge.device import current_device

        need, have = PRESETS[model].parameter_count() * dtype.itemsize, current_device("cpu").memory_bytes
        if have and need > have // 2:  # random weights drawn in place, then the step's buffers: it would swap
            raise ModelError(f"no CUDA device: {model}'s weights need {need / 1e9:.0f} GB in {str(dtype)[6:]} on "
                             f"this CPU, more than half of its {have / 1e9:.0f} GB; a CPU runs the small presets "
                             "(--model tiny)")
    with working(f"loading {model}", json_output):
        if model in PRESETS:
            return random_model(model, dtype=dtype, device=device, weights=weights,
                                quantize_head=quantize_head), None, device
        if not Path(model).exists():
            raise ModelError(f"{model!r} is neither a preset ({', '.join(PRESETS)}) nor a checkpoint directory")
        return *from_pretrained(Path(model), dtype=dtype, device=device, weights=weights,
                                quantize_head=quantize_head), device


@app.command("generate")
def generate_command(
    model: str = typer.Option(..., "--model", help="A preset (llama3-8b, llama3-70b, llama3-1b, tiny: random "
                              "weights, no download) or a Hugging Face Llama checkpoint directory."),
    prompt: str = typer.Option(None, help="Text to continue (needs the checkpoint's tokenizer.json).",
                               show_default=False),
    prompt_ids: str = typer.Option(None, "--prompt-ids", help="Or token ids, e.g. 1,17,99.", show_default=False),
    max_tokens: int = typer.Option(64, min=1, help="New tokens at most."),
    temperature: float = typer.Option(0.0, min=0.0, help="0: greedy."),
    top_k: int = typer.Option(0, min=0, help="Keep the k most likely tokens (0: off)."),
    top_p: float = typer.Option(1.0, min=0.0, max=1.0, help="Keep the nucleus of this probability (1: off)."),
    seed: int = typer.Option(None, help="Sampling seed (default: random).", show_default=False),
    weights: Weights = typer.Option(Weights.bf16, help=WEIGHTS_HELP),
    quantize_head: bool = typer.Option(False, "--quantize-head", help=QUANTIZE_HEAD_HELP),
    max_context: int = typer.Option(2048, min=16, help="KV cache length per request, in tokens."),
    json_output: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Generate tokens with a Llama-3 model on kforge's kernels (on a CPU: their PyTorch references)."""
    import time

    from kforge.models.engine import Engine
    from kforge.models.sampling import SamplingParams

    if (prompt is None) == (prompt_ids is None):
        raise KforgeError("give exactly one of --prompt and --prompt-ids")
    llm, tokenizer, device = _load_llama(model, json_output, weights.value, quantize_head)
    if prompt_ids is not None:
        try:
            tokens = [int(t) for t in prompt_ids.split(",")]
        except ValueError:
            raise KforgeError(f"--prompt-ids takes integers separated by commas, got {prompt_ids!r}") from None
    engine = Engine(llm, tokenizer=tokenizer, max_slots=1, max_context=min(max_context, llm.config.max_position))
    try:
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=max_tokens, seed=seed)
    except ValueError as exc:
        raise KforgeError(str(exc)) from None
    request = engine.submit(prompt if prompt_ids is None else tokens, params)
    started = time.perf_counter()
    for _ in engine.run():
        pass
    elapsed = time.perf_counter() - started
    text = engine.decode(request.output)
    ttft = request.token_times[0] - request.arrival
    decode_s = request.token_times[-1] - request.token_times[0]
    head = weights.value if llm.head_q is not None else str(llm.head.dtype).removeprefix("torch.")
    result = {"model": model, "device": device, "weights": weights.value, "head": head,
              "prompt_tokens": len(request.prompt), "output_ids": request.output,
              "text": text, "finish_reason": request.finish_reason, "ttft_s": ttft, "seconds": elapsed,
              "decode_tokens_per_s": (len(request.output) - 1) / decode_s if decode_s > 0 else None}
    if json_output:
        print_json(result)
        return
    print(text if text is not None else " ".join(map(str, request.output)))
    rate = f"{result['decode_tokens_per_s']:.1f} tok/s decode" if result["decode_tokens_per_s"] else "one token"
    err.print(f"{len(request.prompt)} prompt + {len(request.output)} new tokens ({request.finish_reason}) on "
              f"{device}: first token {ttft * 1e3:.0f} ms, {rate}", style="dim")


@app.command("serve")
def serve_command(
    model: str = typer.Option(..., "--model", help="A preset (random weights, no download) or a Hugging Face Llama "
                              "checkpoint directory; the model id clients name."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8000, min=0, max=65535, help="Port to listen on (0: any free one)."),
    max_slots: int = typer.Option(8, min=1, help="Requests generating at once; more wait their turn."),
    max_context: int = typer.Option(2048, min=16, help="KV cache length per request (prompt + new tokens)."),
    weights: Weights = typer.Option(Weights.bf16, help=WEIGHTS_HELP),
    quantize_head: bool = typer.Option(False, "--quantize-head", help=QUANTIZE_HEAD_HELP),
) -> None:
    """Serve the model over OpenAI's HTTP API (/v1/completions, /v1/chat/completions, streaming) until Ctrl-C."""
    import time

    from kforge.models.chat import load_chat_template
    from kforge.models.engine import Engine
    from kforge.models.server import Server

    llm, tokenizer, device = _load_llama(model, weights=weights.value, quantize_head=quantize_head)
    template = load_chat_template(Path(model)) if tokenizer is not None else None
    engine = Engine(llm, tokenizer=tokenizer, max_slots=max_slots,
                    max_context=min(max_context, llm.config.max_position))
    server = Server(engine, model_id=model, host=host, port=port, chat_template=template)
    try:
        server.start()
    except OSError as exc:
        raise KforgeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    formats = "" if weights is Weights.bf16 else f" ({weights.value}{', head too' if quantize_head else ''})"
    print(f"serving {model}{formats} on {device} at {server.url} (Ctrl-C stops)", flush=True)
    if tokenizer is None:
        err.print("note: no tokenizer: prompts must be token ids, and chat is refused", style="dim")
    elif template is None:
        err.print("note: the checkpoint has no chat template: chat prompts are plain 'role: content' lines",
                  style="dim")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


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
    measuring = remeasure or not ceilings_path(device).is_file()
    if measuring and not show_progress(json_output) and not _quiet:  # a line for logs, else a spinner
        err.print(f"measuring the ceilings of {device.name} ...", style="dim")
    with working(f"measuring the ceilings of {device.name}", json_output or not measuring):
        ceilings = get_ceilings(device, remeasure=remeasure)
    if json_output:
        print(json.dumps(ceilings.to_dict(), indent=2))
    else:
        show(ceilings_view(ceilings, str(ceilings_path(device))))


@app.command("report")
def report_command(
    results_dir: Path = typer.Argument(Path("benchmarks/results"), help="Folder of <device>/<bench>.jsonl records."),
    output: Path = typer.Option(None, "--output", "-o", dir_okay=False,
                                help="Markdown file to write (default: RESULTS.md in $KFORGE_RESULTS_DIR, else in "
                                "./kforge-results/).", show_default=False),
) -> None:
    """Every record's table as one Markdown page (a view; measures nothing). The docs' own
    tables are written by `python -m kforge.docs_tables`."""
    from kforge.views import results_markdown

    if not results_dir.is_dir():
        raise KforgeError(f"no results folder: {results_dir}")
    output = output or default_results("RESULTS.md")
    with _store_warnings():
        text = results_markdown(results_dir)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text)
    err.print(f"wrote {output}", style="dim", markup=False)


WORKLOG_LAYOUT = ("FOLDER/problem.py (the reference, required); FOLDER/plan.md (the plan, written before any "
                  "timing; optional, included verbatim); FOLDER/hand/*.py (your versions, each module docstring's "
                  "first line saying why); FOLDER/hand.jsonl (their records: --evaluate appends the missing ones); "
                  "FOLDER/machine.jsonl (the model's attempts: kforge machine ... --results FOLDER/machine.jsonl).")


@app.command("worklog", help="Write FOLDER/worklog.md: you vs the machine on one problem, in five sections (the "
             "problem and the plan; the by-hand versions; the model's attempt; the head-to-head; what each got "
             "stuck on), with charts beside it, every figure read from the records. A worklog.md you wrote "
             "yourself is never overwritten: the page goes to worklog.generated.md instead.\n\n"
             f"Layout: {WORKLOG_LAYOUT}\n\n"
             "Exit status: 0 written; 2 an unusable input (no problem.py) or a usage error; 3 a bug in kforge.")
def worklog_command(
    folder: Path = typer.Argument(..., help="The worklog folder (layout above).", show_default=False),
    evaluate: bool = typer.Option(False, "--evaluate", help="First evaluate, as `kforge eval` does, each hand/*.py "
                                  "that hand.jsonl has no record of on this machine's device (this content, this "
                                  "problem.py), appending each record."),
    time_budget: float = typer.Option(10.0, min=0.1, help="--evaluate: seconds of timed rounds per version at most."),
    device: str = typer.Option(None, "--device", help="Report the records of this device (its name as the records "
                               "give it; default: the device of the newest record).", show_default=False),
) -> None:
    from kforge.machine.worklog import evaluate_hand, problem_path, write_worklog

    problem_path(folder)  # no problem.py: one error line before anything runs
    if evaluate:
        from kforge.device import current_device
        from kforge.harness.timing import TimingConfig

        here = current_device().name
        with working(f"evaluating the hand versions in {folder}") as progress:
            records = evaluate_hand(folder, here, timing=TimingConfig(budget_s=time_budget),
                                    command=shlex.join(["kforge", *sys.argv[1:]]),
                                    on_file=lambda path: progress.update(progress.task_ids[0],
                                                                         description=f"evaluating {path.name}"))
        for record in records:
            speedup = f" {record.speedup:.3f}x" if record.speedup is not None else ""
            err.print(f"evaluated {record.candidate['name']}.py on {here}: {record.status}{speedup}",
                      markup=False, highlight=False)
    written = write_worklog(folder, device)
    for note in written.notes:
        err.print(f"[bold yellow]note:[/] {escape(note)}", highlight=False)
    if written.fallback:
        err.print(f"note: {folder / 'worklog.md'} was not written by kforge, so it is left as it is",
                  markup=False, highlight=False)
    for chart in written.charts:
        err.print(f"chart saved to {chart}", style="dim", markup=False, highlight=False)
    err.print(f"wrote {written.path}", style="dim", markup=False, highlight=False)


class MachineBackend(str, Enum):
    triton = "triton"
    cuda = "cuda"


@app.command("machine")
def machine_command(
    problem: Path = typer.Argument(..., help="Problem file: Model, get_inputs(), get_init_inputs()."),
    base_url: str = typer.Option(None, "--base-url", help="An OpenAI-compatible endpoint, e.g. "
                                 "http://localhost:8000/v1 (default: the openai client's, $OPENAI_BASE_URL or "
                                 "OpenAI's).", show_default=False),
    model: str = typer.Option(None, "--model", help="The model to ask (needed unless --manual).",
                              show_default=False),
    api_key_env: str = typer.Option("OPENAI_API_KEY", "--api-key-env", help="Environment variable holding the API "
                                    "key (unset: 'EMPTY', for local servers)."),
    backend: MachineBackend = typer.Option(MachineBackend.triton, help="What the model writes: Triton kernels, or "
                                           "CUDA C++ compiled by kforge's runtime."),
    samples: int = typer.Option(1, min=1, help="Independent samples (k of pass@k)."),
    turns: int = typer.Option(3, min=1, help="Turns per sample at most: each turn sees the previous one's feedback."),
    temperature: float = typer.Option(0.7, min=0.0, help="Sampling temperature."),
    max_tokens: int = typer.Option(8192, min=1, help="Tokens per reply at most."),
    request_timeout: float = typer.Option(600.0, min=1.0, help="Seconds a request may take before it is retried."),
    manual: Path = typer.Option(None, "--manual", help="No endpoint: write each prompt to DIR/<attempt>.prompt.md "
                                "and read the reply from DIR/<attempt>.reply.md once it is there.",
                                show_default=False),
    keep_going: bool = typer.Option(False, "--keep-going", help="Go on after a sample passed (for a faster kernel)."),
    gpus: str = typer.Option(None, help="GPUs to judge on, e.g. 0,1: one evaluation on each at a time. "
                             "Default: every visible GPU, or the CPU where there is none.", show_default=False),
    executor: SuiteExecutor = typer.Option(SuiteExecutor.local, help="Where the attempts are judged: local (this "
                                           "machine's GPUs, --gpus) or ray (one judge per GPU of a Ray cluster, "
                                           "as kforge suite; docs/scale-out.md)."),
    address: str = typer.Option(None, help="With --executor ray: the cluster's address (auto: the cluster this "
                                "machine belongs to). Default: start a Ray instance on this machine for the run.",
                                show_default=False),
    ray_resources: str = typer.Option(None, "--ray-resources", help="With --executor ray: what each judge holds, "
                                      "NAME=AMOUNT separated by commas. Default: GPU=1.", show_default=False),
    results: Path = typer.Option(None, dir_okay=False,
                                 help="JSONL store of the attempts (default: machine-<problem>.jsonl in "
                                 "$KFORGE_RESULTS_DIR, else in ./kforge-results/).", show_default=False),
    time_budget: float = typer.Option(10.0, min=0.1, help="Seconds of timed rounds per evaluation at most."),
    stage_timeout: float = typer.Option(None, min=1.0, help=STAGE_TIMEOUT_HELP, show_default=False),
    force: bool = typer.Option(False, help="Ask and judge again the attempts the store has (appended; the latest "
                               "counts)."),
    profile: bool = typer.Option(False, "--profile", help="Profile each attempt that passed gate 1 with Nsight "
                                 "Compute (one call, on the GPU it was judged on) and add where its time goes to "
                                 "the feedback: DRAM and SM throughput, tensor pipes, what warps wait on."),
) -> None:
    """A language model writes kernels for PROBLEM; kforge judges each one as `kforge eval` does.

    Each sample is a conversation: the prompt (the reference, the backend, the device and
    the problem's roofline floor), a reply, its one code block judged in isolated workers,
    then feedback (the error, gate 1's errors, gate 2's verdict, the static flags) for the
    next turn. Prints each attempt and pass@k / fast_1@k. Running the same command again
    skips the attempts the store has. Exit status 0 when a sample passed both gates (or,
    with --manual, when replies are still to be written), 1 when none did, 2 an unusable
    input or an endpoint that gave no reply, 3 a bug in kforge. See docs/machine.md.
    """
    from kforge.device import current_device
    from kforge.harness.roofline import ceilings_path, get_ceilings
    from kforge.harness.timing import TimingConfig
    from kforge.machine.client import EndpointClient, ManualClient
    from kforge.machine.loop import AttemptStore, Settings, run_machine, scores
    from kforge.machine.prompt import first_messages, problem_facts

    if manual is not None and base_url is not None:
        raise KforgeError("--manual and --base-url contradict each other: choose one")
    if manual is None and not model:
        raise KforgeError("give --model (the model the endpoint serves), or --manual DIR")
    if profile and executor is not SuiteExecutor.local:
        raise KforgeError("--profile runs Nsight Compute on this machine's GPUs: not with --executor ray")
    runner = _ray_executor(executor, gpus, address, ray_resources)
    slots, device_name = ([], None) if runner else _slots(gpus)
    device = current_device()
    facts = problem_facts(problem, device)
    results = results or default_results(f"machine-{facts.name}.jsonl")
    measuring = not ceilings_path(device).is_file()
    if measuring and not show_progress() and not _quiet:  # a line for logs, else a spinner
        err.print(f"measuring the ceilings of {device.name} ...", style="dim")
    with working(f"measuring the ceilings of {device.name}", not measuring):
        ceilings = get_ceilings(device)
    messages = first_messages(facts, device, ceilings, backend.value)
    settings = Settings(problem=problem, backend=backend.value, model=model or "manual", samples=samples,
                        turns=turns, temperature=temperature, max_tokens=max_tokens, keep_going=keep_going,
                        force=force)
    if manual is not None:
        client = ManualClient(manual)
    else:
        client = EndpointClient(base_url, model, api_key_env=api_key_env, temperature=temperature,
                                max_tokens=max_tokens, request_timeout=request_timeout)
    options = dict(timing=TimingConfig(budget_s=time_budget), limits=stage_limits(stage_timeout, time_budget),
                   ceilings=ceilings, command=shlex.join(["kforge", *sys.argv[1:]]))

    def said(attempt: dict) -> None:
        if not _quiet:
            err.print(f"{attempt['id']}: {attempt['status']}" + (f": {attempt['reason']}" if attempt["reason"]
                                                                  else ""), markup=False, highlight=False)

    with _store_warnings():
        if runner is None:
            profiler = None
            if profile:
                from kforge.harness.profile import profile_candidate

                def profiler(problem_file, candidate_file, gpu):
                    return profile_candidate(problem_file, candidate_file, gpu=gpu)
            run = run_machine(settings, client, AttemptStore(results), facts=facts, messages=messages, slots=slots,
                              device_name=device_name, options=options, on_attempt=said, profile=profiler)
        else:
            with runner:
                device_name = runner.device_name  # each judge reports its node's device
                if device_name != device.name:
                    raise KforgeError(f"the prompt describes this machine's {device.name}, but the cluster's "
                                      f"judges run on {device_name}: start kforge machine on a node of the cluster")
                del options["ceilings"]  # each node's judges use their own GPU's ceilings
                with runner.evaluator(options=options, device_name=device_name) as judge:
                    run = run_machine(settings, client, AttemptStore(results), facts=facts, messages=messages,
                                      slots=[None] * runner.slot_count, device_name=device_name, options=options,
                                      on_attempt=said, evaluate=lambda problem, candidate, _gpu: judge(problem,
                                                                                                        candidate))
        found = scores(run.attempts)
    if run.attempts:
        show(_machine_view(run, found, results))
    for waiting in run.waiting:
        print(f"waiting: write the reply to {waiting.reply} (the prompt is {waiting.prompt}), then run the same "
              "command again")
    if run.failures:
        more = f" (and {len(run.failures) - 1} more; the store keeps them, and running again asks again)" \
            if len(run.failures) > 1 else " (the store keeps it, and running again asks again)"
        raise KforgeError(f"the endpoint gave no reply: {run.failures[0]}{more}")
    if run.waiting:
        raise typer.Exit(0)
    raise typer.Exit(0 if any(a["status"] == "passed" for a in run.attempts) else 1)


def _ray_executor(executor, gpus: str | None, address: str | None, ray_resources: str | None,
                  mix_devices: bool = False):
    """The Ray executor `--executor ray` asks for (kforge suite, kforge machine), or None for
    this machine's GPUs; options of the other executor are one-line errors."""
    if executor is SuiteExecutor.local:
        if address or ray_resources:
            raise KforgeError("--address and --ray-resources are for --executor ray")
        return None
    if gpus:
        raise KforgeError("--gpus picks this machine's GPUs; with --executor ray, --ray-resources says what "
                          "each judge holds")
    from kforge.harness.executors import RayExecutor, parse_resources

    return RayExecutor(address, parse_resources(ray_resources or "GPU=1"), mix_devices=mix_devices)


def _machine_view(run, found, results: Path):
    """The attempts of a `kforge machine` run, one row per turn, then pass@k and fast_1@k."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"kforge machine  {run.run}", title_justify="left")
    for column in ("sample", "turn", "status", "speedup (95% interval)", "% of roof", "flags", "reason"):
        table.add_column(column, justify="right" if column in ("sample", "turn", "% of roof") else "left")
    for attempt in run.attempts:
        record = attempt.get("record") or {}
        gate2, roof = record.get("gate2") or {}, record.get("roofline") or {}
        verdict = gate2.get("verdict") or {}
        speedup = "-" if gate2.get("speedup") is None else f"{gate2['speedup']:.3g}x" + (
            f" ({verdict['low']:.3g}-{verdict['high']:.3g})" if verdict.get("low") is not None
            and verdict.get("high") is not None else "")
        pct = (roof.get("candidate") or {}).get("pct_of_roof")
        flags = ", ".join(sorted({f["code"] for f in attempt["static_flags"]})) or "-"
        reason = attempt["reason"] or ""
        table.add_row(str(attempt["sample"]), str(attempt["turn"]),
                      Text(attempt["status"], style="bold green" if attempt["status"] == "passed" else None),
                      speedup, "-" if pct is None else f"{pct:.1f}%", flags,
                      Text(reason if len(reason) <= 60 else reason[:59] + "…"))  # a model's words: not markup
    lines = [table]
    if found.samples:
        at = "   ".join(f"pass@{k} {found.pass_at[k]:.2f}" for k in found.pass_at)
        fast = "   ".join(f"fast_1@{k} {found.fast_1_at[k]:.2f}" for k in found.fast_1_at)
        lines.append(Text(f"{found.samples} sample(s): {found.correct} correct, {found.fast} faster   {at}   {fast}"))
    lines.append(Text(f"{run.ran} new attempt(s); the attempts are in {results}", style="dim"))
    return Group(*lines)


def main() -> None:
    """Console entry point: a clear one-line error instead of a traceback, always."""
    import traceback

    try:
        code = app(standalone_mode=False)
    except KforgeError as exc:
        err.print(f"[bold red]error:[/] {escape(exc.reason)}", highlight=False)
        if exc.details:
            err.print(exc.details, style="dim", markup=False, highlight=False)
        sys.exit(2)
    except typer.Abort:
        err.print("aborted")
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001 - the last line of defence is a readable message
        if hasattr(exc, "show") and hasattr(exc, "exit_code"):  # click's usage errors (typer may vendor click)
            if type(exc).__name__ == "NoArgsIsHelpError" or not hasattr(exc, "format_message"):
                exc.show()  # `kforge` alone: the help
                sys.exit(exc.exit_code)
            ctx = getattr(exc, "ctx", None)
            see = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
            message = " ".join(exc.format_message().split())  # one line, in the style of every other error
            err.print(f"[bold red]error:[/] {escape(message)}{escape(see)}", highlight=False)
            sys.exit(2)
        err.print(f"[bold red]kforge internal error:[/] {type(exc).__name__}: {escape(str(exc))}", highlight=False)
        err.print("this is a bug in kforge; its traceback:", style="dim")
        err.print("".join(traceback.format_exception(exc)), style="dim", markup=False, highlight=False)
        sys.exit(3)
    sys.exit(code if isinstance(code, int) else 0)

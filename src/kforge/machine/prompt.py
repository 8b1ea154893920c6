"""What the model reads: the first prompt, built from a problem file, and each turn's feedback.

    facts = problem_facts(path, device)                  # the reference, sizes, roofline floor
    messages = first_messages(facts, device, ceilings, backend)
    text = feedback_text(status, reason, record, flags)  # turn t's outcome, for turn t + 1

The templates are the constants below, filled with str.format; the exact messages sent
are stored with every attempt, so a record shows what the model saw, whatever the
templates say later.

The problem's figures are computed in this process, on PyTorch's meta device (shapes and
dtypes, no data, no time): get_inputs(), the reference's forward for the output shapes,
and the problem's flops()/bytes_moved() or kforge's default byte count, the same the
harness uses. The problem file is the user's own input, trusted as `kforge eval` trusts
it in its reference worker; the model's code never runs here. A problem whose inputs or
forward depend on data (a nonzero, an .item()) cannot run on meta: on a CPU it is then run
at its judged (tiny) size, on a GPU the prompt says the figures are missing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from kforge.device import DeviceInfo
from kforge.errors import KforgeError

BACKENDS = ("triton", "cuda")

SYSTEM = ("You are an expert GPU kernel engineer. You write kernels that are correct first and fast second, "
          "and you answer in exactly the format asked for.")

TASK = """\
# Task

Write `ModelNew`: a drop-in replacement for the PyTorch module `Model` below, with the same
constructor arguments and the same `forward` inputs and outputs, correct to the tolerance
below, and faster than the reference on the device below. The work must happen in your
own kernels.

## The reference: {name}.py

```python
{source}
```

{shapes}

## Backend

{backend}

## How your file is judged

kforge imports your file in a separate, confined process and calls `ModelNew` against
`Model` on the same inputs:

- Gate 1, correct: {trials} trials on fresh random inputs{exposed}. Every output must be a plain
  tensor of the reference's shape, dtype and device, with no NaN or Inf the reference lacks,
  every element within atol + rtol * |reference| ({tolerance}), and the relative L2 error
  ||out - ref|| / ||ref|| under {rel_l2}.
- Gate 2, faster: the reference and `ModelNew` are timed in alternation on fresh inputs,
  with the cache flushed between calls; the median of the per-round speedups must have its
  95% interval above 1 + the noise floor measured in the same run. Anything in between is
  a tie, which fails.
- The judge times the whole device (work on other streams or threads counts), re-checks
  the outputs of timed calls, stops your process between calls, and gives each input set
  only once: caching results, computing in another stream or thread, patching clocks or
  torch, and reading the judge's state all fail.{forbidden}

## The device

{device}

## The roofline

{roofline}

## Reply format

Reply with exactly one fenced ```python block holding the whole file: its imports, your
kernels and `class ModelNew(nn.Module)`. Only `ModelNew` is used. Text outside the block
is fine; a second block that defines `ModelNew` makes the reply ambiguous, and it is
rejected unread.
"""

TRITON = """\
Triton. Write `@triton.jit` kernels and launch them from `ModelNew.forward` with
`kernel[grid](...)`; allocate outputs with torch (`torch.empty`, ...). Launches go on
torch's current stream. `import torch`, `import triton`, `import triton.language as tl`;
`triton.autotune` is allowed (its tuning runs before the timed calls)."""

CUDA = """\
CUDA C++, compiled at run time by kforge's runtime (NVRTC: no host compiler, well under a
second a kernel). Keep the source in a Python string; in `ModelNew.__init__`, write it to a
file in a folder from `tempfile.mkdtemp()` (your process may write only to its own
scratch folder) and compile it once:

```python
import tempfile
from pathlib import Path
from kforge.runtime.cuda import CudaKernel, compile_cuda

path = Path(tempfile.mkdtemp()) / "kernels.cu"
path.write_text(SOURCE)
self.scale = CudaKernel(compile_cuda(path, cache=False), "scale")  # extern "C" __global__ void scale(...)
# in forward:
self.scale.launch(grid=(blocks,), block=(256,), args=(out, x, n, 2.0), shared_bytes=0)
```

`launch` runs on torch's current CUDA stream. Tensor arguments pass as device pointers
(make them contiguous first; all on one CUDA device), Python ints as 32-bit ints
(`numpy.int64(n)` for a 64-bit parameter), Python floats as 32-bit floats. Declare each
kernel `extern "C" __global__` so its name is not mangled. The CUDA headers
(`cuda_fp16.h`, `cuda_bf16.h`, `cuda/barrier`, CCCL) are on the include path; the target is
the device's architecture (`sm_90a` on Hopper, so wgmma and TMA assemble); dynamic shared
memory above 48 KiB is opted into for you. Do not use `torch.utils.cpp_extension`: a
host-compiler build takes minutes."""

CPU_NOTE = """\
This machine has no GPU: the evaluation runs on its CPU ({name}, {cores} cores), at the
problem's tiny size where it has one. Triton kernels run under Triton's interpreter, which
is far slower than eager PyTorch, so gate 2 fails on a CPU whatever the kernel: correctness
is what a CPU evaluation shows. CUDA kernels compile but cannot launch."""

FEEDBACK_CLOSING = "Fix this and reply with the whole corrected file in one ```python block."
FEEDBACK_PASSED = ("It passed both gates. Make it faster still, keeping it correct, and reply with the whole "
                   "file in one ```python block.")


# --- the problem's facts ---------------------------------------------------------------


@dataclass
class ProblemFacts:
    """What the first prompt says about a problem, at the size it is judged at."""

    name: str
    path: Path
    sha256: str
    source: str
    size: str  # "full" or "tiny"
    inputs: list[str] = field(default_factory=list)  # "float32[4096]" or the repr of a non-tensor
    outputs: list[str] = field(default_factory=list)
    tolerances: list[tuple[str, float, float, float | None]] = field(default_factory=list)  # dtype, atol, rtol, L2
    exposed_trials: int = 0
    forbidden_ops: list[str] = field(default_factory=list)
    flops: float | None = None
    bytes: int | None = None
    compute_dtype: str | None = None
    missing: str | None = None  # why the shapes and the roofline could not be computed


def problem_facts(path: str | Path, device: DeviceInfo) -> ProblemFacts:
    """Load the problem (a ProblemError if it does not load) and size it (module docstring)."""
    import torch

    from kforge.harness.problem import flatten_outputs, load_problem

    path = Path(path)
    if not path.is_file():
        raise KforgeError(f"no problem file at {path}")
    size = "full" if device.is_cuda else "auto"  # what the judge runs: harness/judge.py
    problem = load_problem(path, size)
    facts = ProblemFacts(name=problem.name, path=path, sha256=problem.sha256, source=path.read_text(),
                         size=problem.size, exposed_trials=problem.exposed_trials,
                         forbidden_ops=list(problem.forbidden_ops))
    places = [torch.device("meta")] + ([torch.device("cpu")] if not device.is_cuda else [])
    for place in places:
        try:
            with torch.no_grad():
                init = problem.init_inputs(0, place)
                inputs = problem.make_inputs(0, place)
                model = problem.build_reference(init, 0, place)
                outputs = flatten_outputs(problem.run_reference(model, inputs))
                facts.flops = problem.count_flops(inputs)
                facts.bytes = problem.count_bytes(inputs, outputs, model)
        except (KforgeError, RuntimeError, NotImplementedError) as exc:
            facts.missing = f"{getattr(exc, 'reason', None) or exc}".splitlines()[0]
            continue
        facts.missing = None
        facts.inputs = [_describe(x) for x in inputs]
        facts.outputs = [_describe(x) for x in outputs]
        facts.compute_dtype = problem.compute_dtype_for(inputs)
        dtypes = {x.dtype: None for x in outputs if isinstance(x, torch.Tensor)}
        facts.tolerances = [(str(d).removeprefix("torch."), *problem.tolerance_for(d), problem.rel_l2_for(d))
                            for d in dtypes]
        break
    return facts


def _describe(value) -> str:
    import torch

    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}[{', '.join(map(str, value.shape))}]"
    return repr(value) if len(repr(value)) <= 40 else type(value).__name__


# --- the first prompt -----------------------------------------------------------------


def first_messages(facts: ProblemFacts, device: DeviceInfo, ceilings, backend: str) -> list[dict]:
    """The chat messages of turn 0: a short system message and the task."""
    from kforge.harness.evaluate import MIN_TRIALS

    if backend not in BACKENDS:
        raise KforgeError(f"unknown backend {backend!r} (backends: {', '.join(BACKENDS)})")
    if facts.inputs:
        shapes = (f"At the size it is judged at ({facts.size}), `forward` takes {', '.join(facts.inputs)} "
                  f"and returns {', '.join(facts.outputs)}.")
    else:
        shapes = f"(Its input shapes could not be computed here: {facts.missing}.)"
    if facts.tolerances:
        tolerance = "; ".join(f"{d} outputs: atol {a:g}, rtol {r:g}" for d, a, r, _ in facts.tolerances)
        bounds = sorted({bound for *_, bound in facts.tolerances if bound is not None})
        rel_l2 = " / ".join(f"{b:g}" for b in bounds) or "the output dtype's bound"
    else:
        tolerance, rel_l2 = "by output dtype: fp32 1e-4, fp16 and bf16 1e-2", "fp32 1e-5, fp16 5e-3, bf16 1e-2"
    exposed = (f", then {facts.exposed_trials} on the same draws with random signs and magnitudes spread over "
               "2^-4..2^4 (a lower precision than the reference's shows there)") if facts.exposed_trials else ""
    forbidden = (f"\n- This problem forbids calling {', '.join(facts.forbidden_ops)}: the library it is meant to "
                 "beat. A call to one is seen at the dispatcher and rejects the file.") if facts.forbidden_ops else ""
    text = TASK.format(name=facts.name, source=facts.source.rstrip("\n"), shapes=shapes,
                       backend=TRITON if backend == "triton" else CUDA, trials=MIN_TRIALS,
                       exposed=exposed, tolerance=tolerance, rel_l2=rel_l2, forbidden=forbidden,
                       device=device_text(device, ceilings), roofline=roofline_text(facts, ceilings))
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]


def device_text(device: DeviceInfo, ceilings) -> str:
    if not device.is_cuda:
        return CPU_NOTE.format(name=device.name, cores=device.multiprocessors or "?")
    parts = [f"{device.name}, compute capability {device.capability}, {device.multiprocessors} SMs"]
    if device.cache_bytes:
        parts.append(f"{device.cache_bytes / 2**20:.0f} MiB L2")
    if device.memory_bytes:
        parts.append(f"{device.memory_bytes / 2**30:.0f} GiB memory")
    lines = [", ".join(parts) + "."]
    if ceilings is not None:
        rates = ", ".join(f"{k} {v:,.0f}" for k, v in ceilings.matmul_tflops.items())
        lines.append(f"Measured here (`kforge roofline`, {ceilings.measured_on}): copy {ceilings.copy_gbps:,.0f} GB/s "
                     f"(read + write); cuBLAS matmul TFLOP/s: {rates}.")
        sheet = ceilings.datasheet
        if sheet:
            peaks = ", ".join(f"{k} {v:,.0f}" for k, v in sheet.tflops.items())
            lines.append(f"Datasheet ({sheet.name}, dense): {sheet.bandwidth_gbps:,.0f} GB/s; TFLOP/s: {peaks}.")
    return "\n".join(lines)


def roofline_text(facts: ProblemFacts, ceilings) -> str:
    if facts.bytes is None:
        return f"Not computed: {facts.missing}."
    flops = "an unstated number of FLOPs" if facts.flops is None else f"{_si(facts.flops)}FLOP"
    dtype = f" ({facts.compute_dtype})" if facts.compute_dtype and facts.flops is not None else ""
    text = (f"At the judged size, one forward pass does {flops}{dtype} and must move at least {_si(facts.bytes)}B "
            "(every input, parameter and output once, or the problem's own count).")
    if ceilings is None:
        return text + " The device's ceilings are not measured yet (`kforge roofline`), so no floor time is given."
    from kforge.harness.roofline import roofline_for

    roof = roofline_for(facts.flops, facts.bytes, facts.compute_dtype, ceilings)
    if roof.floor_ms is not None:
        text += (f" Against the measured ceilings that is {roof.bound}-bound, with a floor of {_ms(roof.floor_ms)}: "
                 "a kernel at the floor is at 100% of roof.")
    if roof.physical_floor_ms is not None:
        text += (f" The datasheet's floor is {_ms(roof.physical_floor_ms)}: a time under it fails as faster than "
                 "the hardware allows.")
    return text


def _si(value: float) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.3g} {prefix}"
    return f"{value:g} "


def _ms(ms: float) -> str:
    return f"{ms:.3g} ms" if ms >= 1 else f"{ms * 1e3:.3g} us"


# --- feedback for the next turn ---------------------------------------------------------

EVALUATED_FAILURES = ("candidate_error", "crash", "timeout", "oom", "cuda_error", "problem_error")


def feedback_text(status: str, reason: str | None, record: dict | None, flags: list[dict],
                  candidate_name: str = "candidate.py", profile: list[str] | None = None) -> str:
    """Turn t's outcome as the user message of turn t + 1: what failed and where, the gates'
    figures, the roofline position, the profile's lines (`kforge machine --profile`), the
    static flags, and what to do next."""
    lines = [f"Your previous reply: {status.upper()}."]
    if record is None:
        lines.append(f"No file was evaluated: {reason}.")
    elif status in EVALUATED_FAILURES:
        lines.append(f"It failed before the gates could judge it: {reason}")
        lines += _where(record.get("details") or "", candidate_name)
    elif status == "rejected":
        lines.append(f"A defence of the judge rejected it ({', '.join(record.get('defences') or [])}): {reason}")
    else:
        lines += _gates(record, reason)
    lines += profile or []
    warnings = (record or {}).get("warnings") or []
    lines += [f"Warning: {w}" for w in warnings[:3]]
    if flags:
        lines.append("Static checks flagged (they decide nothing; the judge's runtime defences do):")
        lines += [f"- line {f['line']} [{f['code']}]: {f['message']}" for f in flags]
    lines.append(FEEDBACK_PASSED if status == "passed" else FEEDBACK_CLOSING)
    return "\n".join(lines)


_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>\S+)$')


def _where(details: str, candidate_name: str) -> list[str]:
    """The frames of the traceback inside the candidate's file, and the exception's last lines."""
    lines = details.rstrip().splitlines()
    frames, last = [], -1
    for i, line in enumerate(lines):
        match = _FRAME.match(line)
        if not match:
            continue
        last = i
        if Path(match["file"]).name == candidate_name:
            code = lines[i + 1].strip() if i + 1 < len(lines) and not _FRAME.match(lines[i + 1]) else ""
            frames.append(f"  line {match['line']}, in {match['fn']}: {code}")
    tail = [line for line in lines[last + 2 if last >= 0 else 0:] if line.strip() and set(line.strip()) != {"^"}]
    out = []
    if frames:
        out += ["Where, in your file:", *frames[-6:]]
    if tail:
        path = re.compile(r"/[^\s\"']*/" + re.escape(candidate_name))
        out += ["The error:", *(path.sub(candidate_name, line) for line in tail[-15:])]
    return out


def _gates(record: dict, reason: str | None) -> list[str]:
    gate1, gate2, roof = record.get("gate1"), record.get("gate2"), record.get("roofline")
    lines = []
    if gate1 and not gate1.get("passed"):
        lines.append(f"Gate 1 (correct) failed: {gate1.get('reason') or reason}")
        if gate1.get("max_abs_err") is not None:
            lines.append(f"Worst output: max abs error {gate1['max_abs_err']:.3g}, max rel error "
                         f"{gate1['max_rel_err']:.3g}, {100 * gate1['mismatch_frac']:.3g}% of elements outside "
                         f"atol {gate1['atol']:g} / rtol {gate1['rtol']:g}, relative L2 error "
                         f"{gate1['rel_l2_err']:.3g} (bound {gate1['rel_l2_bound']:g}); decided by the "
                         f"{gate1.get('test')} test at trial {gate1['trials']}.")
        return lines
    if gate1:
        lines.append(f"Gate 1 (correct): passed, {gate1['trials_passed']} of {gate1['trials']} trials; max abs "
                     f"error {gate1['max_abs_err']:.3g}, relative L2 {gate1['rel_l2_err']:.3g}.")
    if record["status"] == "incorrect":  # gate 1 passed, a re-checked timed call did not
        lines.append(f"But a timed call's output was wrong: {reason}")
        return lines
    if gate2:
        ref, cand = gate2["stats"]["reference"], gate2["stats"]["candidate"]
        verdict = gate2.get("verdict") or {}
        said = {"passed": "faster"}.get(verdict.get("status"), verdict.get("status") or record["status"])
        interval = (f", 95% interval {verdict['low']:.3g}-{verdict['high']:.3g}x"
                    if verdict.get("low") is not None and verdict.get("high") is not None else "")
        bar = f"; the bar was {verdict['bar']:.3g}x" if verdict.get("bar") else ""
        lines.append(f"Gate 2 (faster): reference median {_ms(ref['median_ms'])}, yours {_ms(cand['median_ms'])}; "
                     f"speedup {gate2['speedup']:.3g}x{interval} over {gate2.get('rounds')} rounds{bar}. "
                     f"Verdict: {said}{' (undecided: the time budget ran out)' if verdict.get('undecided') else ''}.")
        if record["status"] == "faster_than_hardware":
            lines.append(f"And: {reason}")
    if roof and roof.get("candidate") and roof["candidate"].get("pct_of_roof") is not None:
        mine, theirs = roof["candidate"], roof.get("reference") or {}
        lines.append(f"Roofline: yours at {mine['pct_of_roof']:.1f}% of roof (the reference "
                     f"{theirs.get('pct_of_roof') or 0:.1f}%), {roof['bound']}-bound, floor {_ms(roof['floor_ms'])}; "
                     f"{mine['gbps']:.3g} GB/s" + (f", {mine['tflops']:.3g} TFLOP/s" if mine.get("tflops") else "")
                     + ".")
    return lines

"""`kforge bench model`: the Llama engine against transformers and a compiled gpt-fast-style
baseline, on one preset's random weights (nothing is downloaded), all in one run.

Four parts, each skippable (`--parts`):

- decode: batch 1, a random prompt of `prompt` tokens prefilled, then `warmup` untimed and
  `steps` timed decode steps. Ours (`Engine`, in every `--weights` format; a quantized format
  timed again with its LM head quantized too, `quantize.quantize_head`) against
  transformers' `LlamaForCausalLM` on the same bf16 weights with its static cache (a manual
  loop of forward calls, eager) and `StaticCacheLlama.compiled_decode()` (torch.compile).
- batch: `batch` sequences decoding at once near `context` tokens each; ours against the
  compiled baseline. Ours prefills its prompts for real; the baseline's static cache is left
  unwritten, because its step attends over the whole cache under a mask, so its cost does
  not depend on what the cache holds.
- prefill: `prefill_batch` prompts of `prefill_len` tokens in one forward; ours against the
  compiled baseline and transformers, each computing the last position's logits only.
- trace: `requests` requests arriving as a seeded Poisson process of `rate` per second, prompt
  and output lengths uniform over the given ranges, through the engine's continuous
  batching; throughput and the scheduler's TTFT and TPOT percentiles.

Every greedy token feeds the next step, so each timed step is a real step of generation.
Times come from CUDA events recorded between consecutive steps (the host's clock on a CPU),
so a step's time includes whatever the host does between the device's work, sampling and
scheduling included: the time per token a caller sees. Each figure is the median over the
timed steps, with the 10th and 90th percentiles as its spread.

The floor of a decode step is the bytes it must read over the device's copy bandwidth: the
weights once (`quantize.weight_bytes`: the block weights in their format with their scales,
the norms and the LM head) plus the K and V of every cached token of every sequence. The
copy bandwidth is kforge's measured ceiling (`kforge roofline`'s cache, else measured here
the same way: a device-to-device copy, bytes read plus written); "% of floor" is floor time
over measured time, the share of the bandwidth-bound best a method reaches.

Records go to a JSONL file, one sealed line per method (kforge.harness.record); a method that
fails is recorded with its error and the run goes on.
"""

from __future__ import annotations

import datetime as _dt
import gc
import inspect
import math
import random
import statistics
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from functools import partial
from itertools import pairwise
from pathlib import Path

import torch

from kforge.errors import KforgeError
from kforge.harness.record import append_record
from kforge.models.llama.config import PRESETS, LlamaConfig
from kforge.models.llama.quantize import FORMATS, quantize_head

PARTS = ("decode", "batch", "prefill", "trace")
BASELINES = ("transformers", "compiled")
COMPILE_MODES = ("max-autotune", "reduce-overhead", "default")
CPU_MAX_PARAMETERS = 100_000_000  # a bigger model on a CPU would run for hours and fill its memory


@dataclass(frozen=True)
class Sizes:
    """What each part runs; `--sizes key=value,...` overrides any of these."""

    prompt: int = 512  # decode: prompt tokens prefilled before the decode steps
    steps: int = 256  # decode: timed steps (256 new tokens after the 512-token prompt)
    warmup: int = 8  # untimed steps before every timed loop (compilation, CUDA graph capture)
    batch: int = 64  # batch: sequences decoding at once
    context: int = 4096  # batch: tokens per sequence at the end of the timed steps
    batch_steps: int = 32  # batch: timed steps
    prefill_batch: int = 8  # prefill: prompts per forward
    prefill_len: int = 2048  # prefill: tokens per prompt
    prefill_reps: int = 5  # prefill: timed forwards
    requests: int = 64  # trace: requests
    rate: float = 4.0  # trace: mean arrivals per second
    trace_prompt: tuple[int, int] = (128, 1024)  # trace: prompt lengths, uniform over [lo, hi]
    trace_output: tuple[int, int] = (64, 256)  # trace: output lengths, uniform over [lo, hi]
    slots: int = 32  # trace: requests running at once at most
    step_tokens: int = 2048  # trace: the engine's token budget per step (chunked prefill)

    @classmethod
    def parse(cls, text: str | None) -> Sizes:
        """`key=value,...`; a range is `lo:hi` (or one number for a fixed length)."""
        sizes, kinds = cls(), {f.name: f.type for f in fields(cls)}
        for item in filter(None, (part.strip() for part in (text or "").split(","))):
            key, _, value = item.partition("=")
            key = key.strip()
            if key not in kinds:
                raise KforgeError(f"--sizes: unknown key {key!r} (keys: {', '.join(kinds)})")
            try:
                if "tuple" in str(kinds[key]):
                    lo, _, hi = value.partition(":")
                    parsed = (int(lo), int(hi or lo))
                else:
                    parsed = float(value) if "float" in str(kinds[key]) else int(value)
            except ValueError:
                raise KforgeError(f"--sizes: {key}={value!r} is not a valid "
                                  f"{'range lo:hi' if 'tuple' in str(kinds[key]) else 'number'}") from None
            sizes = replace(sizes, **{key: parsed})
        return sizes

    def check(self, config: LlamaConfig, parts: Sequence[str]) -> None:
        """One line for the first size that cannot run on `config`."""
        for f in fields(self):
            value = getattr(self, f.name)
            low = 0 if f.name == "warmup" else 1
            if any(v < low or (f.name == "rate" and v <= 0) for v in (value if isinstance(value, tuple) else (value,))):
                raise KforgeError(f"--sizes: {f.name} must be {'positive' if low else '>= 0'}, got {value}")
        for name in ("trace_prompt", "trace_output"):
            lo, hi = getattr(self, name)
            if lo > hi:
                raise KforgeError(f"--sizes: {name} {lo}:{hi} has its low end above its high end")
        needs = {"decode": ("prompt + warmup + steps + 1", self.prompt + self.warmup + self.steps + 1),
                 "batch": ("context", self.context),
                 "prefill": ("prefill_len + 1", self.prefill_len + 1),
                 "trace": ("trace_prompt + trace_output (their high ends)", self.trace_prompt[1] + self.trace_output[1])}
        for part in parts:
            what, tokens = needs[part]
            if tokens > config.max_position:
                raise KforgeError(f"--sizes: {part} needs {what} = {tokens} positions; the model has "
                                  f"{config.max_position}")
        if "batch" in parts and self.context <= batch_tokens_out(self):
            raise KforgeError(f"--sizes: batch context {self.context} leaves no prompt: the sequences generate "
                              f"{batch_tokens_out(self)} tokens (prefill steps + warmup + batch_steps)")


@dataclass(frozen=True)
class ModelBenchOptions:
    model: str = "llama3-8b"
    parts: tuple[str, ...] = PARTS
    weights: tuple[str, ...] = FORMATS
    baselines: tuple[str, ...] = BASELINES
    sizes: Sizes = Sizes()
    max_seconds: float | None = None  # no part or method starts after this many seconds
    compile_mode: str = "max-autotune"
    seed: int = 0

    @classmethod
    def parse(cls, *, model: str | None = None, parts: str | None = None, weights: str | None = None,
              baselines: str | None = None, sizes: str | None = None, max_seconds: float | None = None,
              compile_mode: str | None = None) -> ModelBenchOptions:
        """The command line's strings, checked: KforgeError (one line) for any bad one."""
        model = model or cls.model
        if model not in PRESETS:
            raise KforgeError(f"--model: no preset {model!r} (presets: {', '.join(PRESETS)}; random weights, "
                              "nothing is downloaded)")
        if max_seconds is not None and max_seconds <= 0:
            raise KforgeError(f"--max-seconds must be positive, got {max_seconds}")
        mode = compile_mode or cls.compile_mode
        if mode not in COMPILE_MODES:
            raise KforgeError(f"--compile-mode: {mode!r} is not one of {', '.join(COMPILE_MODES)}")
        options = cls(model=model, parts=_choices("--parts", parts, PARTS), weights=_choices("--weights", weights, FORMATS),
                      baselines=_choices("--baselines", baselines, BASELINES, allow_none=True),
                      sizes=Sizes.parse(sizes), max_seconds=max_seconds, compile_mode=mode)
        if not options.weights:
            raise KforgeError("--weights: name at least one of " + ", ".join(FORMATS))
        options.sizes.check(PRESETS[model], options.parts)
        return options


def _choices(option: str, text: str | None, allowed: Sequence[str], allow_none: bool = False) -> tuple[str, ...]:
    if text is None or text.strip() == "all":
        return tuple(allowed)
    if allow_none and text.strip() == "none":
        return ()
    chosen = [w.strip() for w in text.split(",") if w.strip()]
    unknown = [w for w in chosen if w not in allowed]
    if unknown or not chosen:
        raise KforgeError(f"{option}: {', '.join(unknown) or 'nothing'} is not one of {', '.join(allowed)}"
                          + (" (or none)" if allow_none else ""))
    return tuple(dict.fromkeys(chosen))


# --- the floor --------------------------------------------------------------------------------


def decode_bytes(weight_bytes: int, config: LlamaConfig, batch: int, context: float,
                 kv_dtype: torch.dtype = torch.bfloat16) -> float:
    """Bytes one decode step must read: the weights once, and the K and V of `context` cached
    tokens (on average) for each of `batch` sequences in every layer."""
    return weight_bytes + batch * context * config.kv_bytes_per_token(kv_dtype)


def floor_ms(nbytes: float, copy_gbps: float) -> float:
    return nbytes / (copy_gbps * 1e9) * 1e3


def copy_bandwidth(device) -> tuple[float, str]:
    """(GB/s, where it came from): the cached ceilings of `kforge roofline`, else the copy
    measured now as `measure_ceilings` measures it (the matmul ceilings, not needed here,
    are left unmeasured)."""
    from kforge.harness.roofline import CPU_COPY_BYTES, GPU_COPY_BYTES, load_ceilings
    from kforge.harness.timing import TimingConfig, time_interleaved

    cached = load_ceilings(device)
    if cached is not None:
        return cached.copy_gbps, f"kforge roofline's cache, measured {cached.measured_on}"
    copy_bytes = GPU_COPY_BYTES if device.is_cuda else CPU_COPY_BYTES
    generator = torch.Generator(device=device.torch_device)

    def copy_set(i: int) -> list[torch.Tensor]:
        generator.manual_seed(i)
        src = torch.rand(copy_bytes // 4, device=device.torch_device, generator=generator)
        return [src, torch.empty_like(src)]

    run = time_interleaved({"copy": lambda s: s[1].copy_(s[0])}, copy_set, device, TimingConfig(budget_s=2.0))
    return 2 * copy_bytes / (run.stats["copy"].median_ms * 1e-3) / 1e9, "measured now (copy only)"


# --- timing -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepTiming:
    median_ms: float
    p10_ms: float
    p90_ms: float
    mean_ms: float
    n: int
    wall_s: float  # the timed steps end to end, on the host's clock
    clock: str  # "cuda_events" or "host"

    @classmethod
    def of(cls, samples_ms: Sequence[float], wall_s: float, clock: str) -> StepTiming:
        from kforge.models.scheduler import percentile

        return cls(statistics.median(samples_ms), percentile(samples_ms, 10), percentile(samples_ms, 90),
                   statistics.fmean(samples_ms), len(samples_ms), wall_s, clock)


def time_steps(step: Callable[[], object], *, steps: int, warmup: int, cuda: bool) -> StepTiming:
    """Run `step` warmup times untimed, then `steps` times back to back, each timed from the
    end of the one before (an event recorded between consecutive steps): nothing the host
    does between the device's work escapes the figure."""
    for _ in range(warmup):
        step()
    if not cuda:
        samples, start = [], time.perf_counter()
        last = start
        for _ in range(steps):
            step()
            now = time.perf_counter()
            samples.append((now - last) * 1e3)
            last = now
        return StepTiming.of(samples, last - start, "host")
    torch.cuda.synchronize()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    start = time.perf_counter()
    events[0].record()
    for event in events[1:]:
        step()
        event.record()
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    return StepTiming.of([a.elapsed_time(b) for a, b in pairwise(events)], wall, "cuda_events")


# --- the trace --------------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceRequest:
    arrival: float  # seconds after the trace starts
    prompt: list[int]
    max_tokens: int


def poisson_trace(n: int, rate: float, prompt_lens: tuple[int, int], output_lens: tuple[int, int], *, vocab: int,
                  seed: int) -> list[TraceRequest]:
    """`n` requests of a Poisson process of `rate` per second (exponential gaps, the first
    after one gap too), lengths uniform over the inclusive ranges, random token ids; the same
    for a seed."""
    rng = random.Random(seed)
    requests, clock = [], 0.0
    for _ in range(n):
        clock += rng.expovariate(rate)
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(*prompt_lens))]
        requests.append(TraceRequest(clock, prompt, rng.randint(*output_lens)))
    return requests


# --- the run ----------------------------------------------------------------------------------


def batch_tokens_out(sizes: Sizes) -> int:
    """Tokens each sequence of the batch part generates: one per step while the others still
    prefill (at most prefill_steps), then warmup and the timed steps."""
    return batch_prefill_steps(sizes) + sizes.warmup + sizes.batch_steps


def batch_prefill_steps(sizes: Sizes) -> int:
    """A bound on the steps the engine takes to prefill the batch part's prompts at
    `batch_step_tokens` tokens a step, the running decodes taking their share."""
    budget = batch_step_tokens(sizes) - sizes.batch
    return -(-sizes.batch * sizes.context // max(budget, 1)) + 2


def batch_step_tokens(sizes: Sizes) -> int:
    # several whole prompts a step, so that few of them continue over a step (model.py's slower path)
    return max(16384, 2 * sizes.batch)


class ModelBench:
    """One run: the model built per method on the device, each method timed, each recorded."""

    def __init__(self, options: ModelBenchOptions, *, results: Path | None, command: str | None = None,
                 log: Callable[[str], None] = lambda line: print(line, flush=True),
                 config: LlamaConfig | None = None):
        from kforge.device import current_device

        self.options, self.results, self.command, self.log = options, results, command, log
        self.sizes = options.sizes
        # the engine's requests never stop at an end-of-sequence token: every run generates all its steps
        self.config = replace(config or PRESETS[options.model], eos_token_ids=())
        self.device = current_device()
        self.cuda = self.device.is_cuda
        if not self.cuda and self.config.parameter_count() > CPU_MAX_PARAMETERS:
            raise KforgeError(f"no CUDA device: on a CPU only a small model runs (--model tiny), not "
                              f"{options.model}'s {self.config.parameter_count() / 1e9:.1f}B parameters")
        self.records: list[dict] = []
        self.started = time.perf_counter()
        self.run_id = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        self.versions = _versions()
        self.copy_gbps: float | None = None
        self.copy_source = ""
        self.lost: str | None = None  # the device error that ended the measuring, if one did

    # --- bookkeeping ---

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def say(self, text: str) -> None:
        self.log(f"[{self.elapsed():7.1f}s] {text}")

    def out_of_time(self) -> bool:
        return self.lost is not None or (self.options.max_seconds is not None
                                         and self.elapsed() > self.options.max_seconds)

    def why_skipped(self) -> str:
        if self.lost is not None:
            return f"the CUDA context was lost before it started ({self.lost})"
        return f"--max-seconds {self.options.max_seconds:g} was spent ({self.elapsed():.0f} s) before it started"

    def dtype_for(self, fmt: str) -> torch.dtype:
        # a CPU has no fast bf16 matmul; the quantized formats' ops take bf16 activations (as kforge generate)
        return torch.bfloat16 if self.cuda or fmt != "bf16" else torch.float32

    def build(self, fmt: str):
        from kforge.models.llama.checkpoint import random_model

        return random_model(self.config, seed=self.options.seed, dtype=self.dtype_for(fmt),
                            device=self.device.torch_device, weights=fmt)

    def free(self) -> None:
        """Give back what the last method held before the next allocates: its compiled code and
        CUDA graph pools (dynamo's reset), its tensors, the allocator's cached blocks. A device
        error that outlives its method (an illegal address poisons the whole CUDA context) ends
        the measuring: every method after it is recorded as skipped, and the table still prints."""
        try:
            if self.cuda:
                torch._dynamo.reset()
            gc.collect()
            if self.cuda and self.lost is None:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
        except RuntimeError as exc:  # torch raises a sticky CUDA error as a RuntimeError (AcceleratorError)
            if self.lost is None:
                self.lost = _one_line(exc)
                self.say(f"the CUDA context is lost: {self.lost}")

    def record(self, part: str, method: str, weights: str, status: str, figures: dict | None = None,
               reason: str | None = None, details: str | None = None) -> dict:
        record = {"bench": "model", "run": self.run_id,
                  "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                  "command": self.command, "device": self.device.to_dict(), "versions": self.versions,
                  "model": self.options.model, "parameters": self.config.parameter_count(), "part": part,
                  "method": method, "weights": weights, "status": status, "reason": reason,
                  "sizes": _part_sizes(self.sizes, part),
                  "copy": {"gbps": self.copy_gbps, "source": self.copy_source}, "figures": figures or {},
                  "details": details}
        if self.results is not None:
            append_record(self.results, record)
        self.records.append(record)
        return record

    def method(self, part: str, method: str, weights: str, measure: Callable[[], dict]) -> dict | None:
        """Time one method (its figures, or its error, recorded); None when it failed or was skipped."""
        if self.out_of_time():
            reason = self.why_skipped()
            self.say(f"{part} {method}: skipped: {reason}")
            self.record(part, method, weights, "skipped", reason=reason)
            return None
        self.say(f"{part} {method}: start")
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        figures, failure = None, None
        try:
            with torch.no_grad():
                figures = measure()
        except Exception as exc:  # noqa: BLE001 - one method's failure is recorded; the others still run
            failure = (_one_line(exc), traceback.format_exc())
        peak = torch.cuda.max_memory_allocated() / 1e9 if self.cuda else None
        self.free()  # outside the except block: the traceback no longer holds the method's tensors
        if failure is not None:
            self.say(f"{part} {method}: error: {failure[0]}")
            self.record(part, method, weights, "error", reason=failure[0], details=failure[1])
            return None
        if self.cuda:
            figures["peak_memory_gb"] = peak
        self.say(f"{part} {method}: {_summary_line(figures)}")
        self.record(part, method, weights, "ok", figures)
        return figures

    # --- the run ---

    def run(self) -> list[dict]:
        self.say(f"{self.options.model} ({self.config.parameter_count() / 1e9:.2f}B parameters) on "
                 f"{self.device.name}; parts {', '.join(self.options.parts)}")
        self.copy_gbps, self.copy_source = copy_bandwidth(self.device)
        self.say(f"copy bandwidth {self.copy_gbps:,.0f} GB/s ({self.copy_source})")
        for part in self.options.parts:
            if self.out_of_time():
                reason = self.why_skipped()
                self.say(f"{part}: skipped: {reason}")
                self.record(part, "all", "-", "skipped", reason=reason)
                continue
            self.say(f"{part}: start")
            getattr(self, f"_{part}")()
            self.say(f"{part}: done")
        return self.records

    def _with_model(self, fmt: str, part: str, methods: list[tuple[str, Callable]]) -> None:
        """Build the `fmt` model once, run each (method, measure(model)) on it, then free it."""
        if self.out_of_time():  # each method records itself as skipped
            for method, _ in methods:
                self.method(part, method, fmt, dict)
            return
        self.say(f"{part}: building {self.options.model} in {fmt}")
        started, model, failure = time.perf_counter(), None, None
        try:
            model = self.build(fmt)
        except Exception as exc:  # noqa: BLE001 - e.g. a format the shape refuses: every method on it fails
            failure = (_one_line(exc), traceback.format_exc())
        if failure is not None:
            self.free()
            self.say(f"{part}: cannot build the {fmt} model: {failure[0]}")
            for method, _ in methods:
                self.record(part, method, fmt, "error", reason=f"building the {fmt} model: {failure[0]}",
                            details=failure[1])
            return
        self.say(f"{part}: built in {time.perf_counter() - started:.1f} s")
        for method, measure in methods:
            self.method(part, method, fmt if method.startswith("ours") else "bf16", partial(_on, measure, model))
        del model
        self.free()

    def _decode(self) -> None:
        s = self.sizes
        prompt = _random_ids(s.prompt, self.config.vocab_size, self.options.seed)
        for fmt in self.options.weights:
            methods = [(f"ours {fmt}", lambda m: self._decode_ours(m, prompt))]
            if fmt != "bf16":  # then the same model with its LM head in the format too, as gpt-fast quantizes it
                methods.append((f"ours {fmt}, head {fmt}", lambda m, fmt=fmt: self._decode_ours(
                    quantize_head(m, fmt), prompt)))
            if fmt == "bf16":
                methods += [(b, lambda m, b=b: self._decode_baseline(b, m, prompt)) for b in self.options.baselines]
            self._with_model(fmt, "decode", methods)
        if "bf16" not in self.options.weights and self.options.baselines:  # the baselines run in bf16 only
            self._with_model("bf16", "decode", [(b, lambda m, b=b: self._decode_baseline(b, m, prompt))
                                                for b in self.options.baselines])

    def _ours_then_baselines(self, part: str, ours: Callable, baselines: list[tuple[str, Callable]]) -> None:
        """Ours in the first --weights format, then the baselines on the bf16 model (the same one
        when ours is bf16 too)."""
        fmt = self.options.weights[0]
        if fmt == "bf16":
            self._with_model("bf16", part, [("ours bf16", ours), *baselines])
            return
        self._with_model(fmt, part, [(f"ours {fmt}", ours)])
        if baselines:
            self._with_model("bf16", part, baselines)

    def _batch(self) -> None:
        compiled = [("compiled", self._batch_compiled)] if "compiled" in self.options.baselines else []
        self._ours_then_baselines("batch", self._batch_ours, compiled)

    def _prefill(self) -> None:
        s = self.sizes
        prompts = torch.tensor([_random_ids(s.prefill_len, self.config.vocab_size, self.options.seed + 1 + i)
                                for i in range(s.prefill_batch)])
        self._ours_then_baselines("prefill", lambda m: self._prefill_ours(m, prompts),
                                  [(b, lambda m, b=b: self._prefill_baseline(b, m, prompts))
                                   for b in self.options.baselines])

    def _trace(self) -> None:
        fmt = self.options.weights[0]
        self._with_model(fmt, "trace", [(f"ours {fmt}", self._trace_ours)])

    # --- decode, batch 1 ---

    def _decode_figures(self, timing: StepTiming, weight_bytes: int, batch: int, context: float,
                        kv_dtype: torch.dtype) -> dict:
        nbytes = decode_bytes(weight_bytes, self.config, batch, context, kv_dtype)
        floor = floor_ms(nbytes, self.copy_gbps)
        return {"ms": timing.median_ms, "tok_s": batch * 1e3 / timing.median_ms,
                "wall_tok_s": batch * timing.n / timing.wall_s if timing.wall_s > 0 else None,
                "timing": asdict(timing), "context": context, "weight_bytes": weight_bytes,
                "bytes_per_step": nbytes, "floor_ms": floor, "pct_of_floor": 100 * floor / timing.median_ms}

    def _decode_context(self) -> float:
        """The mean context of the timed steps: the step at position p reads p + 1 tokens."""
        s = self.sizes
        return s.prompt + s.warmup + (s.steps + 1) / 2

    def _decode_ours(self, model, prompt: list[int]) -> dict:
        from kforge.models.engine import Engine
        from kforge.models.llama.quantize import weight_bytes
        from kforge.models.sampling import SamplingParams

        s = self.sizes
        generated = 1 + s.warmup + s.steps  # the prefill's token, then one per step
        engine = Engine(model, max_slots=1, max_context=s.prompt + generated, max_step_tokens=s.prompt)
        request = engine.submit(prompt, SamplingParams(max_tokens=generated))
        engine.step()  # the whole prompt in one step, untimed
        if request.in_prefill:
            raise RuntimeError("the prompt was not prefilled in one step")
        timing = time_steps(engine.step, steps=s.steps, warmup=s.warmup, cuda=self.cuda)
        if len(request.output) != generated:
            raise RuntimeError(f"the request generated {len(request.output)} tokens, not {generated}")
        return self._decode_figures(timing, weight_bytes(model), 1, self._decode_context(), model.embed.dtype)

    def _decode_baseline(self, baseline: str, model, prompt: list[int]) -> dict:
        from kforge.models.llama.quantize import weight_bytes

        s = self.sizes
        # the compiled loop's first step (its compilation) takes a position before the warm-up
        context = s.prompt + s.warmup + s.steps + 1
        tokens = torch.tensor([prompt], device=model.embed.device)
        positions = torch.arange(context, device=model.embed.device)
        if baseline == "transformers":
            step, extra = _transformers_decoder(model, tokens, positions, context)
            first = 0
        else:
            from kforge.models.llama.baseline import StaticCacheLlama

            base = StaticCacheLlama(model, max_batch=1, max_context=context)
            token = base(tokens, positions[:s.prompt])[:, -1].argmax(-1, keepdim=True)  # uncompiled, as gpt-fast
            step, extra = self._compiled_loop(base, token, positions, s.prompt)
            first = 1
        timing = time_steps(step, steps=s.steps, warmup=s.warmup, cuda=self.cuda)
        return {**self._decode_figures(timing, weight_bytes(model), 1, self._decode_context() + first,
                                       model.embed.dtype), **extra}

    def _compiled_loop(self, base, token: torch.Tensor, positions: torch.Tensor, position: int
                       ) -> tuple[Callable[[], torch.Tensor], dict]:
        """The gpt-fast-style decode loop from `position` on, each step returning its greedy
        token and feeding it back, and its first step run (which compiles): `compiled_decode()`
        on CUDA, the same forward eagerly on a CPU (where torch.compile would build C++ for
        minutes to time a tiny model)."""
        decode = base.compiled_decode(mode=self.options.compile_mode) if self.cuda else base.forward
        # a new step for CUDA graph trees: the last step's outputs may be overwritten
        mark_step = torch.compiler.cudagraph_mark_step_begin if self.cuda else (lambda: None)
        state = {"token": token, "position": position}

        def step() -> torch.Tensor:
            p = state["position"]
            mark_step()
            logits = decode(state["token"], positions[p:p + 1])
            state["token"], state["position"] = logits[:, -1].argmax(-1, keepdim=True), p + 1
            return state["token"]

        started = time.perf_counter()
        step()
        if self.cuda:
            torch.cuda.synchronize()
        extra = {"compiled": self.cuda, "compile_mode": self.options.compile_mode if self.cuda else None,
                 "first_step_s": time.perf_counter() - started}
        if not self.cuda:
            extra["note"] = "uncompiled: torch.compile runs on CUDA only"
        return step, extra

    # --- batch decode ---

    def _batch_ours(self, model) -> dict:
        from kforge.models.engine import Engine
        from kforge.models.llama.quantize import weight_bytes
        from kforge.models.sampling import SamplingParams

        s = self.sizes
        generated = batch_tokens_out(s)
        prompt_len = s.context - generated
        engine = Engine(model, max_slots=s.batch, max_context=s.context, max_step_tokens=batch_step_tokens(s))
        requests = [engine.submit(_random_ids(prompt_len, self.config.vocab_size, self.options.seed + 100 + i),
                                  SamplingParams(max_tokens=generated)) for i in range(s.batch)]
        started, prefill_steps = time.perf_counter(), 0
        while any(r.in_prefill for r in requests):
            engine.step()
            prefill_steps += 1
        prefill_s = time.perf_counter() - started
        left = min(r.max_tokens - len(r.output) for r in requests)
        if left < s.warmup + s.batch_steps:
            raise RuntimeError(f"prefill took {prefill_steps} steps: a sequence has {left} tokens left, fewer than "
                               f"warmup + batch_steps")
        # each sequence's length after the warm-up: its first timed step reads that many tokens plus its new one
        start = statistics.fmean(len(r.prompt) + len(r.output) for r in requests) + s.warmup
        timing = time_steps(engine.step, steps=s.batch_steps, warmup=s.warmup, cuda=self.cuda)
        figures = self._decode_figures(timing, weight_bytes(model), s.batch, start + (s.batch_steps + 1) / 2,
                                       model.embed.dtype)
        return {**figures, "prefill_steps": prefill_steps, "prefill_s": prefill_s, "prompt_len": prompt_len}

    def _batch_compiled(self, model) -> dict:
        from kforge.models.llama.baseline import StaticCacheLlama
        from kforge.models.llama.quantize import weight_bytes

        s = self.sizes
        start = s.context - s.warmup - s.batch_steps - 1  # the last timed step reads the whole context
        tokens = torch.tensor([_random_ids(1, self.config.vocab_size, self.options.seed + 100 + i)
                               for i in range(s.batch)], device=model.embed.device)
        # the cache is not prefilled: every step attends over all of it under a mask, whatever it holds
        base = StaticCacheLlama(model, max_batch=s.batch, max_context=s.context)
        step, extra = self._compiled_loop(base, tokens, torch.arange(s.context, device=model.embed.device), start)
        timing = time_steps(step, steps=s.batch_steps, warmup=s.warmup, cuda=self.cuda)
        context = start + 1 + s.warmup + (s.batch_steps + 1) / 2
        return {**self._decode_figures(timing, weight_bytes(model), s.batch, context, model.embed.dtype), **extra,
                "note": "static cache not prefilled; each step reads all of it"}

    # --- prefill ---

    def _prefill_figures(self, timing: StepTiming, extra: dict | None = None) -> dict:
        s = self.sizes
        tokens = s.prefill_batch * s.prefill_len
        return {"ms": timing.median_ms, "tok_s": tokens * 1e3 / timing.median_ms, "timing": asdict(timing),
                "tokens": tokens, "tflops": prefill_flops(self.config, s.prefill_batch, s.prefill_len)
                / timing.median_ms / 1e9, **(extra or {})}

    def _prefill_ours(self, model, prompts: torch.Tensor) -> dict:
        from kforge.models.engine import Engine
        from kforge.models.sampling import SamplingParams

        s = self.sizes
        engine = Engine(model, max_slots=s.prefill_batch, max_context=s.prefill_len + 1,
                        max_step_tokens=s.prefill_batch * s.prefill_len)
        rows = prompts.tolist()

        def step() -> None:  # every prompt whole in one step, each yielding its first token
            for row in rows:
                engine.submit(row, SamplingParams(max_tokens=1))
            engine.step()
            if engine.scheduler.has_work:
                raise RuntimeError("the prompts did not all prefill in one step")

        return self._prefill_figures(time_steps(step, steps=s.prefill_reps, warmup=max(s.warmup // 4, 1),
                                                cuda=self.cuda))

    def _prefill_baseline(self, baseline: str, model, prompts: torch.Tensor) -> dict:
        s = self.sizes
        tokens = prompts.to(model.embed.device)
        positions = torch.arange(s.prefill_len, device=model.embed.device)
        extra: dict = {}
        if baseline == "transformers":
            hf, extra = _transformers_model(model)
            kwargs = _hf_logits_to_keep(hf)

            def step() -> None:
                hf(input_ids=tokens, position_ids=positions[None].expand(len(tokens), -1), use_cache=False,
                   **kwargs).logits[:, -1].argmax(-1)
        else:
            from kforge.models.llama.baseline import StaticCacheLlama

            base = StaticCacheLlama(model, max_batch=s.prefill_batch, max_context=s.prefill_len)
            if self.cuda:
                forward = base.compiled_prefill()
                extra = {"compiled": True, "compile_mode": "default"}
            else:
                forward = base.forward
                extra = {"compiled": False, "note": "uncompiled: torch.compile runs on CUDA only"}

            def step() -> None:
                forward(tokens, positions, last_only=True)[:, -1].argmax(-1)

            started = time.perf_counter()
            step()  # compiles
            if self.cuda:
                torch.cuda.synchronize()
            extra["first_step_s"] = time.perf_counter() - started
        timing = time_steps(step, steps=s.prefill_reps, warmup=max(s.warmup // 4, 1), cuda=self.cuda)
        return self._prefill_figures(timing, extra)

    # --- the trace ---

    def _trace_ours(self, model) -> dict:
        from kforge.models.engine import Engine
        from kforge.models.sampling import SamplingParams
        from kforge.models.scheduler import summary

        s = self.sizes
        trace = poisson_trace(s.requests, s.rate, s.trace_prompt, s.trace_output, vocab=self.config.vocab_size,
                              seed=self.options.seed)
        engine = Engine(model, max_slots=s.slots, max_context=s.trace_prompt[1] + s.trace_output[1],
                        max_step_tokens=s.step_tokens)
        # Warm-up, so that nothing the first steps of a shape compile or capture lands in the trace's
        # latencies: a full batch of short prompts, request i stopping after i + 1 tokens, so that a decode
        # step of every batch size from `slots` down to 1 runs; then prompts of the trace's own lengths.
        for i in range(s.slots):
            engine.submit(trace[i % len(trace)].prompt[:8], SamplingParams(max_tokens=min(i + 1, s.trace_output[1])))
        for _ in engine.run():
            pass
        for item in trace[:s.slots]:
            engine.submit(item.prompt, SamplingParams(max_tokens=1))
        for _ in engine.run():
            pass
        if self.cuda:
            torch.cuda.synchronize()
        pending, requests = deque(trace), []
        start = time.perf_counter()
        while pending or engine.scheduler.has_work:
            now = time.perf_counter() - start
            while pending and pending[0].arrival <= now:
                item = pending.popleft()
                request = engine.submit(item.prompt, SamplingParams(max_tokens=item.max_tokens))
                request.arrival = start + item.arrival  # TTFT from when it arrived, not when a step ended
                requests.append(request)
            if engine.scheduler.has_work:
                engine.step()
            elif pending:
                time.sleep(max(0.0, pending[0].arrival - (time.perf_counter() - start)))
        stats = summary(requests)
        ms = {k: (v * 1e3 if v is not None else None) for k, v in stats.items() if k.startswith(("ttft", "tpot"))}
        return {"tok_s": stats["throughput"], "ms": ms["tpot_p50"], "requests": stats["requests"],
                "output_tokens": stats["output_tokens"], "duration_s": stats["duration"],
                "prompt_tokens": sum(len(r.prompt) for r in requests),
                "offered_rate": s.rate, **{f"{k}_ms": v for k, v in ms.items()}}


def prefill_flops(config: LlamaConfig, batch: int, length: int) -> float:
    """FLOPs of a causal prefill of `batch` prompts of `length` tokens, the last position's
    logits only: every linear layer (2 per weight per token), attention's QK^T and PV over
    the causal half, and the head once per prompt."""
    c = config
    linear = c.n_layers * (c.dim * (c.q_dim + 2 * c.kv_dim) + c.q_dim * c.dim + 3 * c.dim * c.ffn_dim)
    attention = c.n_layers * 2 * c.n_heads * c.head_dim * length * length  # 2 matmuls x 2 flops x half of L^2
    return batch * (2 * linear * length + attention + 2 * c.vocab_size * c.dim)


# --- transformers ------------------------------------------------------------------------------


def _transformers_model(model) -> tuple[object, dict]:
    """transformers' LlamaForCausalLM holding `model`'s weights (copied), built on the model's
    device in its dtype: built in fp32 on the host, an 8B model would take 32 GB and minutes."""
    try:
        import transformers
    except ImportError:
        raise KforgeError("transformers is not installed (pip install transformers)") from None
    from kforge.models.llama.export import to_hf_config, to_hf_state_dict

    config = transformers.LlamaConfig(**to_hf_config(model.config))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(model.embed.dtype)
    try:
        with torch.device(model.embed.device):
            hf = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(model), strict=False)
    missing = [name for name in missing if not (name == "lm_head.weight" and model.config.tie_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"transformers' model does not take these weights: missing {missing[:3]}, "
                           f"unexpected {unexpected[:3]}")
    return hf.eval(), {"transformers": transformers.__version__,
                       "attn_implementation": getattr(hf.config, "_attn_implementation", None)}


def _hf_logits_to_keep(hf) -> dict:
    """The keyword that limits the logits to the last position (its name changed in 4.50)."""
    names = inspect.signature(hf.forward).parameters
    for name in ("logits_to_keep", "num_logits_to_keep"):
        if name in names:
            return {name: 1}
    return {}


def _transformers_decoder(model, tokens: torch.Tensor, positions: torch.Tensor,
                          context: int) -> tuple[Callable, dict]:
    """transformers' own decode loop, eager: the prompt prefilled into a StaticCache, then one
    forward per token (each step returns its greedy token), as `generate(cache_implementation=
    "static")` runs without compiling. The cache's keyword is `past_key_values` (4.x) or
    `cache` (5.x); 4.x takes `cache_position`, and before 4.56 the cache's batch, device and
    dtype up front."""
    from transformers import StaticCache

    hf, extra = _transformers_model(model)
    names = inspect.signature(hf.forward).parameters
    cache_arg = "cache" if "cache" in names else "past_key_values"
    wanted = {"config": hf.config, "max_cache_len": context, "max_batch_size": tokens.shape[0],
              "batch_size": tokens.shape[0], "device": tokens.device, "dtype": model.embed.dtype}
    takes = inspect.signature(StaticCache.__init__).parameters
    if "max_batch_size" in takes:
        del wanted["batch_size"]
    cache = StaticCache(**{k: v for k, v in wanted.items() if k in takes})

    def forward(ids: torch.Tensor, where: torch.Tensor, **kwargs) -> torch.Tensor:
        if "cache_position" in names:
            kwargs["cache_position"] = where
        out = hf(input_ids=ids, position_ids=where[None].expand(ids.shape[0], -1), use_cache=True,
                 **{cache_arg: cache}, **kwargs)
        return out.logits[:, -1].argmax(-1, keepdim=True)

    length = tokens.shape[1]
    state = {"token": forward(tokens, positions[:length], **_hf_logits_to_keep(hf)), "position": length}

    def step() -> torch.Tensor:
        p = state["position"]
        state["token"], state["position"] = forward(state["token"], positions[p:p + 1]), p + 1
        return state["token"]

    return step, extra


# --- records, rows, the table and the chart ---------------------------------------------------


def _versions() -> dict:
    from importlib import metadata

    from kforge.device import library_versions

    versions = library_versions()
    try:
        versions["transformers"] = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        versions["transformers"] = None
    return versions


def _part_sizes(sizes: Sizes, part: str) -> dict:
    keys = {"decode": ("prompt", "steps", "warmup"), "batch": ("batch", "context", "batch_steps", "warmup"),
            "prefill": ("prefill_batch", "prefill_len", "prefill_reps", "warmup"),
            "trace": ("requests", "rate", "trace_prompt", "trace_output", "slots", "step_tokens")}[part]
    return {k: getattr(sizes, k) for k in keys}


def _on(measure: Callable, model) -> dict:
    # the dtype too: on a CPU, "bf16" weights run in float32
    return {**measure(model), "dtype": str(model.embed.dtype).removeprefix("torch.")}


def _random_ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or "(no message)"
    return f"{type(exc).__name__}: {text[:300]}"


def _summary_line(figures: dict) -> str:
    parts = []
    if figures.get("ms") is not None:
        parts.append(f"{figures['ms']:.3f} ms")
    if figures.get("tok_s") is not None:
        parts.append(f"{figures['tok_s']:,.1f} tok/s")
    if figures.get("pct_of_floor") is not None:
        parts.append(f"{figures['pct_of_floor']:.1f}% of floor")
    if figures.get("ttft_p50_ms") is not None:
        parts.append(f"TTFT p50 {figures['ttft_p50_ms']:.1f} ms")
    if figures.get("first_step_s") is not None:
        parts.append(f"first step {figures['first_step_s']:.1f} s")
    return ", ".join(parts) or "done"


@dataclass(frozen=True)
class ModelRow:
    part: str
    method: str
    weights: str
    status: str  # ok, error or skipped
    ms: float | None  # per token (decode), per step (batch), per forward (prefill), TPOT p50 (trace)
    tok_s: float | None
    pct_of_floor: float | None
    vs: dict[str, float | None] = field(default_factory=dict)  # our tok/s over theirs, same part and run
    note: str = ""
    figures: dict = field(default_factory=dict)


def model_rows(records: Sequence[dict]) -> list[ModelRow]:
    """One row per (part, method) of the latest run in `records`, in the order run; ours
    compared with the compiled baseline, transformers and (decode) our bf16."""
    if not records:
        return []
    run = records[-1].get("run")
    latest: dict[tuple[str, str], dict] = {}
    for r in records:
        if r.get("bench") == "model" and r.get("run") == run:
            latest[(r["part"], r["method"])] = r
    rate = {key: (r["figures"].get("tok_s") if r["status"] == "ok" else None) for key, r in latest.items()}
    rows = []
    for (part, method), r in latest.items():
        f = r["figures"]
        vs: dict[str, float | None] = {}
        if method.startswith("ours") and part != "trace":
            others = ["compiled", "transformers"] + (["ours bf16"] if part == "decode" and method != "ours bf16" else [])
            for other in others:
                if (part, other) in latest:
                    mine, theirs = rate.get((part, method)), rate.get((part, other))
                    vs[other] = mine / theirs if mine and theirs else None
        rows.append(ModelRow(part, method, r["weights"], r["status"], f.get("ms"), f.get("tok_s"),
                             f.get("pct_of_floor"), vs, _note(r), f))
    return rows


def _note(record: dict) -> str:
    if record["status"] != "ok":
        return record.get("reason") or record["status"]
    f = record["figures"]
    bits = []
    if record["part"] == "trace":
        bits.append(f"TTFT p50/p99 {_fmt(f.get('ttft_p50_ms'))}/{_fmt(f.get('ttft_p99_ms'))} ms, TPOT p99 "
                    f"{_fmt(f.get('tpot_p99_ms'))} ms, {f.get('requests')} requests at {f.get('offered_rate')}/s")
    if f.get("timing"):
        bits.append(f"p10-p90 {f['timing']['p10_ms']:.3g}-{f['timing']['p90_ms']:.3g} ms")
    if f.get("context"):
        bits.append(f"ctx {f['context']:.0f}")
    if f.get("tflops"):
        bits.append(f"{f['tflops']:.3g} TFLOP/s")
    if f.get("first_step_s") is not None:
        bits.append(f"first step (compiles) {f['first_step_s']:.1f} s")
    if f.get("note"):
        bits.append(f["note"])
    return "; ".join(bits)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def model_title(records: Sequence[dict]) -> str:
    r = records[-1]
    return f"{r['model']} on {r['device']['name']}: the engine vs transformers and torch.compile (random weights)"


def model_view(rows: Sequence[ModelRow], *, title: str, copy: dict | None, results_path: str | None):
    """The table: one line per (part, method)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    table = Table(title=title, title_justify="left")
    for column in ("part", "method", "ms", "tok/s", "% floor", "vs compiled", "vs HF", "vs bf16", "notes"):
        table.add_column(column, justify="left" if column in ("part", "method", "notes") else "right")

    def num(value: float | None, fmt: str) -> str:
        return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else fmt.format(value)

    for r in rows:
        ok = r.status == "ok"
        table.add_row(r.part, r.method, num(r.ms, "{:.3f}"), num(r.tok_s, "{:,.1f}"), num(r.pct_of_floor, "{:.1f}%"),
                      num(r.vs.get("compiled"), "{:.2f}x"), num(r.vs.get("transformers"), "{:.2f}x"),
                      num(r.vs.get("ours bf16"), "{:.2f}x"), Text(r.note, style=None if ok else "red"))
    gbps = (copy or {}).get("gbps")
    note = ("ms: median per token at batch 1 (decode), per step of the whole batch (batch), per forward of all the "
            "prompts (prefill), TPOT p50 (trace), timed between consecutive steps (CUDA events on a GPU); % of floor: the "
            "bytes a step must read (weights + KV) over the copy bandwidth"
            + (f" ({gbps:,.0f} GB/s, {copy.get('source')})" if gbps else "") + ", over the time; vs: our tok/s over "
            "theirs in the same part and run (HF: transformers, eager; compiled: the gpt-fast-style model under "
            "torch.compile; bf16: ours in bf16); baselines in bf16")
    parts = [table, Text(note, style="dim")]
    if results_path:
        parts.append(Text(f"records appended to {results_path}", style="dim"))
    return Group(*parts)


def save_model_chart(rows: Sequence[ModelRow], path: Path, *, title: str) -> Path:
    """One panel per part: tok/s per method (% of floor above the decode and batch bars); the
    trace's panel its TTFT and TPOT percentiles."""
    from kforge.views import pyplot, save_figure

    plt = pyplot()
    parts = list(dict.fromkeys(r.part for r in rows))
    if not parts:
        raise KforgeError("nothing to chart: no method was timed")
    fig, axes = plt.subplots(1, len(parts), figsize=(4.2 * len(parts) + 1, 4.8), dpi=120, squeeze=False)
    for ax, part in zip(axes[0], parts):
        mine = [r for r in rows if r.part == part]
        if part == "trace":
            ok = [r for r in mine if r.status == "ok"]
            labels = ["TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99"]
            for i, r in enumerate(ok):
                values = [r.figures.get(k) or math.nan for k in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms",
                                                                   "tpot_p99_ms")]
                ax.bar([j + i * 0.8 / len(ok) for j in range(4)], values, 0.8 / max(len(ok), 1), label=r.method)
            ax.set_xticks(range(4), labels, fontsize=8)
            ax.set_ylabel("ms")
            ax.set_yscale("log")
            if ok:
                ax.legend(fontsize=7)
        else:
            values = [r.tok_s or 0 for r in mine]
            bars = ax.bar(range(len(mine)), values, color=["#4c72b0" if r.method.startswith("ours") else "#999999"
                                                           for r in mine])
            for bar, r in zip(bars, mine):
                label = (f"{r.pct_of_floor:.0f}%" if r.pct_of_floor else "") if r.status == "ok" else r.status
                ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                            va="bottom", fontsize=7)
            ax.set_xticks(range(len(mine)), [r.method for r in mine], rotation=30, ha="right", fontsize=8)
            ax.set_ylabel("tokens/s" + (" (% of floor above)" if part in ("decode", "batch") else ""))
        ax.set_title(part, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, path)

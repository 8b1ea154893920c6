"""`kforge bench attention`: our FlashAttention forwards (Triton, "ours"; CUDA for Hopper,
"ours-cuda"), naive attention and SDPA's other backends against SDPA's flash backend (the
problem's reference), shape by shape.

Shapes follow the FlashAttention papers' sweep: sequence 512..16k, head dim 64 and 128,
causal and not, with batch x heads holding 32k tokens x 2048 model width, so every shape
fills the GPU (B x H = 128 at N = 4096, D = 128). Naive attention is timed up to the
largest shape whose N x N scores fit comfortably (two bf16 buffers of B*H*N^2).

`kforge bench attention --backward` times, on the same shapes, the backward pass alone and
a training step (forward + backward) of ours (dQ by its own kernel, and by atomics), SDPA flash and
SDPA cuDNN (`run_attention_backward`). Those run in process on the harness's timing engine,
not through `evaluate()`: a problem's Model is one call on fresh inputs, and a backward needs
the forward's graph kept from call to call. Each input set holds each method's own forward
graph (its own saved output and log-sum-exp); a backward call replays that graph
(`retain_graph`), a training-step call builds it anew. FLOPs: 2.5x the forward's 4*B*H*N^2*D
backward (5 matmuls to 2), 3.5x for the step, half of each causal.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from kforge.bench import BenchJob, BenchRow, size_constants

PROBLEM = Path(__file__).parent.parent / "problems" / "level1" / "attention_bf16.py"
BASELINE = "sdpa-flash"
SEQUENCES = (512, 1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128)
TOKENS, MODEL_WIDTH = 32768, 2048
# Published H100 bf16 forward rates at hd 128 for scale (ANCHORS.md; TFLOP/s at N = 4k-16k,
# read off the FlashAttention-3 paper's charts): (non-causal, causal).
PUBLISHED = {"FlashAttention-3 paper": (640, 580)}
NAIVE_MAX_SCORES = 2**32  # B*H*N^2 entries: 8.6 GB a bf16 buffer (N = 8192 at D = 128)
BACKWARD_RECORD = "attention-backward"  # the "bench" field of a backward record
BACKWARD_METHODS = ("ours", "ours-atomic-dq", BASELINE, "sdpa-cudnn")
PASSES = ("backward", "train")  # the backward alone; a training step, forward + backward
# Two bf16 backward passes each ~3e-3 (relative, Frobenius) from float64 (tests/kernels/
# test_flash_backward.py): farther apart than this from SDPA flash's gradients is a mismatch.
BACKWARD_AGREEMENT = 2e-2


@dataclass(frozen=True)
class AttentionShape:
    batch: int
    heads: int
    seq: int
    head_dim: int
    causal: bool

    @property
    def label(self) -> str:
        return f"{'causal' if self.causal else 'full'} N={self.seq} D={self.head_dim}"

    @property
    def sizes(self) -> dict[str, int]:
        return {"B": self.batch, "H": self.heads, "KV_HEADS": self.heads, "N": self.seq, "D": self.head_dim,
                "CAUSAL": int(self.causal)}


def attention_shapes() -> list[AttentionShape]:
    return [AttentionShape(max(1, TOKENS // seq), MODEL_WIDTH // dim, seq, dim, causal)
            for causal in (False, True) for dim in HEAD_DIMS for seq in SEQUENCES]


class OursAttention:
    """kforge's Triton FlashAttention forward (the kernel itself, not the op's fallbacks),
    autotuned, or held to one `config` (BLOCK_M, BLOCK_N, num_warps, num_stages)."""

    def __init__(self, causal: bool, config: dict | None = None):
        self.causal, self.config = causal, config

    def __call__(self, q, k, v):
        from kforge.kernels.attention.flash_forward import flash_attention_forward

        return flash_attention_forward(q, k, v, causal=self.causal, config=self.config)[0]


class OursCudaAttention:
    """kforge's CUDA FlashAttention forward for Hopper (`kernels/attention/flash_hopper.cu`)."""

    def __init__(self, causal: bool):
        self.causal = causal

    def __call__(self, q, k, v):
        from kforge.kernels.attention.flash_hopper import flash_attention_hopper

        return flash_attention_hopper(q, k, v, causal=self.causal)[0]


def hopper_gpu() -> bool:
    """Whether this machine's GPU runs the sm_90a CUDA kernel ("ours-cuda" is timed only there)."""
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


class NaiveAttention:
    def __init__(self, causal: bool):
        self.causal = causal

    def __call__(self, q, k, v):
        from kforge.kernels.attention.naive import naive_attention

        return naive_attention(q, k, v, causal=self.causal)


class SdpaBackend:
    """torch's scaled_dot_product_attention held to one backend (it raises if the backend
    cannot take the inputs, so a row never silently measures another backend)."""

    def __init__(self, backend: str, causal: bool):
        self.backend, self.causal = backend, causal

    def __call__(self, q, k, v):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention

        with sdpa_kernel(getattr(SDPBackend, self.backend)):
            return scaled_dot_product_attention(q, k, v, is_causal=self.causal)


def attention_methods(shape: AttentionShape) -> dict:
    """The methods timed against SDPA flash on one shape; "ours-cuda" (the CUDA kernel, compiled for
    sm_90a) at head dims 64 and 128 on a Hopper GPU only."""
    from kforge.kernels.attention import flash_forward, flash_hopper, naive
    from kforge.ladder import source_candidate

    here = Path(__file__)
    methods = {
        "ours": source_candidate("ours", lambda: OursAttention(shape.causal), [Path(flash_forward.__file__)]),
        "sdpa-cudnn": source_candidate("sdpa-cudnn", lambda: SdpaBackend("CUDNN_ATTENTION", shape.causal), [here]),
        "sdpa-efficient": source_candidate("sdpa-efficient", lambda: SdpaBackend("EFFICIENT_ATTENTION", shape.causal),
                                           [here]),
    }
    if shape.head_dim in flash_hopper.HEAD_DIMS and hopper_gpu():
        methods["ours-cuda"] = source_candidate("ours-cuda", lambda: OursCudaAttention(shape.causal),
                                                [Path(flash_hopper.__file__), flash_hopper.SOURCE])
    if shape.batch * shape.heads * shape.seq**2 <= NAIVE_MAX_SCORES:
        methods["naive"] = source_candidate("naive", lambda: NaiveAttention(shape.causal), [Path(naive.__file__)])
    return methods


def attention_jobs(shapes: Sequence[AttentionShape]) -> Iterator[BenchJob]:
    from kforge.harness.problem import load_problem

    for shape in shapes:
        problem = load_problem(PROBLEM, "full", shape.sizes)
        for method, candidate in attention_methods(shape).items():
            # SDPA's own backends are the libraries being compared, not suspects: the
            # problem's ban on SDPA kernels applies to ours and naive only.
            library = method.startswith("sdpa-")
            yield BenchJob(f"{shape.label} {method}", dataclasses.replace(problem, forbidden_ops=[]) if library
                           else problem, candidate)


def sweep_jobs(shapes: Sequence[AttentionShape]) -> Iterator[BenchJob]:
    """Our kernel held to each of its autotuner's configs in turn (what the autotuner
    chooses between, timed by the harness against SDPA flash)."""
    from kforge.harness.problem import load_problem
    from kforge.kernels.attention import flash_forward
    from kforge.ladder import source_candidate

    for shape in shapes:
        problem = load_problem(PROBLEM, "full", shape.sizes)
        for c in flash_forward.CONFIGS[shape.head_dim]:
            config = {**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages}
            name = f"ours {config['BLOCK_M']}x{config['BLOCK_N']} w{c.num_warps} s{c.num_stages}"
            candidate = source_candidate(name, lambda config=config, causal=shape.causal: OursAttention(causal, config),
                                         [Path(flash_forward.__file__)], config)
            yield BenchJob(f"{shape.label} {name}", problem, candidate)


def attention_label(record: dict) -> str:
    size = size_constants(record)
    return f"{'causal' if size['CAUSAL'] else 'full'} N={size['N']} D={size['D']}"


def hbm_bytes(method: str, sizes: dict[str, int]) -> int:
    """The bytes a method must move through HBM at least: Q, K, V read and O written once
    (2 bytes an element); naive attention also writes and reads the N x N scores and then
    the probabilities (4 passes over B*H*N^2 two-byte entries)."""
    b, h, n, d = sizes["B"], sizes["H"], sizes["N"], sizes["D"]
    qkvo = 2 * (2 * b * h * n * d + 2 * b * sizes.get("KV_HEADS", h) * n * d)
    return qkvo + (4 * 2 * b * h * n * n if method == "naive" else 0)


def save_attention_chart(rows, path: Path, *, title: str, records: Sequence[dict]) -> Path:
    """TFLOP/s against sequence length, as the FlashAttention papers draw it: one panel per
    (head dim, causal), one line per method, the measured bf16 matmul roof dashed."""
    from kforge.views import pyplot, save_figure

    plt = pyplot()
    panels = sorted({(r.sizes["D"], r.sizes["CAUSAL"]) for r in rows})
    methods = [BASELINE, *sorted({m for r in rows for m in r.vs_baseline})]
    roof = ((records[0].get("roofline") or {}).get("ceilings") or {}).get("matmul_tflops", {}).get("bf16")
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.4), dpi=120, squeeze=False, sharey=True)
    for ax, (dim, causal) in zip(axes[0], panels):
        mine = sorted((r for r in rows if (r.sizes["D"], r.sizes["CAUSAL"]) == (dim, causal)),
                      key=lambda r: r.sizes["N"])
        for method in methods:
            points = [(r.sizes["N"], r.tflops.get(method)) for r in mine
                      if r.tflops.get(method) and (method == BASELINE
                                                  or r.status.get(method) in ("passed", "slower", "tie"))]
            if points:
                ax.plot(*zip(*points), marker="o", linewidth=2.2 if method == "ours" else 1.2, label=method)
        if roof:
            ax.axhline(roof, color="grey", linestyle="--", linewidth=1, label=f"bf16 mm roof {roof:.0f}")
        ax.set_xscale("log", base=2)
        ax.set_xticks([r.sizes["N"] for r in mine], [f"{r.sizes['N'] // 1024}k" if r.sizes["N"] >= 1024
                                                     else str(r.sizes["N"]) for r in mine])
        ax.set_title(f"head dim {dim}, {'causal' if causal else 'non-causal'}", fontsize=10)
        ax.set_xlabel("sequence length")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("TFLOP/s (median, L2 flushed)")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    return save_figure(fig, path)


# --- the backward and the training step ------------------------------------------------------------

def forward_with_graph(method: str, causal: bool) -> Callable:
    """(q, k, v) -> out with autograd recording the method's own backward."""
    if method.startswith("ours"):
        from kforge.ops import flash_attention

        atomic_dq = method == "ours-atomic-dq"
        return lambda q, k, v: flash_attention(q, k, v, causal=causal, atomic_dq=atomic_dq)
    return SdpaBackend({BASELINE: "FLASH_ATTENTION", "sdpa-cudnn": "CUDNN_ATTENTION"}[method], causal)


def pass_flops(shape: AttentionShape, which: str) -> int:
    """FLOPs of the backward (2.5 forwards) or of a training step (3.5 forwards), half causal."""
    from kforge.kernels.attention.flash_backward import backward_flops

    backward = backward_flops(shape.batch, shape.heads, shape.seq, shape.seq, shape.head_dim, shape.causal)
    return backward if which == "backward" else backward * 7 // 5


def time_backward(shape: AttentionShape, device, timing, methods: Sequence[str] = BACKWARD_METHODS,
                  seed: int = 0) -> dict:
    """Each method's backward and training step on `shape` (bf16), interleaved by the harness's
    timing engine; the figures of a backward record. A method that fails on its first call is
    recorded with its error and left out of the timing; one whose gradients stray from SDPA
    flash's by more than BACKWARD_AGREEMENT is timed and marked "mismatch"."""
    import torch

    from kforge.harness.timing import time_interleaved
    from kforge.ops.attention import ours_can_run

    dev = device.torch_device
    forwards = {m: forward_with_graph(m, shape.causal) for m in methods}

    def input_set(i, names):  # q, k, v, dO and each method's forward graph on them
        g = torch.Generator(device=dev).manual_seed(seed + i)
        q, k, v, d_out = (torch.randn(shape.batch, shape.heads, shape.seq, shape.head_dim, generator=g, device=dev,
                                      dtype=torch.bfloat16) for _ in range(4))
        graphs = {}
        with torch.enable_grad():
            for m in names:
                leaves = [t.detach().requires_grad_() for t in (q, k, v)]
                graphs[m] = (forwards[m](*leaves), leaves)
        return [q, k, v, d_out, graphs]

    def backward(m):
        return lambda s: torch.autograd.grad(s[4][m][0], s[4][m][1], s[3], retain_graph=True)

    def train_step(m):
        def call(s):
            with torch.enable_grad():
                leaves = [t.detach().requires_grad_() for t in s[:3]]
                return torch.autograd.grad(forwards[m](*leaves), leaves, s[3])
        return call

    figures, gradients = {}, {}
    for m in methods:  # the first call also autotunes ours
        try:
            first = input_set(0, [m])
            if m.startswith("ours") and not ours_can_run(*first[:3], None):
                raise RuntimeError("our kernels do not take these inputs (the op would run its PyTorch fallback)")
            gradients[m] = backward(m)(first)
        except Exception as exc:  # noqa: BLE001 - a backend that cannot take the shape is recorded, not fatal
            lines = str(exc).strip().splitlines()
            figures[m] = {"status": "error", "reason": f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]}
    working = [m for m in methods if m in gradients]
    reference = gradients.get(BASELINE)
    for m in working:
        differs = None if reference is None else max(
            float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(gradients[m], reference))
        figures[m] = {"status": "mismatch" if differs is not None and differs > BACKWARD_AGREEMENT else "ok",
                      "differs_from_flash": differs}
    del gradients, reference
    if not working:
        return {"methods": figures}

    fns = {f"{m} {which}": (backward if which == "backward" else train_step)(m) for m in working for which in PASSES}
    run = time_interleaved(fns, lambda i: input_set(i + 1, working), device, timing)
    for m in working:
        for which in PASSES:
            name = f"{m} {which}"
            figures[m][which] = {"device_ms": run.profile[name].median_device_ms, "ms": run.stats[name].median_ms}
    return {"methods": figures, "flops": {which: pass_flops(shape, which) for which in PASSES},
            "timing": {"clock": run.clock, "rounds": run.rounds, "stop_reason": run.stop_reason,
                       "cover_ms": run.cover_ms, "flush_bytes": run.flush_bytes}}


def run_attention_backward(shapes: Sequence[AttentionShape], *, time_budget: float, results: Path | None,
                           command: str | None = None, on_step: Callable[[str], None] | None = None) -> list[dict]:
    """A backward record for every shape on this GPU, appended to `results` as each lands; a shape
    that fails is recorded as an error and the next one runs."""
    from kforge.bench import run_in_process
    from kforge.harness.timing import TimingConfig

    return run_in_process(shapes, lambda shape, device: time_backward(shape, device, TimingConfig(budget_s=time_budget)),
                          bench=BACKWARD_RECORD, step="backward", results=results, command=command, on_step=on_step)


@dataclass(frozen=True)
class BackwardLine:
    """One method on one shape: device times and rates of the backward and of the training step."""
    shape: str
    sizes: dict[str, int]
    method: str
    status: str  # ok, mismatch (gradients stray from SDPA flash's), error (no timing)
    reason: str | None
    ms: dict[str, float | None]  # per pass: median device time
    tflops: dict[str, float | None]  # per pass: FLOPs over the device time
    vs_flash: dict[str, float | None]  # per pass: SDPA flash's device time over this method's
    differs_from_flash: float | None


def backward_lines(records: Sequence[dict]) -> list[BackwardLine]:
    """Per shape (latest backward record of each, in the order first seen) one line per method,
    SDPA flash first."""
    latest: dict[str, dict] = {}
    for r in records:
        if r.get("bench") == BACKWARD_RECORD:
            latest[r["shape"]] = r
    lines = []
    for shape, r in latest.items():
        methods = r.get("methods") or {}
        if r.get("status") != "ok" or not methods:
            lines.append(BackwardLine(shape, r.get("sizes") or {}, "-", r.get("status", "error"), r.get("reason"),
                                      {}, {}, {}, None))
            continue
        flash = methods.get(BASELINE) or {}
        for method in sorted(methods, key=lambda m: (m != BASELINE, BACKWARD_METHODS.index(m)
                                                     if m in BACKWARD_METHODS else len(BACKWARD_METHODS), m)):
            figures = methods[method]
            ms = {p: (figures.get(p) or {}).get("device_ms") for p in PASSES}
            flops = r.get("flops") or {}
            lines.append(BackwardLine(
                shape, r.get("sizes") or {}, method, figures.get("status", "error"), figures.get("reason"), ms,
                {p: flops[p] / ms[p] / 1e9 if ms[p] and flops.get(p) else None for p in PASSES},
                {p: (flash.get(p) or {}).get("device_ms") / ms[p] if ms[p] and (flash.get(p) or {}).get("device_ms")
                 else None for p in PASSES},
                figures.get("differs_from_flash")))
    return lines


def backward_bench_rows(records: Sequence[dict], which: str) -> list[BenchRow]:
    """One pass's (backward or train) rates as BenchRows, for `save_attention_chart`."""
    rows: dict[str, BenchRow] = {}
    for line in backward_lines(records):
        if line.method == "-" or line.status == "error":
            continue
        row = rows.setdefault(line.shape, BenchRow(line.shape, {}, {}, {}, line.sizes))
        row.tflops[line.method] = line.tflops[which]
        if line.method != BASELINE:
            row.vs_baseline[line.method] = line.vs_flash[which]
            row.status[line.method] = "passed" if line.status == "ok" else "incorrect"
    return list(rows.values())

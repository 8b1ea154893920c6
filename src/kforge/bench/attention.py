"""`kforge bench attention`: our FlashAttention forward, naive attention and SDPA's other
backends against SDPA's flash backend (the problem's reference), shape by shape.

Shapes follow the FlashAttention papers' sweep: sequence 512..16k, head dim 64 and 128,
causal and not, with batch x heads holding 32k tokens x 2048 model width, so every shape
fills the GPU (B x H = 128 at N = 4096, D = 128). Naive attention is timed up to the
largest shape whose N x N scores fit comfortably (two bf16 buffers of B*H*N^2).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from kforge.bench import BenchJob, size_constants

PROBLEM = Path(__file__).parent.parent / "problems" / "level1" / "attention_bf16.py"
BASELINE = "sdpa-flash"
SEQUENCES = (512, 1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128)
TOKENS, MODEL_WIDTH = 32768, 2048
# Published H100 bf16 forward rates at hd 128 for scale (ANCHORS.md; TFLOP/s at N = 4k-16k,
# read off the FlashAttention-3 paper's charts): (non-causal, causal).
PUBLISHED = {"FlashAttention-3 paper": (640, 580)}
NAIVE_MAX_SCORES = 2**32  # B*H*N^2 entries: 8.6 GB a bf16 buffer (N = 8192 at D = 128)


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
    """The methods timed against SDPA flash on one shape."""
    from kforge.kernels.attention import flash_forward, naive
    from kforge.ladder import source_candidate

    here = Path(__file__)
    methods = {
        "ours": source_candidate("ours", lambda: OursAttention(shape.causal), [Path(flash_forward.__file__)]),
        "sdpa-cudnn": source_candidate("sdpa-cudnn", lambda: SdpaBackend("CUDNN_ATTENTION", shape.causal), [here]),
        "sdpa-efficient": source_candidate("sdpa-efficient", lambda: SdpaBackend("EFFICIENT_ATTENTION", shape.causal),
                                           [here]),
    }
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

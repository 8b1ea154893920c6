"""`kforge bench quant`: the low-precision kernels against the best PyTorch path on the same numbers.

Each shape is a problem in `problems/quant/` (or `problems/level1/nvfp4_batched_gemv.py`)
whose reference is that path: torch._scaled_mm rowwise and tensorwise and bf16 cuBLAS for
the FP8 GEMM (the problem's BASELINE constant picks one), cuBLAS's bf16 GEMV for W4A16,
bf16 cuBLAS for the NVFP4 GEMM, PyTorch's dequantize-and-bmm for the NVFP4 batched GEMV
(Hopper has no FP4 path; that kernel is judged by bandwidth). The inputs are drawn in the
quantized format with power-of-two scales, so baseline and kernel multiply the same
numbers and gate 1 holds them to bf16 tolerance.

Rows come from the records: harness time (max of device and host per call) for the
speedups, device time for TFLOP/s, GB/s of the problem's minimum bytes (the packed
operands) and the % of the roof (fp8 or bf16 matmul ceiling, or copy bandwidth).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from kforge.bench import BenchJob, OursRates, size_constants

PROBLEMS = Path(__file__).parent.parent / "problems"
KERNELS = Path(__file__).parent.parent / "kernels" / "quant"
FP8_BASELINES = {0: "_scaled_mm rowwise", 1: "_scaled_mm tensorwise", 2: "bf16 cuBLAS"}


# --- our kernels, shaped as the problems' forwards ---------------------------------------------

class OursFp8Gemm:
    """fp8_gemm with the scaling named ("block": the CUDA kernel, fp8_block_gemm.cu; "block-triton":
    the Triton one); the problem's scales come as rows [M, 1] and [1, N]."""

    def __init__(self, scaling: str):
        self.scaling = scaling

    def __call__(self, a, b, a_scale, b_scale, a_bf16, b_bf16):
        from kforge.kernels.quant.fp8_gemm import SCALE_BLOCK, fp8_gemm

        if self.scaling == "tensor":
            return fp8_gemm(a, b, a_scale[0, 0], b_scale[0, 0], "tensor")
        if self.scaling == "row":
            return fp8_gemm(a, b, a_scale, b_scale.t(), "row")
        blocks = -(-a.shape[1] // SCALE_BLOCK)  # 1 x 128 blocks of A, 128 x 128 of B, as DeepGEMM's
        a_scale, b_scale = a_scale.expand(-1, blocks), b_scale[:, ::SCALE_BLOCK].t().expand(-1, blocks)
        return fp8_gemm(a, b, a_scale, b_scale, "block", prefer_cuda=self.scaling == "block")


class OursW4a16:
    def __call__(self, x, qweight, scales, w_bf16):
        from kforge.kernels.quant.w4a16 import w4a16_matmul

        return w4a16_matmul(x, qweight, scales)


class OursNvfp4Gemm:
    def __call__(self, a, a_scales, a_gs, b, b_scales, b_gs, a_bf16, b_bf16):
        from kforge.kernels.quant.nvfp4_gemm import nvfp4_gemm

        return nvfp4_gemm(a, a_scales, a_gs, b, b_scales, b_gs)


class OursNvfp4Gemv:
    def __call__(self, a, a_scales, a_gs, b, b_scales, b_gs):
        from kforge.kernels.quant.nvfp4_gemv import nvfp4_batched_gemv

        return nvfp4_batched_gemv(a, a_scales, a_gs, b, b_scales, b_gs)


@dataclass(frozen=True)
class QuantShape:
    group: str  # fp8, w4a16, nvfp4-gemv, nvfp4-gemm
    label: str
    problem: Path
    sizes: dict
    methods: dict[str, Callable[[], Callable]]  # our candidates on this shape
    kernels: tuple[str, ...]  # their source files under kernels/quant (their bytes identify them)


def quant_shapes() -> list[QuantShape]:
    fp8 = PROBLEMS / "quant" / "fp8_gemm_e4m3.py"
    shapes = [QuantShape("fp8", f"fp8 GEMM 4096x7168x16384 vs {name}", fp8, {"BASELINE": baseline},
                         {"ours block": lambda: OursFp8Gemm("block"),
                          "ours block Triton": lambda: OursFp8Gemm("block-triton"),
                          "ours row": lambda: OursFp8Gemm("row"),
                          "ours tensor": lambda: OursFp8Gemm("tensor")},
                         ("fp8_gemm.py", "fp8_block_gemm.py", "fp8_block_gemm.cu"))
              for baseline, name in FP8_BASELINES.items()]
    for b, n, k in ((1, 4096, 4096), (1, 14336, 4096), (1, 4096, 14336), (1, 28672, 4096), (2, 14336, 4096),
                    (8, 14336, 4096), (16, 14336, 4096), (32, 4096, 4096)):
        shapes.append(QuantShape("w4a16", f"W4A16 B={b} N={n} K={k} vs bf16 cuBLAS",
                                 PROBLEMS / "quant" / "w4a16_gemv.py", {"B": b, "N": n, "K": k}, {"ours": OursW4a16},
                                 ("w4a16.py", "w4a16_gemv.cu", "w4a16_gemv_bulk.cu", "w4a16_mma.cu")))
    for m, k, l in ((7168, 16384, 1), (4096, 7168, 8), (7168, 2048, 4)):
        shapes.append(QuantShape("nvfp4-gemv", f"NVFP4 GEMV M={m} K={k} L={l} vs dequant+bmm",
                                 PROBLEMS / "level1" / "nvfp4_batched_gemv.py", {"M": m, "K": k, "L": l},
                                 {"ours": OursNvfp4Gemv}, ("nvfp4_gemv.py",)))
    shapes.append(QuantShape("nvfp4-gemm", "NVFP4 GEMM 4096x7168x16384 vs bf16 cuBLAS",
                             PROBLEMS / "quant" / "nvfp4_gemm.py", {}, {"ours": OursNvfp4Gemm}, ("nvfp4_gemm.py",)))
    return shapes


def quant_groups(shapes: Sequence[QuantShape]) -> dict[str, list[QuantShape]]:
    groups: dict[str, list[QuantShape]] = {}
    for s in shapes:
        groups.setdefault(s.group, []).append(s)
    return groups


def quant_jobs(shapes: Sequence[QuantShape]) -> Iterator[BenchJob]:
    from kforge.harness.problem import load_problem
    from kforge.ladder import source_candidate

    for shape in shapes:
        problem = load_problem(shape.problem, "full", shape.sizes)
        for method, make in shape.methods.items():
            sources = [KERNELS / name for name in shape.kernels] + [Path(__file__)]
            yield BenchJob(f"{shape.label}: {method}", problem, source_candidate(method, make, sources))


@dataclass(frozen=True)
class QuantRow(OursRates):
    shape: str
    method: str
    status: str
    speedup: float | None  # baseline's harness time / ours, same evaluation
    ours_device_ms: float | None
    baseline_device_ms: float | None
    flops: float | None
    bytes: int | None
    bound: str | None  # memory or compute: which ceiling is the roof
    pct_of_roof: float | None  # ours, device time, against that ceiling


def quant_label(record: dict) -> str:
    sizes = size_constants(record)
    for shape in quant_shapes():
        if shape.problem.stem == record["problem"]["name"] and all(sizes.get(k) == v for k, v in shape.sizes.items()):
            return shape.label
    return f"{record['problem']['name']} {record['problem']['size']}"


def quant_rows(records: Sequence[dict]) -> list[QuantRow]:
    """One row per (shape, method), the latest record of each, in the order first seen."""
    latest: dict[tuple[str, str], dict] = {}
    for r in records:
        latest[(quant_label(r), r["candidate"]["name"])] = r
    rows = []
    for (shape, method), r in latest.items():
        gate2, roofline = r.get("gate2") or {}, r.get("roofline") or {}
        profile = gate2.get("profile") or {}
        ours = (profile.get("candidate") or {}).get("median_device_ms")
        base = (profile.get("reference") or {}).get("median_device_ms")
        bound = roofline.get("bound")
        pct = None
        if ours:
            ceilings = roofline.get("ceilings") or {}
            if bound == "compute" and roofline.get("flops") and roofline.get("compute_tflops"):
                pct = 100 * roofline["flops"] / ours / 1e9 / roofline["compute_tflops"]
            elif roofline.get("bytes") and ceilings.get("copy_gbps"):
                pct = 100 * roofline["bytes"] / ours / 1e6 / ceilings["copy_gbps"]
        rows.append(QuantRow(shape, method, r["status"], gate2.get("speedup"), ours, base, roofline.get("flops"),
                             roofline.get("bytes"), bound, pct))
    return rows

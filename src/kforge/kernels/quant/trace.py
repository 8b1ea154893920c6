"""Why the accumulator must be wide, and what each format costs: two small CPU experiments.

`accumulate_trace`: a dot product of 64 FP8 E4M3 pairs near 1.0, each product exact (as a
tensor core computes it), summed into an FP8, an FP16 and an FP32 accumulator that is
rounded (RNE) after every addition. E4M3 keeps 3 mantissa bits: between 16 and 32 its
values are 2 apart, so adding ~1 moves the sum only when the term tips it past a midpoint,
and from 32 on they are 4 apart, so 32 + ~1 rounds back to 32: the sum freezes near 32
while the exact one reaches ~64 (an error of ~50%). FP16's step at 32..64 is 1/32 and
FP32's 2^-18: both track the exact sum. Hence DeepGEMM multiplies in FP8 but accumulates
in FP32. (Every sum of an accumulator and a term is exact in fp32, 15 significant bits at
most, so each step rounds once, straight to the accumulator's format.)

`format_error_table`: bits per value (codes and scales, from the real tensors) and the
relative error ||dequant(quant(x)) - x||_F / ||x||_F of each format against the bf16 tensor,
on Gaussian weights, Laplace (heavy-tailed) weights, and activations whose 1% outlier
channels are 50x larger, the case that breaks coarse scales: a group or row that holds an
outlier gets its scale from it and rounds its ordinary values to 0 or to few levels.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kforge.kernels.quant import formats

FP8 = torch.float8_e4m3fn


class AccumulateStep(NamedTuple):
    step: int
    exact: float
    fp8: float
    fp16: float
    fp32: float


ACCUMULATORS = (("FP8 E4M3", "fp8", 3), ("FP16", "fp16", 10), ("FP32", "fp32", 23))  # (label, field, mantissa bits)


def accumulate_trace(n_terms: int = 64, seed: int = 20) -> list[AccumulateStep]:
    """(step, exact sum, fp8 e4m3, fp16 and fp32 accumulators) after each of n_terms products
    a_i * b_i of e4m3 values drawn near 1.0 (seeded, so the same every run). The default seed
    gives the course's table: FP8 ends at 32.0 against an exact 63.9 (49.9% off), FP16 63.9."""
    if n_terms < 1:
        raise ValueError(f"n_terms must be at least 1, got {n_terms}")
    generator = torch.Generator().manual_seed(seed)
    a, b = (formats.to_fp8(1.0 + 0.08 * torch.randn(n_terms, generator=generator)).float() for _ in range(2))
    terms = (a * b).tolist()  # exact: 4-bit significands, an 8-bit product
    exact, acc8, acc16, acc32 = 0.0, torch.zeros(()), torch.zeros(()), torch.zeros(())
    rows = []
    for step, term in enumerate(terms, start=1):
        exact += term
        acc8 = formats.to_fp8(acc8 + term).float()
        acc16 = (acc16 + term).to(torch.float16).float()
        acc32 = acc32 + term
        rows.append(AccumulateStep(step, exact, acc8.item(), acc16.item(), acc32.item()))
    return rows


def accumulate_summary(rows: list[AccumulateStep]) -> list[tuple[str, int, float, float]]:
    """(accumulator, mantissa bits, final sum, relative error vs the exact sum) for each accumulator."""
    last = rows[-1]
    return [(label, bits, getattr(last, field), abs(getattr(last, field) - last.exact) / abs(last.exact))
            for label, field, bits in ACCUMULATORS]


def render_accumulate_trace(rows: list[AccumulateStep], every: int = 4):
    """A rich Table of every `every`-th step (and the last), with the final errors as its caption."""
    from rich.table import Table

    table = Table(title=f"Accumulating {len(rows)} FP8 products near 1.0", title_justify="left")
    for header in ("step", "exact", "FP8 E4M3 acc", "FP16 acc", "FP32 acc"):
        table.add_column(header, justify="right")
    for row in rows:
        if row.step % every == 0 or row.step == len(rows) or row.step == 1:
            fp8 = f"{row.fp8:.3f}"
            if abs(row.fp8 - row.exact) > 0.1 * row.exact:  # swamped: more than 10% off
                fp8 = f"[bold red]{fp8}[/]"
            table.add_row(str(row.step), f"{row.exact:.3f}", fp8, f"{row.fp16:.3f}", f"{row.fp32:.3f}")
    table.caption = "\n".join(f"{label} ({bits} mantissa bits): final {final:.1f}, error {error:.1%}"
                               for label, bits, final, error in accumulate_summary(rows))
    return table


# -- the error table ----------------------------------------------------------------------------

class FormatError(NamedTuple):
    format: str
    bits_per_value: float
    gaussian: float
    laplace: float
    outlier_activations: float


def round_trip(name: str, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(dequant(quant(x)) in fp32, bytes stored: codes and every scale)."""
    if name == "FP8 E4M3 per tensor":
        stored = formats.quantize_fp8_tensorwise(x)
        return formats.dequantize_fp8(*stored), sum(t.nbytes for t in stored)
    if name.startswith("FP8"):
        dtype = FP8 if "E4M3" in name else torch.float8_e5m2
        block = (1, 128) if "1x128" in name else None
        stored = formats.quantize_fp8_blockwise(x, block, dtype) if block else formats.quantize_fp8_rowwise(x, dtype)
        return formats.dequantize_fp8(*stored, block=block), sum(t.nbytes for t in stored)
    if name == "INT4 g128":
        stored = formats.quantize_int4(x, 128)
        return formats.dequantize_int4(*stored, 128).float(), sum(t.nbytes for t in stored)
    if name == "MXFP4":
        stored = formats.quantize_mxfp4(x)
        return formats.dequantize_mxfp4(*stored), sum(t.nbytes for t in stored)
    if name == "NVFP4":
        stored = formats.quantize_nvfp4(x)
        return formats.dequantize_nvfp4(*stored), sum(t.nbytes for t in stored)
    raise ValueError(f"unknown format {name!r}")


FORMATS = ("FP8 E4M3 per tensor", "FP8 E4M3 per row", "FP8 E4M3 1x128", "FP8 E5M2 per row",
           "INT4 g128", "MXFP4", "NVFP4")


def sample_tensors(seed: int, rows: int, cols: int) -> dict[str, torch.Tensor]:
    """bf16 [rows, cols]: Gaussian weights (std 0.02), Laplace weights (same std), activations
    N(0, 1) with 1% of the channels (columns) 50x larger."""
    generator = torch.Generator().manual_seed(seed)
    gaussian = 0.02 * torch.randn(rows, cols, generator=generator)
    uniform = torch.rand(rows, cols, generator=generator).clamp_min(1e-7)
    signs = torch.where(torch.rand(rows, cols, generator=generator) < 0.5, -1.0, 1.0)
    laplace = signs * (-torch.log(uniform)) * (0.02 / 2 ** 0.5)  # Laplace with std 0.02
    activations = torch.randn(rows, cols, generator=generator)
    outliers = torch.randperm(cols, generator=generator)[:max(1, cols // 100)]
    activations[:, outliers] *= 50.0
    return {name: t.to(torch.bfloat16) for name, t in
            (("gaussian", gaussian), ("laplace", laplace), ("outlier_activations", activations))}


def format_error_table(seed: int = 0, rows: int = 128, cols: int = 1024) -> list[FormatError]:
    """(format, bits per value incl. scales, relative error vs bf16 on the three tensors) per format."""
    if cols % 128:
        raise ValueError(f"cols must be a multiple of 128 (INT4 groups, FP8 1x128 blocks), got {cols}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 131k values a tensor: one thread beats waking a pool (by 6x on a busy machine)
    try:
        tensors = sample_tensors(seed, rows, cols)
        table = []
        for name in FORMATS:
            errors, stored = {}, 0
            for kind, x in tensors.items():
                restored, stored = round_trip(name, x)
                reference = x.float()
                errors[kind] = ((restored - reference).norm() / reference.norm()).item()
            table.append(FormatError(name, 8 * stored / (rows * cols), **errors))
    finally:
        torch.set_num_threads(threads)
    return table


def render_format_error_table(rows: list[FormatError]):
    """A rich Table: format, bits per value, relative error on each tensor."""
    from rich.table import Table

    table = Table(title="Quantized formats: bits per value and relative error vs bf16 (||x_hat - x|| / ||x||)",
                  title_justify="left")
    for header in ("format", "bits/value", "Gaussian weights", "Laplace weights", "activations, 1% outliers x50"):
        table.add_column(header, justify="left" if header == "format" else "right")
    for row in rows:
        table.add_row(row.format, f"{row.bits_per_value:.3f}", f"{row.gaussian:.2%}", f"{row.laplace:.2%}",
                      f"{row.outlier_activations:.2%}")
    return table

"""`kforge trace moe`: route a batch of router logits and show what the grouped GEMM gets.

Per expert: the assignments routed to it, those kept within the capacity and those
dropped, the `align`-row tiles its run takes, the padding rows in them and the tiles'
utilization (kept rows over tile rows); then the totals. The tensor cores run every row
of every tile, so utilization is the share of their work that is real: skewed routing
leaves tiles half empty and one expert the straggler; a capacity bounds the straggler and
drops the overflow.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kforge.kernels.moe.dispatch import ExpertLoad, expert_loads
from kforge.kernels.moe.gating import Gating
from kforge.kernels.moe.routing import expert_capacity


@dataclass(frozen=True)
class MoeTrace:
    tokens: int
    experts: int
    gate: Gating
    align: int
    capacity_factor: float | None
    capacity: int | None
    loads: list[ExpertLoad]

    @property
    def total(self) -> ExpertLoad:
        """The column sums; utilization over all tiles."""
        sums = [sum(getattr(load, f) for load in self.loads) for f in ("routed", "kept", "dropped", "tiles", "padding")]
        routed, kept, dropped, tiles, padding = sums
        return ExpertLoad(-1, routed, kept, dropped, tiles, padding, kept / (tiles * self.align) if tiles else None)


def load_logits(path: Path) -> torch.Tensor:
    """A (tokens, experts) floating-point tensor from a .pt (torch.save of a tensor) or .npy file."""
    if not path.is_file():
        raise ValueError(f"no logits file: {path}")
    if path.suffix == ".pt":
        try:
            logits = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any unreadable file is one line for the user
            raise ValueError(f"cannot read {path} with torch.load: {type(exc).__name__}: {exc}") from None
    elif path.suffix == ".npy":
        import numpy as np

        try:
            logits = torch.from_numpy(np.load(path, allow_pickle=False))
        except Exception as exc:  # noqa: BLE001
            raise ValueError(f"cannot read {path} with numpy.load: {type(exc).__name__}: {exc}") from None
    else:
        raise ValueError(f"logits must be a .pt or .npy file, got {path.name}")
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        what = f"{tuple(logits.shape)} {logits.dtype}" if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"{path} must hold one floating-point (tokens, experts) tensor, got {what}")
    return logits


def random_logits(tokens: int, experts: int, seed: int) -> torch.Tensor:
    """N(0, 1) logits: a router at initialization, roughly balanced."""
    if tokens < 1 or experts < 1:
        raise ValueError(f"--random needs tokens >= 1 and experts >= 1, got {tokens},{experts}")
    return torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed))


def trace_moe(logits: torch.Tensor, gate: Gating, align: int, capacity_factor: float | None = None) -> MoeTrace:
    """Route `logits` with `gate`, dispatch with runs padded to `align` rows and, given a
    capacity factor, capacity = ceil(factor * tokens * top_k / experts)."""
    from kforge.ops.moe import moe_dispatch, moe_gate

    tokens, experts = logits.shape
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    capacity = None if capacity_factor is None else expert_capacity(tokens, gate.top_k, experts, capacity_factor)
    ids, weights = moe_gate(logits, gate.top_k, scoring=gate.scoring, n_group=gate.n_group, topk_group=gate.topk_group)
    layout = moe_dispatch(ids, weights, experts, align, capacity=capacity)
    return MoeTrace(tokens, experts, gate, align, capacity_factor, capacity, expert_loads(layout))


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def render_moe_trace(trace: MoeTrace):
    """A rich Table: one row an expert, then the totals; the caption says the useful share."""
    from rich.table import Table

    gate = trace.gate
    router = f"{gate.scoring} gating"
    if gate.grouped:
        router += f", top-{gate.topk_group} of {gate.n_group} groups"
    limit = (f"capacity {trace.capacity} (factor {trace.capacity_factor:g})" if trace.capacity is not None
             else "no capacity limit")
    table = Table(title=f"{trace.tokens} tokens to {trace.experts} experts, top-{gate.top_k}, {router}; tiles of "
                        f"{trace.align} rows, {limit}", title_justify="left")
    for header in ("expert", "routed", "kept", "dropped", "tiles", "padding rows", "utilization"):
        table.add_column(header, justify="right")
    for load in trace.loads:
        dropped = f"[bold red]{load.dropped}[/]" if load.dropped else "0"
        table.add_row(f"E{load.expert}", str(load.routed), str(load.kept), dropped, str(load.tiles),
                      str(load.padding), _percent(load.utilization))
    total = trace.total
    table.add_section()
    table.add_row("total", str(total.routed), str(total.kept), str(total.dropped), str(total.tiles), str(total.padding),
                  _percent(total.utilization), style="bold")
    busiest = max(trace.loads, key=lambda load: load.kept)
    table.caption = (f"Tensor cores run {total.tiles * trace.align} row slots to do {total.kept} real ones: "
                     f"{_percent(total.utilization)} useful. Busiest expert E{busiest.expert} holds {busiest.kept} "
                     f"tokens (mean {total.kept / trace.experts:.1f}); {total.dropped} of {total.routed} assignments "
                     f"dropped.")
    return table

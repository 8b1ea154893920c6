"""The online softmax on a row of scores, one tile at a time, every intermediate kept.

softmax(s)_i = exp(s_i - m) / l with m = max(s) and l = sum_j exp(s_j - m). FlashAttention
never holds the whole row: after each tile it knows only the max so far, m, and the
denominator so far, l, measured against that m. When a tile brings a larger max, every
term already summed was exp(s_j - m_old) and should be exp(s_j - m_new): multiplying by
exp(m_old - m_new) fixes them all at once, without seeing them again:

    m_new = max(m_old, max(tile))
    l_new = l_old * exp(m_old - m_new) + sum_{j in tile} exp(s_j - m_new)

With a value v_j per score (attention's V row, here one number), the unnormalised output
acc = sum_j exp(s_j - m) v_j is rescaled the same way, and acc / l is the softmax-weighted
average of the values seen so far. After the last tile, m, l and acc / l are exactly what
the whole row at once gives (up to rounding).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class TileStep:
    """The state after one tile. `rescale` is exp(m_old - m_new): 0 for the first tile
    (there was nothing to rescale), 1 when the tile did not raise the max."""

    tile: tuple[float, ...]
    tile_max: float
    m_old: float  # -inf before the first tile
    m_new: float
    rescale: float
    tile_sum: float  # sum of exp(s - m_new) over this tile
    l_old: float
    l_new: float
    acc: float | None = None  # sum of exp(s - m_new) * v over the tiles so far
    output: float | None = None  # acc / l_new: the running attention output


@dataclass(frozen=True)
class OnlineSoftmaxTrace:
    steps: tuple[TileStep, ...]
    online: tuple[float, ...]  # exp(s - m) / l with the final m and l
    direct: tuple[float, ...]  # the softmax of the whole row at once
    output: float | None  # the online running output after the last tile
    direct_output: float | None  # sum softmax(s) * v computed at once

    @property
    def max_error(self) -> float:
        """Largest |online - direct| over the probabilities (and the output, if any)."""
        errors = [abs(a - b) for a, b in zip(self.online, self.direct)]
        if self.output is not None:
            errors.append(abs(self.output - self.direct_output))
        return max(errors)

    def agrees(self, tolerance: float = 1e-12) -> bool:
        return self.max_error <= tolerance * max(1.0, *(abs(x) for x in self.direct))


def softmax(scores: Sequence[float]) -> list[float]:
    top = max(scores)
    exps = [math.exp(s - top) for s in scores]
    total = sum(exps)
    return [e / total for e in exps]


def trace_online_softmax(tiles: Sequence[Sequence[float]], values: Sequence[float] | None = None
                         ) -> OnlineSoftmaxTrace:
    """Run the online softmax over `tiles` (the row cut into pieces, in order), with one
    value per score if `values` is given (same count as all scores together)."""
    tiles = [tuple(float(s) for s in tile) for tile in tiles]
    if not tiles or any(not tile for tile in tiles):
        raise ValueError("give at least one tile, and no empty tile")
    scores = [s for tile in tiles for s in tile]
    if any(not math.isfinite(s) for s in scores):
        raise ValueError("scores must be finite numbers")
    if values is not None:
        values = [float(v) for v in values]
        if len(values) != len(scores):
            raise ValueError(f"{len(values)} values for {len(scores)} scores: give one value per score")

    m, l, acc = float("-inf"), 0.0, 0.0
    steps, seen = [], 0
    for tile in tiles:
        tile_max = max(tile)
        m_new = max(m, tile_max)
        rescale = math.exp(m - m_new)  # exp(-inf) = 0 on the first tile
        weights = [math.exp(s - m_new) for s in tile]
        l_new = l * rescale + sum(weights)
        step = dict(tile=tile, tile_max=tile_max, m_old=m, m_new=m_new, rescale=rescale, tile_sum=sum(weights),
                    l_old=l, l_new=l_new)
        if values is not None:
            acc = acc * rescale + sum(w * v for w, v in zip(weights, values[seen:seen + len(tile)]))
            step.update(acc=acc, output=acc / l_new)
        steps.append(TileStep(**step))
        m, l, seen = m_new, l_new, seen + len(tile)

    direct = softmax(scores)
    return OnlineSoftmaxTrace(
        steps=tuple(steps),
        online=tuple(math.exp(s - m) / l for s in scores),
        direct=tuple(direct),
        output=acc / l if values is not None else None,
        direct_output=sum(p * v for p, v in zip(direct, values)) if values is not None else None,
    )

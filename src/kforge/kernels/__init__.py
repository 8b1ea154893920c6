"""Kernel families: one folder each, one kernel or ladder rung per file (CUDA sources beside their Python launcher)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar


@dataclass(frozen=True)
class RungSource:
    """A ladder rung's source file, `NN_name.cu` in its family's folder (`directory`)."""

    directory: ClassVar[Path]
    number: int
    name: str  # the file's stem without its number: "naive", "tma_wgmma", ...

    @property
    def source(self) -> Path:
        return self.directory / f"{self.number:02d}_{self.name}.cu"

    @property
    def label(self) -> str:
        return f"{self.number:02d}_{self.name}"

    def parameters(self, defines: Mapping[str, int] | None = None) -> dict[str, int]:
        """The tile parameters the kernel compiles with: its defaults, then `defines`."""
        from kforge.runtime.cuda import integer_defines

        return {**integer_defines(self.source), **(defines or {})}

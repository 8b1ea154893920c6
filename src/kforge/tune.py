"""`kforge tune gemm`: which bf16 GEMM kernel `kforge.ops.matmul` runs for a shape, decided by
timing the candidates on this GPU rather than by rules written for another.

For each shape the harness judges every candidate (CANDIDATES: rung 4 as it is and its split-K,
128 x 192 and stream-K variants, rung 5's clusters, rung 6's ping-pong) against cuBLAS, both
gates, the way `kforge bench gemm` does. The table keeps, per shape and B layout, the fastest
candidate whose verdict is `faster` than cuBLAS and whose device time is shorter than cuBLAS's
too, or "cublas" when none is: there the op calls cuBLAS itself. A tie is not a win: "correct
AND faster" decides here too. The device time matters because a small product's call is
bounded by its host: on the H200 the 128 x 6144 x 4096 call took ~110 us on either side's host,
so the judged ratio (1.08x "faster") was the Python around the calls, while the devices took
44.3 us against cuBLAS's 18.2 (tune-gemm.jsonl); a dispatch table serves CUDA graphs too,
where only the device time is left.

    kforge tune gemm                                   # on the GPU: time, record, write the table
    kforge tune gemm --from-records tune-gemm.jsonl    # anywhere: the table from records

The table (JSON) goes to $KFORGE_CACHE_DIR/dispatch/gemm-bf16-<device slug>.json, where the op
finds it; a table shipped with kforge for a device (src/kforge/ops/tables/) is read when the
user has none. Lookup is by exact shape; a shape no table holds gets cuBLAS when it has at most
SKINNY_ROWS rows (decode batches: of the 41 such shapes tuned on the H200, 16 to 128 rows,
cuBLAS's device time was the shorter at 38 and at most 3% longer at the other three; of the 16
in the H100's `kforge bench gemm` records, the shorter at 15 and 2.4% longer at one), else
`best_kernel`'s rules (ops/matmul.py: tile counts against SMs, measured on the H100), the safe
default on any Hopper GPU. The H200's table ships (src/kforge/ops/tables/).
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kforge.device import cache_dir, name_slug
from kforge.errors import KforgeError

SCHEMA = 1
SKINNY_ROWS = 128  # at most this many rows and no table entry: cuBLAS (the module docstring)
FAMILY = "gemm-bf16"
SHIPPED = Path(__file__).parent / "ops" / "tables"
CUBLAS = "cublas"
_LABEL = re.compile(r"^rung (?P<number>\d+)(?: (?P<defines>(?:[A-Z_0-9]+=-?\d+ ?)+))?$")


def candidates() -> list[tuple[int, dict[str, int]]]:
    """(rung, defines) of every kernel a table may choose."""
    from kforge.kernels.gemm_bf16 import NARROW_TILE, SPLIT_K_VARIANT, STREAM_K_VARIANT

    return [(4, {}), (4, dict(SPLIT_K_VARIANT)), (4, dict(NARROW_TILE)), (4, dict(STREAM_K_VARIANT)), (5, {}), (6, {})]


def label(number: int, defines: Mapping[str, int]) -> str:
    """"rung 4" or "rung 4 BN=192 ...": the candidate's name in its records, read back by `parse_label`."""
    return f"rung {number}" + "".join(f" {k}={v}" for k, v in sorted(defines.items()))


def parse_label(text: str) -> tuple[int, dict[str, int]] | None:
    match = _LABEL.match(text)
    if match is None:
        return None
    defines = dict(part.split("=") for part in (match["defines"] or "").split())
    return int(match["number"]), {k: int(v) for k, v in defines.items()}


@dataclass(frozen=True)
class Entry:
    m: int
    n: int
    k: int
    b_layout: str  # "kn" (C = A @ B) or "nk" (y = x W^T)
    choice: str  # a candidate's label, or "cublas"
    speedup: float | None  # cuBLAS time / the choice's, the same evaluation (None for cuBLAS)
    low: float | None  # the speedup's 95% interval
    high: float | None
    timed: dict[str, float | None] = field(default_factory=dict)  # every candidate's speedup, or None if not correct

    @property
    def kernel(self) -> tuple[int, dict[str, int]] | None:
        """(rung, defines) to run, or None: cuBLAS."""
        return None if self.choice == CUBLAS else parse_label(self.choice)


@dataclass
class GemmTable:
    device: str
    entries: list[Entry]
    created: str = ""
    command: str | None = None
    versions: dict = field(default_factory=dict)

    def lookup(self, m: int, n: int, k: int, b_layout: str) -> Entry | None:
        return next((e for e in self.entries if (e.m, e.n, e.k, e.b_layout) == (m, n, k, b_layout)), None)

    def to_dict(self) -> dict:
        return {"schema": SCHEMA, "family": FAMILY, "device": self.device, "created": self.created,
                "command": self.command, "versions": self.versions, "entries": [vars(e) for e in self.entries]}

    @classmethod
    def from_dict(cls, data: dict, where: str) -> GemmTable:
        try:
            if data.get("schema") != SCHEMA or data.get("family") != FAMILY:
                raise ValueError(f"schema {data.get('schema')!r} of {data.get('family')!r}, not {SCHEMA} of {FAMILY}")
            entries = [Entry(**e) for e in data["entries"]]
            for e in entries:
                if e.choice != CUBLAS and parse_label(e.choice) is None:
                    raise ValueError(f"unknown choice {e.choice!r}")
            return cls(data["device"], entries, data.get("created", ""), data.get("command"), data.get("versions", {}))
        except (KeyError, TypeError, ValueError) as exc:
            raise KforgeError(f"{where} is not a kforge GEMM dispatch table: {exc}",
                              "Write it again with `kforge tune gemm`, or delete it to use the built-in rules.") from None

    def save(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        tmp.replace(path)
        return path


def user_table_path(device_name: str) -> Path:
    return cache_dir() / "dispatch" / f"{FAMILY}-{name_slug(device_name)}.json"


@functools.cache
def load_table(device_name: str) -> GemmTable | None:
    """The user's table for this device, else the one shipped for it, else None (cached: a
    process reads it once; `kforge tune` clears the cache when it writes one)."""
    for path in (user_table_path(device_name), SHIPPED / f"{FAMILY}-{name_slug(device_name)}.json"):
        if path.is_file():
            try:
                data = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as exc:
                raise KforgeError(f"{path} is not readable JSON: {exc}",
                                  "Write it again with `kforge tune gemm`, or delete it.") from None
            return GemmTable.from_dict(data, str(path))
    return None


def choose(m: int, n: int, k: int, b_layout: str, device_name: str, sms: int) -> tuple[int, dict[str, int]] | None:
    """(rung, defines) for this product on this GPU, or None where the table says cuBLAS is faster."""
    from kforge.ops.matmul import best_kernel

    table = load_table(device_name)
    entry = table.lookup(m, n, k, b_layout) if table is not None else None
    if entry is not None:
        return entry.kernel
    if m <= SKINNY_ROWS:
        return None
    return best_kernel(m, n, k, sms)


def _device_faster(record: dict) -> bool:
    """Whether the candidate's median device time beat the reference's in the record's profile
    (a record without one is judged by its verdict alone)."""
    profile = (record.get("gate2") or {}).get("profile") or {}
    candidate, reference = profile.get("candidate"), profile.get("reference")
    if not candidate or not reference:
        return True
    return candidate["median_device_ms"] < reference["median_device_ms"]


def table_from_records(records: Iterable[dict], device: str, command: str | None = None) -> GemmTable:
    """The table of this device's tune records: per (shape, layout), the latest record of each
    candidate; the fastest `passed` one, else cuBLAS. Records of other devices, problems or
    candidates are left out."""
    from kforge.bench import size_constants

    latest: dict[tuple, dict[str, dict]] = {}
    versions = {}
    for record in records:
        name = record["problem"]["name"]
        if record["device"]["name"] != device or name not in ("matmul_bf16", "linear_bf16"):
            continue
        if parse_label(record["candidate"]["name"]) is None:
            continue
        size = size_constants(record)
        shape = (size["M"], size["N"], size["K"], "kn" if name == "matmul_bf16" else "nk")
        latest.setdefault(shape, {})[record["candidate"]["name"]] = record
        versions = record.get("versions", versions)
    entries = []
    for (m, n, k, layout), by_label in latest.items():
        timed = {name: (r["gate2"] or {}).get("speedup") if r["status"] in ("passed", "slower", "tie") else None
                 for name, r in by_label.items()}
        winners = [r for r in by_label.values() if r["status"] == "passed" and _device_faster(r)]
        if winners:
            best = max(winners, key=lambda r: r["gate2"]["speedup"])
            verdict = best["gate2"].get("verdict") or {}
            entries.append(Entry(m, n, k, layout, best["candidate"]["name"], best["gate2"]["speedup"],
                                 verdict.get("low"), verdict.get("high"), timed))
        else:
            entries.append(Entry(m, n, k, layout, CUBLAS, None, None, None, timed))
    created = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    return GemmTable(device, entries, created, command, versions)


def tune_shapes(which: str) -> list:
    """`kforge bench gemm`'s shapes (squares and the Llama-3 projections), or "M,N,K[:nk]" items
    separated by semicolons."""
    from kforge.bench.gemm import GemmShape, gemm_shapes

    if which == "bench":
        return gemm_shapes()
    shapes = []
    for item in which.split(";"):
        spec, _, layout = item.strip().partition(":")
        try:
            m, n, k = (int(x) for x in spec.split(","))
        except ValueError:
            raise KforgeError(f"--shapes: {item!r} is not M,N,K[:kn|nk]", "e.g. --shapes '4096,4096,4096;16,6144,4096:nk'") \
                from None
        if min(m, n, k) < 1 or layout not in ("", "kn", "nk"):
            raise KforgeError(f"--shapes: {item!r} needs positive sizes and a layout of kn or nk")
        shapes.append(GemmShape(f"{m}x{n}x{k}", m, n, k, layout or "kn"))
    return shapes


def tune_jobs(shapes: Sequence) -> list:
    """(problem, candidate) jobs: every candidate on every shape."""
    from kforge.bench import BenchJob
    from kforge.harness.problem import load_problem
    from kforge.kernels import gemm_bf16
    from kforge.ladder import source_candidate

    jobs = []
    for shape in shapes:
        problem = load_problem(shape.problem, "full", {"M": shape.m, "N": shape.n, "K": shape.k})
        for number, defines in candidates():
            step = gemm_bf16.rung(number)

            def make(step=step, defines=defines, layout=shape.b_layout):
                return gemm_bf16.RungModel(step, layout, defines)

            jobs.append(BenchJob(f"{shape.label} {label(number, defines)}", problem,
                                 source_candidate(label(number, defines), make, [step.source], defines)))
    return jobs

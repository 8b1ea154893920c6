"""The one record type: every command that measures produces an EvalRecord.

Records are appended to JSONL files, one line each, flushed and fsynced, so a file is
never rewritten and a crash loses at most the record being written. Tables and charts
are views of records.

Each line is sealed: the record's last key is "checksum": "sha256:<hex>", the SHA-256 of
the rest of the record in canonical JSON (`canonical_json`). Reading a store checks every
line, and a line that is torn, edited, foreign or not a record is reported, never skipped
in silence (`read_store`, `StoreWarning`). The checksum detects torn and edited lines; it
holds no secret key, so it cannot stop a forger who can write the file and recompute it.
What stops that is isolation: the candidate's worker cannot write outside its scratch
folder, and it is killed with all its descendants before the judge writes the record.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import os
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

SCHEMA_VERSION = 1

# Status -> exit status of `kforge eval`.
EXIT_STATUS = {
    "passed": 0,  # correct, and the speedup's 95% interval above the bar (verdict.py)
    "incorrect": 1,  # gate 1 failed, or a timed call's output was wrong (recheck)
    "slower": 1,  # gate 2 failed: the speedup's 95% interval lies below 1 - the noise floor
    "tie": 1,  # gate 2 failed: not measurably different (the interval reaches the noise floor)
    "faster_than_hardware": 1,  # gate 2 failed: under the physical floor, the timer was fooled
    "rejected": 1,  # a defence caught the candidate gaming the harness (see `defences`)
    "candidate_error": 2,  # the candidate could not be imported, built or run
    "oom": 2,  # the candidate, or the reference's worker holding the problem's data, ran out of memory
    "cuda_error": 2,  # the device reported an error while the candidate ran
    "crash": 2,  # the worker died under the candidate (a signal, os._exit)
    "timeout": 2,  # a stage ran past its time limit and the worker was killed
    "problem_error": 2,  # the problem could not be imported, built or run
}


@dataclass
class EvalRecord:
    status: str
    problem: dict
    candidate: dict
    device: dict  # DeviceInfo's fields, `host`, and from a suite's executor `gpus` (see gpus_used)
    versions: dict
    baseline: str = "eager"
    reason: str | None = None  # one line: why the status is not "passed"
    details: str | None = None  # a traceback, or the longer story
    seed: int | None = None
    gate1: dict | None = None  # CorrectnessReport
    gate2: dict | None = None  # speedup, timing stats of both sides
    roofline: dict | None = None  # flops, bytes, ceilings, floor, % of roof of both sides
    warnings: list[str] = field(default_factory=list)
    defences: list[str] = field(default_factory=list)  # which defences fired (defences.py)
    pair_key: str | None = None  # identifies the (problem, candidate, baseline, size, device) pair
    containment: dict | None = None  # what confined the candidate's worker (judge.py), None in-process
    command: str | None = None
    created: str = field(default_factory=lambda: _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    schema: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.status not in EXIT_STATUS:
            raise ValueError(f"unknown status {self.status!r}")

    @property
    def exit_status(self) -> int:
        return EXIT_STATUS[self.status]

    @property
    def speedup(self) -> float | None:
        return self.gate2.get("speedup") if self.gate2 else None

    def to_dict(self) -> dict:
        return _json_safe(asdict(self))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=False, allow_nan=False)


def gpus_used(record: dict) -> int:
    """How many GPUs a record's pair held: its device's `gpus`, written by the suite's executors
    (0 on the CPU; a problem's GPUS where it declares several). A record without it (one from
    before the field, or from `kforge eval`) held its device alone: one GPU, or none on the CPU.
    An optional key, so old records read as before and SCHEMA_VERSION stays."""
    device = record.get("device") or {}
    if isinstance(device.get("gpus"), int):
        return device["gpus"]
    return 1 if device.get("kind") == "cuda" else 0


def append_record(path: str | Path, record: EvalRecord | dict) -> Path:
    """Append one record (an evaluation's, or a benchmark's own dict) as a sealed line; fsync so
    it survives a crash right after: a run cut short keeps every record it finished."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = (sealed_line(record if isinstance(record, dict) else record.to_dict()) + "\n").encode("utf-8")
    with open(path, "a+b") as handle:
        end = handle.seek(0, os.SEEK_END)
        if end:
            handle.seek(end - 1)
            if handle.read(1) != b"\n":  # a torn line: keep it on its own line, not glued to this record
                data = b"\n" + data
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    return path


# --- Sealing: a checksum over the canonical JSON of each record ------------------------

CHECKSUM_KEY = "checksum"


def canonical_json(record: dict) -> str:
    """The bytes the checksum covers: sorted keys, no spaces, strict JSON (no NaN or inf)."""
    return json.dumps(record, sort_keys=True, separators=(",", ":"), allow_nan=False)


def checksum(record: dict) -> str:
    """The record's checksum: "sha256:<hex>" of its canonical JSON, its own checksum key left out."""
    body = {k: v for k, v in record.items() if k != CHECKSUM_KEY}
    return "sha256:" + hashlib.sha256(canonical_json(body).encode("utf-8")).hexdigest()


def seal(record: dict) -> dict:
    """A copy of the record, made strict JSON (NaN and inf become null), with its checksum as last key.

    A record that already carries a checksum is refused: resealing would launder an edit.
    """
    if CHECKSUM_KEY in record:
        raise ValueError("the record is already sealed")
    safe = _json_safe(record)
    return {**safe, CHECKSUM_KEY: checksum(safe)}


def verify(record: dict) -> bool:
    """Whether the record's checksum matches the rest of it (False where it has none)."""
    try:
        return isinstance(record.get(CHECKSUM_KEY), str) and record[CHECKSUM_KEY] == checksum(record)
    except (ValueError, TypeError, RecursionError):  # not strict JSON (a NaN, say): no checksum can match
        return False


def sealed_line(record: dict) -> str:
    """The line a store holds for a record (no newline): the sealed record as JSON, keys in order."""
    return json.dumps(seal(record), allow_nan=False)


# --- Reading: every line is a verified record or a reported rejection -------------------

TORN = "torn line (not JSON)"
NOT_AN_OBJECT = "not an object"
NO_CHECKSUM = "no checksum"
MISMATCH = "checksum mismatch (edited or forged)"


@dataclass(frozen=True)
class RejectedLine:
    number: int  # 1-based line number in the file
    reason: str  # TORN, NOT_AN_OBJECT, NO_CHECKSUM or MISMATCH


@dataclass
class StoreReading:
    path: Path
    records: list[dict]  # verified, in file order, without their checksum key
    rejected: list[RejectedLine]

    def notes(self) -> list[str]:
        """One line per rejected line, naming the file."""
        return [f"{self.path} line {r.number}: {r.reason}; left out" for r in self.rejected]


class StoreWarning(UserWarning):
    """read_records left lines out of a store; `reading` tells which and why."""

    def __init__(self, reading: StoreReading):
        self.reading = reading
        super().__init__(f"{reading.path}: {len(reading.rejected)} line(s) left out: "
                         + "; ".join(f"line {r.number}: {r.reason}" for r in reading.rejected))


def read_store(path: str | Path) -> StoreReading:
    """Every line of a JSONL store, checked: verified records, and the lines rejected and why.

    Blank lines hold nothing and are passed over. A line that is not UTF-8 counts as torn.
    """
    path = Path(path)
    records, rejected = [], []
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, 1):
            try:
                line = raw.decode("utf-8").strip()
                if not line:
                    continue
                record = json.loads(line)
            except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
                rejected.append(RejectedLine(number, TORN))
                continue
            if not isinstance(record, dict):
                rejected.append(RejectedLine(number, NOT_AN_OBJECT))
            elif CHECKSUM_KEY not in record:
                rejected.append(RejectedLine(number, NO_CHECKSUM))
            elif not verify(record):
                rejected.append(RejectedLine(number, MISMATCH))
            else:
                del record[CHECKSUM_KEY]
                records.append(record)
    return StoreReading(path, records, rejected)


def read_records(path: str | Path) -> list[dict]:
    """The verified records of a JSONL store, without their checksum key.

    Lines it rejects (see `read_store`) are left out with a StoreWarning naming the file and
    each line's number and reason, so no caller trusts or drops one unawares.
    """
    reading = read_store(path)
    if reading.rejected:
        warnings.warn(StoreWarning(reading), stacklevel=2)
    return reading.records


def _json_safe(value):
    """Strict JSON: infinite or NaN figures (an undefined rse, say) become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value

"""Rewrite the scheduling control bits of a compiled kernel's instructions, in its cubin.

Why: ptxas decides, per instruction, whether the warp scheduler may switch warps after it
(the yield hint) and which source operands are kept in the operand-reuse cache for the
next instruction. Neither is reachable from CUDA C++ or PTX. In the block-scaled FP8 GEMM's
promotion (`acc = p * factor + acc`, runs of 32 FFMAs on one factor) ptxas alternates them:
every other FFMA yields, and the one after it reads the factor from the register file again.
Measured on the H100 (scripts/fp8_block_variants.py; docs/worklogs/quant.md): yielding at every 8th FFMA of
a run and keeping the factor in the reuse cache between is 2.5-2.9% faster for the whole
GEMM than ptxas's schedule; never yielding is 6% slower than ptxas's, yielding at every FFMA
7%. DeepGEMM rewrites its FFMAs' yield and reuse bits too (the idea is theirs; this code and
the pattern are ours).

The encoding (Volta to Hopper, 128-bit instructions, read from cuobjdump's dumps and checked
here against every instruction of the kernel it edits): the control field is the high
64-bit word's bits 41-62,

    bits 41-44  stall cycles          bits 52-57  wait-barrier mask
    bit  45     0 = yield hint        bits 58-61  reuse flags, operand slots a, b, c, d
    bits 46-48  write barrier         (7 = none)
    bits 49-51  read barrier          (7 = none)

Only the yield and reuse bits are rewritten: they are hints, and a dependency is never
relaxed (stall counts and barriers stay as ptxas set them). The rules the rewrite keeps, as
ptxas does in every dump we read: an instruction that yields sets no reuse flag (another warp
may run in between), and a flag is set only where the very next instruction reads the same
register from the same slot, with no branch able to land between them and no predicate on
either. The GPU tests check the rewritten kernel's output bit for bit against the compiled one.

    patched = rewrite_promotion(cubin, "fp8_block_gemm", "yield-every-8")
"""

from __future__ import annotations

import hashlib
import re
import struct
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

from kforge.device import cache_dir
from kforge.errors import KforgeError
from kforge.runtime.cuda import Cubin, sass, write_atomically

_YIELD_BIT = 45  # of the high word; 0 = yield
_REUSE_SHIFT = 58  # of the high word; 4 bits, operand slot a = bit 58
_HINTS = 1 << _YIELD_BIT | 0xF << _REUSE_SHIFT  # the bits a rewrite may change
# Direct: they name where control goes (BRX, JMX: a register). BSSY names its reconvergence point (where
# BSYNC waits); BREAK names none and goes nowhere: it takes threads out of a convergence barrier, a BRA jumps.
_JUMPS = ("BRA", "JMP", "CALL", "BSSY")
_TARGET = re.compile(r"\b(?:BRA|JMP|CALL|BSSY|BPT|RET)\b[^;]*?\b0x([0-9a-f]+)\b")
_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*;)\s*/\* (0x[0-9a-f]{16}) \*/\s*\n\s*/\* (0x[0-9a-f]{16}) \*/")
STYLES = ("ptxas", "reuse", "yield", "yield-every-2", "yield-every-4", "yield-every-8", "yield-every-16",
          "yield-every-32")


@dataclass(frozen=True)
class Instruction:
    address: int  # bytes from the kernel's first instruction
    text: str  # cuobjdump's rendering, e.g. "FFMA R12, R25, R201.reuse, R12 ;"
    low: int
    high: int

    @property
    def opcode(self) -> str:
        return re.sub(r"^@!?U?P\w+\s+", "", self.text).split()[0]

    @property
    def yields(self) -> bool:
        """Whether the scheduler may switch to another warp after this instruction."""
        return not (self.high >> _YIELD_BIT) & 1

    @property
    def reuse(self) -> int:
        """The operand slots (bit 0 = a ... bit 3 = d) kept in the reuse cache for the next instruction."""
        return (self.high >> _REUSE_SHIFT) & 0xF

    def with_control(self, *, yields: bool, reuse: int) -> Instruction:
        """The same instruction with these yield and reuse bits (refused together: see the module docstring)."""
        if yields and reuse:
            raise KforgeError(f"{self.text}: an instruction that yields cannot keep operands for reuse")
        high = self.high & ~_HINTS | (0 if yields else 1) << _YIELD_BIT | reuse << _REUSE_SHIFT
        return replace(self, high=high)


def instructions(cubin: Cubin, kernel: str) -> list[Instruction]:
    """Every instruction of `kernel` in `cubin`, with its two 64-bit words as cuobjdump shows them."""
    dump = sass(cubin)
    start = dump.find(f"Function : {kernel}\n")
    if start < 0:
        raise KforgeError(f"no kernel named {kernel} in {cubin.source.name}'s cubin")
    end = dump.find("Function : ", start + 1)
    body = dump[start:end if end > 0 else len(dump)]
    return [Instruction(int(a, 16), t, int(lo, 16), int(hi, 16)) for a, t, lo, hi in _LINE.findall(body)]


def text_section(code: bytes, kernel: str) -> tuple[int, int]:
    """(file offset, size) of the ELF section `.text.<kernel>`: the kernel's machine code."""
    if code[:4] != b"\x7fELF" or code[4] != 2 or code[5] != 1:
        raise KforgeError("not a 64-bit little-endian ELF cubin")
    section_offset, = struct.unpack_from("<Q", code, 0x28)
    entry_size, count, names_index = struct.unpack_from("<HHH", code, 0x3A)

    def header(i: int) -> tuple:  # name, type, flags, address, offset, size
        return struct.unpack_from("<IIQQQQ", code, section_offset + i * entry_size)

    names_at = header(names_index)[4]
    wanted = f".text.{kernel}".encode()
    for i in range(count):
        name, _, _, _, offset, size = header(i)
        if code[names_at + name:names_at + name + len(wanted) + 1] == wanted + b"\0":
            return offset, size
    raise KforgeError(f"no section .text.{kernel} in the cubin")


def rewrite(cubin: Cubin, kernel: str, edited: list[Instruction], tag: str) -> Cubin:
    """A copy of `cubin` with `edited` instructions written over the originals at their
    addresses. Every instruction's bytes are first checked against the dump, so a rewrite
    can never land on the wrong word, and an edit may change only the yield and reuse bits.
    `tag` joins the cache key (a different cubin)."""
    offset, size = text_section(cubin.code, kernel)
    code = bytearray(cubin.code)
    original = {}
    for ins in instructions(cubin, kernel):
        if ins.address + 16 > size or code[offset + ins.address:offset + ins.address + 16] != struct.pack(
                "<QQ", ins.low, ins.high):
            raise KforgeError(f"{kernel}: the dump's instruction at {ins.address:#x} is not in the cubin's bytes")
        original[ins.address] = ins
    for ins in edited:
        before = original.get(ins.address)
        if before is None:
            raise KforgeError(f"{kernel}: an edit at {ins.address:#x} falls outside its instructions")
        if (before.low, before.high & ~_HINTS) != (ins.low, ins.high & ~_HINTS):
            raise KforgeError(f"{kernel}: the edit at {ins.address:#x} changes more than the yield and reuse bits")
        struct.pack_into("<QQ", code, offset + ins.address, ins.low, ins.high)
    return replace(cubin, code=bytes(code), key=f"{cubin.key}+{tag}", from_cache=False)


def promotion_runs(listing: list[Instruction]) -> list[tuple[int, list[Instruction]]]:
    """The promotion's FFMAs in runs that may chain the operand-reuse cache: adjacent FFMAs (nothing
    between, no predicate, no branch target after the first) on one factor, each run with the
    factor's operand slot (0 = a, 1 = b: ptxas puts it in either). An FFMA's factor is the
    multiplicand it shares, in the same slot, with the FFMA before or after it in the listing
    (other instructions may sit between); a register, never an immediate or a constant. FFMAs
    that share none are not the promotion's."""
    targets = {int(t, 16) for ins in listing for t in _TARGET.findall(ins.text)}
    unknown = [ins.text for ins in listing if ins.opcode.split(".")[0] in ("BRX", "JMX")
               or ins.opcode.split(".")[0] in _JUMPS and not _TARGET.search(ins.text)]
    if unknown:  # an indirect jump, or a target this parser cannot read: any instruction might be one
        raise KforgeError(f"cannot tell where every branch lands ({unknown[0]!r}): no reuse is safe to add")
    ffmas = [(k, ins, _multiplicands(ins)) for k, ins in enumerate(listing)
             if ins.opcode == "FFMA" and not ins.text.startswith("@")]
    runs: list[list] = []  # [slot, FFMAs, listing index of the last]
    for j, (k, ins, sources) in enumerate(ffmas):
        near = [ffmas[x][2] for x in (j - 1, j + 1) if 0 <= x < len(ffmas)]
        shared = [i for i in (0, 1) if re.fullmatch(r"R\d+", sources[i]) and any(n[i] == sources[i] for n in near)]
        if not shared:
            continue
        slot = shared[0]
        last = runs[-1] if runs else None
        if (last and last[2] == k - 1 and last[0] == slot and ins.address not in targets
                and _multiplicands(last[1][-1])[slot] == sources[slot]):
            last[1].append(ins)
            last[2] = k
        else:
            runs.append([slot, [ins], k])
    return [(slot, run) for slot, run, _ in runs]


@cache
def _own_source() -> bytes:
    return Path(__file__).read_bytes()


def _multiplicands(ins: Instruction) -> tuple[str, str]:
    """An FFMA's operand slots a and b ("FFMA R1, R2, R3, R4": R2 and R3), without reuse marks."""
    operands = [o.strip().removesuffix(".reuse") for o in ins.text.rstrip(" ;").split(None, 1)[-1].split(",")]
    return operands[1], operands[2]


def rewrite_promotion(cubin: Cubin, kernel: str, style: str, *, cache: bool = True) -> Cubin:
    """Set the yield and reuse bits of every run of FFMAs sharing a factor (`promotion_runs`):

    "ptxas"          leave them as compiled (every other FFMA yields, and the one after it
                     reads the factor from the register file again);
    "reuse"          no FFMA yields; each keeps the factor (in its run's slot) for the next one
                     of its run, so only the first of a run reads it from the register file;
    "yield"          every FFMA yields; none keeps an operand;
    "yield-every-N"  the N-th, 2N-th, ... FFMA of a run yields, the others keep the factor:
                     one read in N from the register file, one chance in N for another warp.

    The rewritten cubin is cached on disk beside the compiled ones (a second run disassembles
    nothing), keyed by the compiled cubin, the style and this module's source.
    """
    if style not in STYLES:
        raise KforgeError(f"promotion style must be one of {STYLES}, got {style!r}")
    if style == "ptxas":
        return cubin
    key = f"{cubin.key}+promotion-{style}"
    # the file name also hashes this module's source: a changed rewrite never reads an old one's cubin
    digest = hashlib.sha256(key.encode() + _own_source()).hexdigest()[:24]
    cached = cache_dir() / "cubins" / f"{cubin.source.stem}-{digest}.cubin"
    if cache and cached.is_file():
        return replace(cubin, code=cached.read_bytes(), key=key, from_cache=True)
    every = None if style == "reuse" else 1 if style == "yield" else int(style.rsplit("-", 1)[1])
    edited = []
    for slot, run in promotion_runs(instructions(cubin, kernel)):
        for i, ins in enumerate(run):
            yields = every is not None and i % every == every - 1
            # keep the factor only where the next instruction reads the same register from the same slot
            keep = 1 << slot if not yields and i + 1 < len(run) else 0
            edited.append(ins.with_control(yields=yields, reuse=0 if yields else ins.reuse & ~(1 << slot) | keep))
    rewritten = rewrite(cubin, kernel, edited, f"promotion-{style}")
    if cache:
        write_atomically(cached, rewritten.code)
    return rewritten

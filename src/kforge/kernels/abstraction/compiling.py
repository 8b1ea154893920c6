"""Compile a level's kernel for the H100 (sm_90a) on any machine, timed from a cold cache.

`measure(level, size)` runs `python -m kforge.kernels.abstraction.compiling TOOL KERNEL SIZE`
in a fresh process: Triton's JIT is off there (kforge turns its interpreter on where there is
no GPU, and Triton reads that once, at import), every tool's cache points at an empty folder,
and only the compile call is timed, not the imports. The child reads the cubin it got
(registers, spills, a few SASS instructions) with kforge's runtime and prints
one line of JSON: the ladder's compile-time column, and what the CPU tests check.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# What the SASS counts: Hopper's tensor-core MMA (wgmma), TMA loads and stores, 16-byte global accesses,
# and setmaxnreg (warp specialization moving registers from the producer to the consumers).
SASS_COUNTS = {"wgmma": r"\bHGMMA\b", "tma_loads": r"\bUTMALDG\b", "tma_stores": r"\bUTMASTG\b",
               "ldg128": r"\bLDG\.E\.(?:EL\.|LTC\w+\.|CONSTANT\.)*128\b", "stg128": r"\bSTG\.E\.128\b",
               "setmaxnreg": r"\bUSETMAXREG\b"}


_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")
_PREDICATE = r"@!?U?P\w+\s+"
# a conditional branch: predicated (@P0 BRA, @!UP1 BRA.U) or with its predicate as an operand (BRA !UP0, 0x...)
_BRANCH = re.compile(rf"^(?:(?P<guard>{_PREDICATE})?BRA(?:\.\w+)*\s+(?P<operand>!?U?P\w+\s*,\s*)?)0x([0-9a-f]+)")
_SHUFFLE = re.compile(rf"^(?:{_PREDICATE})?SHFL\b")


def shuffles_branched_around(text: str) -> int:
    """SHFL instructions that a conditional forward branch jumps over, in each function of the
    SASS (addresses restart at each). A full-warp shuffle must be reached by every lane of the
    warp: where the predicate splits a warp (e.g. `lane == 0`), the lanes that took the branch
    never arrive and the warp waits forever. (A warp-uniform predicate is harmless, so this is a
    count to read, not a verdict; the compiled softmax levels have none.)"""
    count = 0
    for function in re.split(r"\n\s*Function\s*:", text):
        lines = [(int(m.group(1), 16), m.group(2).strip()) for m in map(_LINE.search, function.splitlines()) if m]
        skipped = []
        for address, instruction in lines:
            branch = _BRANCH.match(instruction)
            if branch and (branch.group("guard") or branch.group("operand")) and int(branch.group(3), 16) > address:
                skipped.append((address, int(branch.group(3), 16)))
        count += sum(1 for address, instruction in lines if _SHUFFLE.match(instruction)
                     and any(start < address < end for start, end in skipped))
    return count


@dataclass(frozen=True)
class CompileReport:
    seconds: float | None  # the compile call alone, from a cold cache
    registers: int | None = None  # the kernel's (the largest, if the cubin holds several)
    spills: int | None = None  # STL and LDL instructions in the SASS
    sass: dict[str, int] | None = None  # SASS_COUNTS and shfl_branched_around
    error: str | None = None  # one line: why it did not compile


def triton_cubin(fn, types: dict[str, str], constants: dict[str, object], num_warps: int, num_stages: int = 3) -> bytes:
    """A @triton.jit or @gluon.jit kernel compiled for sm_90a. `types`: each runtime argument's
    Triton type ("*bf16", "i32"); the others are constexprs, valued in `constants`. Every
    pointer and int is taken as divisible by 16, as Triton specializes them at a launch on
    the ladder's shapes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource

    signature = {name: types.get(name, "constexpr") for name in fn.arg_names}
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in types}
    source = (GluonASTSource if fn.is_gluon() else ASTSource)(fn=fn, signature=signature, constexprs=constants,
                                                              attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages}).asm["cubin"]


def measure(level, size: int, timeout: float = 600) -> CompileReport:
    """Compile `level` for sm_90a at `size` in a fresh process with empty caches; its report."""
    with tempfile.TemporaryDirectory(prefix="kforge-compile-") as scratch:
        env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(Path(scratch) / "triton"),
               "TILELANG_CACHE_DIR": str(Path(scratch) / "tilelang"), "CUTE_DSL_CACHE_DIR": str(Path(scratch) / "cute")}
        try:
            done = subprocess.run([sys.executable, "-m", __name__, level.tool, level.kernel, str(size)], env=env,
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return CompileReport(None, error=f"did not compile within {timeout:.0f} s")
    if done.returncode != 0:
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        return CompileReport(None, error=lines[-1][:300] if lines else f"exit status {done.returncode}")
    return CompileReport(**json.loads(done.stdout.strip().splitlines()[-1]))


def _report(tool: str, kernel: str, size: int) -> CompileReport:
    from kforge.kernels.abstraction import levels
    from kforge.runtime.cuda import Cubin, resources, sass

    (level,) = [level for level in levels(kernel) if level.tool == tool]
    start = time.perf_counter()
    built = level.compile(size)
    seconds = time.perf_counter() - start
    cubin = Cubin(level.source, "sm_90a", (), "", level.cubin_of(built), "")
    used = max(resources(cubin).values(), key=lambda r: r.registers)
    text = sass(cubin)
    counts = {name: len(re.findall(pattern, text)) for name, pattern in SASS_COUNTS.items()}
    counts["shfl_branched_around"] = shuffles_branched_around(text)
    return CompileReport(seconds, used.registers, len(re.findall(r"\b(?:STL|LDL)\b", text)), counts)


if __name__ == "__main__":
    tool_name, kernel_name, size_text = sys.argv[1:4]
    from dataclasses import asdict

    print(json.dumps(asdict(_report(tool_name, kernel_name, int(size_text)))))

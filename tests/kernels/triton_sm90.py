"""Compile Triton kernels for the H100 (sm_90) on any machine, and read what came out.

`compile_sm90(specs)` runs one subprocess with TRITON_INTERPRET=0 (the interpreter is on
in the test process, and Triton reads the choice once, at import), compiles each spec
with `triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`, and returns per
label: registers a thread, spilled bytes, shared memory, and counts of some SASS
instructions (16-byte global loads, wgmma: HGMMA for 16-bit inputs, QGMMA for FP8; TMA
loads, cp.async). A spec is a dict:
label, module, kernel (the name of a @triton.jit function, not an autotuner), types (argument name -> Triton type, e.g. "*bf16",
"i32"; others are constexprs), constants, aligned (arguments Triton may assume divisible
by 16), num_warps, num_stages.
"""

import json
import subprocess
import sys

_SCRIPT = r"""
import importlib, json, os, re, sys
os.environ["TRITON_INTERPRET"] = "0"
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kforge.runtime.cuda import Cubin, resources, sass

found = {}
for spec in json.loads(sys.stdin.read()):
    fn = getattr(importlib.import_module(spec["module"]), spec["kernel"])
    types = spec["types"]
    signature = {name: types.get(name, "constexpr") for name in fn.arg_names}
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in spec["aligned"] if name in types}
    source = ASTSource(fn=fn, signature=signature, constexprs=spec["constants"], attrs=attrs)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": spec["num_warps"], "num_stages": spec["num_stages"]})
    cubin = Cubin(Path(fn.__name__), "sm_90", (), "", kernel.asm["cubin"], "")
    code = sass(cubin)
    (used,) = resources(cubin).values()
    count = lambda pattern: len(re.findall(pattern, code))
    found[spec["label"]] = dict(
        registers=used.registers, local=used.local_bytes + used.stack_bytes, spills=count(r"\b(STL|LDL)\b"),
        shared=kernel.metadata.shared, ldg128=count(r"\bLDG\.E\.128\b"), stg128=count(r"\bSTG\.E\.128\b"),
        hgmma=count(r"\bHGMMA\b"), qgmma=count(r"\bQGMMA\b"), tma=count(r"\bUTMALDG\b"), ldgsts=count(r"\bLDGSTS\b"))
print(json.dumps(found))
"""


def compile_sm90(specs: list[dict]) -> dict[str, dict]:
    done = subprocess.run([sys.executable, "-c", _SCRIPT], input=json.dumps(specs), capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def spec(label, module, kernel, types, constants, *, aligned=(), num_warps=4, num_stages=3) -> dict:
    return dict(label=label, module=module, kernel=kernel, types=types, constants=constants, aligned=list(aligned),
                num_warps=num_warps, num_stages=num_stages)

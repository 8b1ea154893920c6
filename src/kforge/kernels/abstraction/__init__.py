"""The abstraction ladder: one bf16 GEMM and one row softmax at each level a GPU kernel can be
written at, from the tile-level DSLs down to CUDA C++, each in its own file.

A level is a tool (Triton, TileLang, Gluon, CuTe DSL, CUDA) and a kernel ("gemm": C = A @ B,
bf16 in and out, fp32 accumulation; "softmax": over the rows of bf16 logits). For each,
this registry knows the file that holds the kernel (its lines are counted, `lines_of_code`),
the function that runs it on torch tensors, how to compile it for the H100 (sm_90a) without
a GPU (`compiling.py` times that from a cold cache), what the level lets a kernel writer
control, and, for the tools kforge does not depend on, how to install them: a level whose
tool is missing is skipped with that one line (`Level.missing`).

`kforge ladder abstraction` judges every available level against cuBLAS (or torch.softmax)
like any other candidate (kforge/ladder.py).
"""

from __future__ import annotations

import ast
import importlib.util
import io
import re
import tokenize
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

HERE = Path(__file__).parent
KERNELS = ("gemm", "softmax")
CUDA_GEMM_RUNG = 4  # the bf16 ladder's best rung at 4096^3 and 8192^3 (docs/ladders.md): persistent


@dataclass(frozen=True)
class Level:
    tool: str  # the step's label in the ladder: triton, tilelang, gluon, cute, cuda
    kernel: str  # gemm or softmax
    source: Path  # the kernel's own file: what `lines_of_code` counts
    run: Callable[..., torch.Tensor]  # the kernel on torch tensors: (a, b) -> c or (x,) -> y
    compile: Callable[[int], object]  # the tool's compile for sm_90a at the ladder's size, no GPU needed (timed)
    controls: str  # what this level lets a kernel writer control
    package: str | None = None  # the optional tool's import name; None: kforge's own dependencies
    extra: str | None = None  # the pyproject extra that installs it
    cubin_of: Callable[[object], bytes] = bytes  # the cubin in what `compile` returned (not timed)

    def missing(self) -> str | None:
        """None when the tool imports here; else one line saying how to install it."""
        if self.package is None or importlib.util.find_spec(self.package) is not None:
            return None
        return (f"{self.tool}: skipped, {self.package} is not installed "
                f"(pip install 'kforge[{self.extra}]')")


class LevelModel(torch.nn.Module):
    """A level as a harness candidate (ModelNew): forward(*inputs) is the level's kernel."""

    def __init__(self, level: Level):
        super().__init__()
        self.level = level

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.level.run(*inputs)


def levels(kernel: str) -> tuple[Level, ...]:
    """The levels of `kernel`, most abstract first."""
    if kernel not in KERNELS:
        raise ValueError(f"no abstraction ladder for {kernel!r} (kernels: {', '.join(KERNELS)})")
    return tuple(level for level in LEVELS if level.kernel == kernel)


# --- counting lines ----------------------------------------------------------------------

_C_COMMENT_OR_STRING = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"', re.DOTALL)


def lines_of_code(path: Path) -> int:
    """Non-blank lines that are not only comments (nor, in Python, docstrings) in one file:
    the same count for every level, applied to the kernel's own file."""
    text = Path(path).read_text()
    if Path(path).suffix == ".py":
        return len(_python_code_lines(text))

    def blank_comment(match: re.Match) -> str:  # keep strings; a comment keeps only its line breaks
        token = match.group(0)
        return token if token.startswith('"') else "\n" * token.count("\n")

    return sum(1 for line in _C_COMMENT_OR_STRING.sub(blank_comment, text).splitlines() if line.strip())


def _python_code_lines(text: str) -> set[int]:
    docstrings = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value,
                                                                                                     str):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    layout = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING,
              tokenize.ENDMARKER}
    lines = set()
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type not in layout:
            lines.update(range(token.start[0], token.end[0] + 1))
    return lines - docstrings


# --- the levels ----------------------------------------------------------------------------
# Each run and compile function imports its tool when called: listing the levels needs none.

_GEMM_POINTERS = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32"}
_SOFTMAX_POINTERS = {"x_ptr": "*bf16", "y_ptr": "*bf16", "n_cols": "i32"}


def _triton_gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    from kforge.kernels.gemm_bf16.triton_matmul import matmul

    return matmul(a, b)


def _triton_gemm_cubin(size: int) -> bytes:
    from kforge.kernels.abstraction.compiling import triton_cubin
    from kforge.kernels.gemm_bf16 import triton_matmul

    best = triton_matmul.CONFIGS[0]  # the autotuner's pick at 4096^3 and 8192^3 on the H100: 128 x 256, 3 stages
    constants = {**best.kwargs, "NUM_PROGRAMS": 132, "B_KMAJOR": 0}
    return triton_cubin(triton_matmul.matmul_persistent, _GEMM_POINTERS, constants, best.num_warps, best.num_stages)


def _gluon_gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    from kforge.kernels.abstraction.gluon_gemm import gemm

    return gemm(a, b)


def _gluon_gemm_cubin(size: int) -> bytes:
    from kforge.kernels.abstraction import gluon_gemm
    from kforge.kernels.abstraction.compiling import triton_cubin

    constants = {**gluon_gemm.TILE, "num_warps": gluon_gemm.NUM_WARPS}
    return triton_cubin(gluon_gemm.gemm_kernel, _GEMM_POINTERS, constants, gluon_gemm.NUM_WARPS)


def _cuda_gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    from kforge.kernels import gemm_bf16

    return gemm_bf16.gemm(a, b, CUDA_GEMM_RUNG)


def _cuda_gemm_cubin(size: int) -> bytes:
    from kforge.kernels import gemm_bf16
    from kforge.runtime.cuda import compile_cuda

    return compile_cuda(gemm_bf16.rung(CUDA_GEMM_RUNG).source, arch="sm_90a", defines={"B_KMAJOR": 0},
                        cache=False).code


def _triton_softmax(x: torch.Tensor) -> torch.Tensor:
    from kforge.kernels.abstraction.triton_softmax import softmax

    return softmax(x)


def _triton_softmax_cubin(size: int) -> bytes:
    from kforge.kernels.abstraction import triton_softmax
    from kforge.kernels.abstraction.compiling import triton_cubin

    return triton_cubin(triton_softmax.softmax_kernel, _SOFTMAX_POINTERS, {"CHUNK": triton_softmax.CHUNK},
                        triton_softmax.NUM_WARPS)


def _gluon_softmax(x: torch.Tensor) -> torch.Tensor:
    from kforge.kernels.abstraction.gluon_softmax import softmax

    return softmax(x)


def _gluon_softmax_cubin(size: int) -> bytes:
    from kforge.kernels.abstraction import gluon_softmax
    from kforge.kernels.abstraction.compiling import triton_cubin

    constants = {"VECTOR": gluon_softmax.VECTOR, "num_warps": gluon_softmax.NUM_WARPS}
    return triton_cubin(gluon_softmax.softmax_kernel, _SOFTMAX_POINTERS, constants, gluon_softmax.NUM_WARPS)


CUDA_SOFTMAX_SOURCE = HERE / "cuda_softmax.cu"
CUDA_SOFTMAX_THREADS = 512  # THREADS in cuda_softmax.cu


def _cuda_softmax(x: torch.Tensor) -> torch.Tensor:
    from kforge.runtime.cuda import CudaKernel

    if x.dtype != torch.bfloat16 or x.dim() != 2 or not x.is_contiguous() or x.shape[1] % 8:
        raise ValueError(f"cuda_softmax: needs a contiguous 2-D bf16 tensor with a multiple of 8 columns, "
                         f"got {x.dtype} {tuple(x.shape)}")
    y = torch.empty_like(x)
    if x.numel():
        kernel = _CUDA_SOFTMAX.get("kernel") or _CUDA_SOFTMAX.setdefault(
            "kernel", CudaKernel.from_file(CUDA_SOFTMAX_SOURCE, "softmax_rows"))
        kernel.launch(x.shape[0], CUDA_SOFTMAX_THREADS, (x, y, x.shape[1]))
    return y


_CUDA_SOFTMAX: dict[str, object] = {}


def _cuda_softmax_cubin(size: int) -> bytes:
    from kforge.runtime.cuda import compile_cuda

    return compile_cuda(CUDA_SOFTMAX_SOURCE, arch="sm_90a", cache=False).code


def _tilelang_gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    from kforge.kernels.abstraction.tilelang_gemm import gemm

    return gemm(a, b)


def _tilelang_gemm_compile(size: int):
    from kforge.kernels.abstraction.tilelang_gemm import compiled

    return compiled(size, size, size)


def _tilelang_softmax(x: torch.Tensor) -> torch.Tensor:
    from kforge.kernels.abstraction.tilelang_softmax import softmax

    return softmax(x)


def _tilelang_softmax_compile(size: int):
    from kforge.kernels.abstraction.tilelang_softmax import compiled

    return compiled(size)


def _tilelang_cubin(kernel) -> bytes:
    """TileLang's runtime module keeps its cubin to itself: the same emitted source through
    nvcc again, with TileLang's headers (what the SASS checks read; not in the compile time)."""
    from tilelang import env
    from tilelang.contrib import nvcc

    return bytes(nvcc.compile_cuda(kernel.get_kernel_source(), target_format="cubin", arch="sm_90a",
                                   options=["-std=c++17", f"-I{env.CUTLASS_INCLUDE_DIR}",
                                            f"-I{env.TILELANG_TEMPLATE_PATH}"]))



def _cute_gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    from kforge.kernels.abstraction.cute_gemm import gemm

    return gemm(a, b)


def _cute_gemm_compile(size: int):
    from kforge.kernels.abstraction.cute_gemm import compiled

    return compiled(size, size, size)


def _cute_softmax(x: torch.Tensor) -> torch.Tensor:
    from kforge.kernels.abstraction.cute_softmax import softmax

    return softmax(x)


def _cute_softmax_compile(size: int):
    from kforge.kernels.abstraction.cute_softmax import compiled

    return compiled(size)


def _cute_cubin(compiled) -> bytes:
    """The cubin `cute.compile` kept (`--keep-cubin`) in its artifacts."""
    return compiled.artifacts.CUBIN

_TRITON_CONTROLS = "tile shapes, warps, pipeline depth, tile order"
_TILELANG_CONTROLS = "tiles, threads, pipeline stages, buffers and copies; TMA, wgmma, warp roles inferred"
_GLUON_CONTROLS = "+ register and shared layouts, the TMA + mbarrier ring, wgmma issue and wait"
_CUTE_CONTROLS = "+ warp roles, setmaxnreg, persistence; MMA and copy atoms on CuTe layouts"
_CUDA_CONTROLS = "everything, in PTX: warp roles, setmaxnreg, persistence, epilogue overlap"

LEVELS: tuple[Level, ...] = (
    Level("triton", "gemm", HERE.parent / "gemm_bf16" / "triton_matmul.py", _triton_gemm, _triton_gemm_cubin,
          _TRITON_CONTROLS),
    Level("tilelang", "gemm", HERE / "tilelang_gemm.py", _tilelang_gemm, _tilelang_gemm_compile, _TILELANG_CONTROLS,
          package="tilelang", extra="tilelang", cubin_of=_tilelang_cubin),
    Level("gluon", "gemm", HERE / "gluon_gemm.py", _gluon_gemm, _gluon_gemm_cubin, _GLUON_CONTROLS),
    Level("cute", "gemm", HERE / "cute_gemm.py", _cute_gemm, _cute_gemm_compile, _CUTE_CONTROLS, package="cutlass",
          extra="cute", cubin_of=_cute_cubin),
    Level("cuda", "gemm", HERE.parent / "gemm_bf16" / f"0{CUDA_GEMM_RUNG}_persistent.cu", _cuda_gemm,
          _cuda_gemm_cubin, _CUDA_CONTROLS),
    Level("triton", "softmax", HERE / "triton_softmax.py", _triton_softmax, _triton_softmax_cubin, _TRITON_CONTROLS),
    Level("tilelang", "softmax", HERE / "tilelang_softmax.py", _tilelang_softmax, _tilelang_softmax_compile,
          _TILELANG_CONTROLS, package="tilelang", extra="tilelang", cubin_of=_tilelang_cubin),
    Level("gluon", "softmax", HERE / "gluon_softmax.py", _gluon_softmax, _gluon_softmax_cubin, _GLUON_CONTROLS),
    Level("cute", "softmax", HERE / "cute_softmax.py", _cute_softmax, _cute_softmax_compile, _CUTE_CONTROLS,
          package="cutlass", extra="cute", cubin_of=_cute_cubin),
    Level("cuda", "softmax", CUDA_SOFTMAX_SOURCE, _cuda_softmax, _cuda_softmax_cubin, _CUDA_CONTROLS),
)

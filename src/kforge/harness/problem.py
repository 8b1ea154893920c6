"""A problem: a reference PyTorch module, how to make its inputs, and what it costs.

A problem file is a KernelBench problem: `class Model(nn.Module)`, `get_inputs()` and
`get_init_inputs()`. KernelBench files work unchanged. A problem may also define any of
these kforge names (all optional):

    flops(inputs) -> number      floating-point operations one forward pass must do
    bytes_moved(inputs) -> int   the fewest bytes it must move through device memory;
                                 default: every input tensor, parameter and buffer read
                                 once plus every output written once
    tolerance = 1e-3             atol = rtol = 1e-3; or {"atol": ..., "rtol": ..., "rel_l2": ...};
                                 default by output dtype (fp32 1e-4, fp16/bf16 1e-2; the
                                 relative L2 bound fp32 1e-5, fp16 5e-3, bf16 1e-2, or
                                 the atol or rtol given here, whichever is largest)
    precision = "as_drawn"       gate 1 only on get_inputs()'s own draws; by default
                                 ("exposed") it adds trials on the same draws with random
                                 signs and magnitudes spread over 2^-4..2^4, where
                                 rounding in a lower precision shows (a sum of positive
                                 numbers averages it away; a sum with cancellation does
                                 not). Opt out when inputs must keep their signs.
    compute_dtype = "bf16"       which matmul ceiling the flops run against (fp32, tf32,
                                 fp16, bf16, fp8); default: the first floating input's
    tags = ["gemm"]              free-form labels, kept in every record
    forbidden_ops = ["aten::mm"] ops the candidate must not call (the library it is
                                 meant to beat), seen at the dispatcher during gate 1
    tiny_sizes = {"N": 64}       module-level constants to override for a tiny run (the
                                 default on a machine without a GPU, or `--size tiny`):
                                 get_inputs()/get_init_inputs() must read their sizes
                                 from those constants
    GPUS = 2                     how many GPUs one evaluation holds, all on one machine
                                 (default 1): its workers see exactly those, as
                                 devices 0..GPUS-1. Read from the file's text, never by
                                 running it (`declared_gpus`): a suite places the pair
                                 before any process imports the problem, so write it
                                 as a plain number
"""

from __future__ import annotations

import ast
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from kforge.errors import ProblemError
from kforge.harness.loading import call_user, file_sha256, import_user_file, seed_everything
from kforge.harness.roofline import COMPUTE_DTYPES, TORCH_TO_COMPUTE_DTYPE

# Per output dtype: (elementwise, rel_l2). The elementwise value is both atol and rtol
# (KernelBench's for fp32/fp16/bf16); rel_l2 bounds ||out - ref|| / ||ref||. fp32: fp16 or
# tf32 products measured 5.5e-6 (rand inputs, K=4096) to 2.9e-4 (signed inputs); fp32 and
# 3xTF32 1e-7 to 3.5e-7 (CPU, float64 truth). Honest fp32 in another order reached 1.01e-5
# on an output that cancels (KernelBench level2/77, a batch norm then a global average,
# against itself on an H200), so 3e-5: on the exposing draws it catches a lower precision
# by 10x.
DEFAULT_TOLERANCE = {
    torch.float64: (1e-7, 1e-10),
    torch.float32: (1e-4, 3e-5),
    torch.float16: (1e-2, 5e-3),
    torch.bfloat16: (1e-2, 1e-2),
    torch.float8_e4m3fn: (1.25e-1, 1e-1),
    torch.float8_e5m2: (2.5e-1, 2e-1),
    torch.complex64: (1e-4, 3e-5),
    torch.complex128: (1e-7, 1e-10),
}
OTHER_TOLERANCE = (1e-2, 1e-2)  # a floating dtype not above
PRECISIONS = ("exposed", "as_drawn")
EXPOSED_TRIALS = 2  # gate 1's extra trials on exposing draws (precision = "exposed")
SIZES = ("full", "tiny", "auto")  # auto: tiny if the problem defines tiny_sizes, else full


@dataclass
class Problem:
    path: Path
    sha256: str
    module: ModuleType
    size: str  # "full" or "tiny"
    tags: list[str] = field(default_factory=list)
    tolerance: tuple[float, float] | None = None  # (atol, rtol) set by the problem
    compute_dtype: str | None = None
    forbidden_ops: list[str] = field(default_factory=list)
    rel_l2: float | None = None  # the relative L2 bound set by the problem
    precision: str = "exposed"

    @property
    def name(self) -> str:
        return self.path.stem

    @property
    def model_class(self) -> type[nn.Module]:
        return self.module.Model

    def _call(self, fn: Callable, *args, stage: str):
        return call_user(fn, *args, error=ProblemError, stage=stage, user_file=self.path)

    def init_inputs(self, seed: int, device: torch.device) -> list:
        seed_everything(seed)
        with torch.device(device):
            values = self._call(self.module.get_init_inputs, stage="get_init_inputs() failed")
        return _as_argument_list(values, "get_init_inputs()", device)

    def make_inputs(self, seed: int, device: torch.device, exposed: bool = False) -> list:
        """A fresh input set drawn under `seed`, created directly on `device`; with
        `exposed`, its floating tensors get random signs and spread magnitudes (see
        `precision` in the module's docstring)."""
        seed_everything(seed)
        with torch.device(device):
            values = self._call(self.module.get_inputs, stage="get_inputs() failed")
        inputs = _as_argument_list(values, "get_inputs()", device)
        return expose(inputs, seed) if exposed else inputs

    @property
    def exposed_trials(self) -> int:
        return EXPOSED_TRIALS if self.precision == "exposed" else 0

    def build_reference(self, init_inputs: Sequence, seed: int, device: torch.device) -> nn.Module:
        seed_everything(seed)
        with torch.device(device):
            model = self._call(self.model_class, *init_inputs, stage="building Model failed")
        return model.to(device)

    def run_reference(self, model: Callable, inputs: Sequence):
        return self._call(model, *inputs, stage="the reference Model raised")

    def count_flops(self, inputs: Sequence) -> float | None:
        fn = getattr(self.module, "flops", None)
        if fn is None:
            return None
        value = self._call(fn, inputs, stage="flops(inputs) failed")
        return _non_negative_number(value, "flops(inputs)")

    def count_bytes(self, inputs: Sequence, outputs: object, model: nn.Module) -> int:
        fn = getattr(self.module, "bytes_moved", None)
        if fn is not None:
            value = self._call(fn, inputs, stage="bytes_moved(inputs) failed")
            return int(_non_negative_number(value, "bytes_moved(inputs)"))
        state = list(model.parameters()) + list(model.buffers())
        return sum(_tensor_bytes(x) for x in [*inputs, *state, *flatten_outputs(outputs)])

    def tolerance_for(self, dtype: torch.dtype) -> tuple[float, float]:
        if self.tolerance is not None:
            return self.tolerance
        if not (dtype.is_floating_point or dtype.is_complex):
            return (0.0, 0.0)
        return (DEFAULT_TOLERANCE.get(dtype, OTHER_TOLERANCE)[0],) * 2

    def rel_l2_for(self, dtype: torch.dtype) -> float | None:
        """The relative L2 bound for an output of `dtype` (None: exact types, no bound)."""
        if not (dtype.is_floating_point or dtype.is_complex):
            return None
        if self.rel_l2 is not None:
            return self.rel_l2
        default = DEFAULT_TOLERANCE.get(dtype, OTHER_TOLERANCE)[1]
        # A problem that sets its own elementwise tolerance (and no rel_l2) loosens this bound
        # with it: to its atol or rtol, whichever is larger (a loss of ~10 held to atol 1e-2).
        return max(default, *self.tolerance) if self.tolerance is not None else default

    def compute_dtype_for(self, inputs: Sequence) -> str | None:
        if self.compute_dtype is not None:
            return self.compute_dtype
        for x in inputs:
            if isinstance(x, torch.Tensor) and x.dtype in TORCH_TO_COMPUTE_DTYPE:
                return TORCH_TO_COMPUTE_DTYPE[x.dtype]
        return None


def load_problem(path: str | Path, size: str = "full", constants: Mapping[str, int] | None = None) -> Problem:
    """Import a problem file and check its names and kforge metadata.

    `constants` overrides module-level size constants (e.g. {"M": 4096}) after `size`
    is applied; the problem's size then reads "M=4096,..." in its records.
    """
    if size not in SIZES:
        raise ProblemError(f"unknown size {size!r} (expected one of {', '.join(SIZES)})")
    path = Path(path).resolve()
    module = import_user_file(path, ProblemError, "problem")
    for required in ("Model", "get_inputs", "get_init_inputs"):
        if not hasattr(module, required):
            raise ProblemError(
                f"problem defines no `{required}`",
                "A problem file defines class Model(nn.Module), get_inputs() and get_init_inputs().",
            )
    if not (isinstance(module.Model, type) and issubclass(module.Model, nn.Module)):
        raise ProblemError("problem's `Model` is not a torch.nn.Module subclass")
    for fn_name in ("get_inputs", "get_init_inputs", "flops", "bytes_moved"):
        if hasattr(module, fn_name) and not callable(getattr(module, fn_name)):
            raise ProblemError(f"problem's `{fn_name}` is not callable")

    if size == "auto":
        size = "tiny" if hasattr(module, "tiny_sizes") else "full"
    if size == "tiny":
        _apply_tiny_sizes(module, path)
    if constants:
        _override_constants(module, constants, "the size override")
        size = ",".join(f"{name}={value}" for name, value in constants.items())
    return Problem(
        path=path,
        sha256=file_sha256(path),
        module=module,
        size=size,
        tags=_parse_tags(getattr(module, "tags", [])),
        tolerance=_parse_tolerance(getattr(module, "tolerance", None)),
        rel_l2=_parse_rel_l2(getattr(module, "tolerance", None)),
        precision=_parse_precision(getattr(module, "precision", "exposed")),
        compute_dtype=_parse_compute_dtype(getattr(module, "compute_dtype", None)),
        forbidden_ops=_parse_forbidden_ops(getattr(module, "forbidden_ops", [])),
    )


# CPython 3.11's parser is not safe to enter from two threads at once ("AST constructor
# recursion depth mismatch", SystemError): the machine loop's threads ask for pairs together.
_PARSING = threading.Lock()


def declared_gpus(path: str | Path) -> int:
    """The `GPUS` a problem file declares (module docstring), 1 where it declares none.

    Read from the file's syntax tree: the suite's process decides where a pair runs and must
    not run the problem's code to do so. A file that does not parse declares nothing here;
    its evaluation reports it as a problem_error, as for any problem that fails to import.
    """
    try:
        source = Path(path).read_bytes()
        with _PARSING:
            tree = ast.parse(source, filename=str(path))
    except SyntaxError:
        return 1
    declared = None
    for statement in tree.body:
        if isinstance(statement, ast.Assign):
            targets = statement.targets
        elif isinstance(statement, ast.AnnAssign) and statement.value is not None:
            targets = [statement.target]
        else:
            continue
        if any(isinstance(target, ast.Name) and target.id == "GPUS" for target in targets):
            declared = statement.value  # the last assignment wins, as it would on import
    if declared is None:
        return 1
    try:
        value = ast.literal_eval(declared)
    except ValueError:  # an expression: its value is known only by running the file
        value = None
    return _parse_gpus(value, f"{ast.unparse(declared)} in {Path(path).name}")


def flatten_outputs(outputs: object) -> list:
    """The leaves of a forward's result: a tensor, or (nested) tuples/lists of them."""
    if isinstance(outputs, (tuple, list)):
        return [leaf for item in outputs for leaf in flatten_outputs(item)]
    return [outputs]


def _apply_tiny_sizes(module: ModuleType, path: Path) -> None:
    sizes = getattr(module, "tiny_sizes", None)
    if sizes is None:
        raise ProblemError(
            f"problem has no tiny size: {path.name} defines no `tiny_sizes`",
            "Define tiny_sizes = {'CONSTANT': small_value, ...} naming the module-level "
            "constants that get_inputs()/get_init_inputs() read, or run with --size full.",
        )
    if not isinstance(sizes, dict):
        raise ProblemError("problem's `tiny_sizes` must be a dict of constant names to values")
    _override_constants(module, sizes, "`tiny_sizes`")


def _override_constants(module: ModuleType, values: Mapping[str, object], where: str) -> None:
    for name, value in values.items():
        if not hasattr(module, name):
            raise ProblemError(f"{where} names {name!r}, which the problem does not define")
        setattr(module, name, value)


def _parse_tolerance(value) -> tuple[float, float] | None:
    if value is None:
        return None
    if isinstance(value, (int, float)) and value >= 0:
        return (float(value), float(value))
    if isinstance(value, dict) and set(value) <= {"atol", "rtol", "rel_l2"} and value:
        if not {"atol", "rtol"} & set(value):
            return None
        atol, rtol = float(value.get("atol", 0.0)), float(value.get("rtol", 0.0))
        if atol >= 0 and rtol >= 0:
            return (atol, rtol)
    raise ProblemError(
        f"problem's `tolerance` must be a non-negative number or {{'atol': x, 'rtol': y, 'rel_l2': z}}, "
        f"got {value!r}"
    )


def _parse_rel_l2(value) -> float | None:
    if isinstance(value, dict) and "rel_l2" in value:
        bound = value["rel_l2"]
        if isinstance(bound, (int, float)) and not isinstance(bound, bool) and bound > 0:
            return float(bound)
        raise ProblemError(f"problem's `tolerance['rel_l2']` must be a positive number, got {bound!r}")
    return None


def _parse_precision(value) -> str:
    if value in PRECISIONS:
        return value
    raise ProblemError(f"problem's `precision` must be one of {', '.join(map(repr, PRECISIONS))}, got {value!r}")


EXPOSE_CHUNK = 1 << 24  # elements drawn at a time: KernelBench's inputs reach 12 GiB


def expose(inputs: list, seed: int) -> list:
    """Each floating tensor of 16 bits or more times random signs and, at fp32 and wider, a
    magnitude spread of 2^-4..2^4 (16-bit inputs keep theirs: the spread would overflow
    fp16; fp8 tensors are left alone: quantized payloads). In place,
    chunk by chunk: the draw's own tensors, and never more than a chunk of temporaries."""
    seen = set()
    for index, x in enumerate(inputs):
        if not (isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel()) or id(x) in seen:
            continue
        if torch.finfo(x.dtype).bits < 16:  # fp8 payloads: a format, not values to expose
            continue
        seen.add(id(x))  # an input passed twice is exposed once
        generator = torch.Generator(device=x.device).manual_seed((seed + 7919 * index) % (1 << 63))
        flat = x.view(-1) if x.is_contiguous() else None
        target = flat if flat is not None else x.reshape(-1).clone()
        for start in range(0, target.numel(), EXPOSE_CHUNK):
            part = target[start:start + EXPOSE_CHUNK]
            factor = torch.empty(part.shape, device=x.device, dtype=torch.float32)
            factor.bernoulli_(0.5, generator=generator).mul_(2).sub_(1)
            if torch.finfo(x.dtype).bits >= 32:
                spread = torch.rand(part.shape, generator=generator, device=x.device, dtype=torch.float32)
                factor.mul_(torch.exp2(spread.mul_(8).sub_(4)))
            part.mul_(factor.to(x.dtype))
        if flat is None:
            x.copy_(target.view(x.shape))
    return inputs


def _parse_tags(value) -> list[str]:
    if isinstance(value, (list, tuple)) and all(isinstance(t, str) for t in value):
        return list(value)
    raise ProblemError(f"problem's `tags` must be a list of strings, got {value!r}")


def _parse_gpus(value, written: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    raise ProblemError(f"problem's `GPUS` must be a whole number of GPUs of at least 1, written as a number "
                       f"(GPUS = 2), got {written}")


def _parse_forbidden_ops(value) -> list[str]:
    if isinstance(value, (list, tuple)) and all(isinstance(op, str) and "::" in op for op in value):
        return list(value)
    raise ProblemError(f"problem's `forbidden_ops` must be a list of op names like 'aten::mm', got {value!r}")


def _parse_compute_dtype(value) -> str | None:
    if value is None or value in COMPUTE_DTYPES:
        return value
    raise ProblemError(f"problem's `compute_dtype` must be one of {', '.join(COMPUTE_DTYPES)}, got {value!r}")


def _as_argument_list(values, where: str, device: torch.device) -> list:
    if not isinstance(values, (list, tuple)):
        raise ProblemError(f"{where} must return a list of arguments, got {type(values).__name__}")
    return [v.to(device) if isinstance(v, torch.Tensor) else v for v in values]


def _non_negative_number(value, where: str) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ProblemError(f"{where} must return a non-negative number, got {value!r}")
    return float(value)


def _tensor_bytes(x) -> int:
    return x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 0

"""Running Triton kernels on a machine with no GPU, through Triton's interpreter.

Triton decides once, when it is first imported, whether kernels compile or interpret:
its own library functions (tl.max, tl.sum, ...) are decorated then, and @triton.jit
reads TRITON_INTERPRET again for each kernel it decorates. So `choose_triton_mode()`
runs when kforge is imported: on a machine with no CUDA device it sets
TRITON_INTERPRET=1 (unless you set it yourself) before anything imports Triton.

`mend_interpreter()` mends three interpreter bugs (triton 3.6), each also on its own:
- `mend_bf16_dot()`: `tl.dot` on bf16 tiles multiplies the raw 16-bit patterns as
  integers, because the interpreter stores bf16 as uint16. We widen bf16 operands to fp32
  first, which is what the tensor cores do (exact products, fp32 accumulation).
- `mend_bf16_casts()`: fp32 -> bf16 casts truncate, where the GPU rounds to nearest even:
  every bf16 a kernel stored came out up to a whole step low in magnitude, and through a
  decoder block's dozen kernels that bias reached 0.05 of outputs the GPU gets right.
- `mend_fp8_casts()`: casts to e4m3 and e5m2 round half up and lose the carry into the
  exponent when the mantissa rounds over (0.49 became 0.25, 124.3 became 64), where the GPU
  rounds to nearest even and saturates (`cvt.rn.satfinite`): FP8 kernels under the
  interpreter were far less accurate than on the GPU.
Elementwise bf16 arithmetic inside a kernel is still wrong under the interpreter: upcast
to fp32 before doing math, as kernels should anyway.

`mend_scalar_index()` mends a third, in triton < 3.7 under numpy >= 2.3 only: a scalar
argument used as a loop bound (`for k in range(0, K, BK)`) fails with "only 0-dimensional
arrays can be converted to Python scalars". It is applied when kforge is imported, so that
kforge needs no pin on numpy; triton 3.7 has the fix itself.
"""

from __future__ import annotations

import os
import sys

_MENDED = False
_CASTS_MENDED = False
_FP8_MENDED = False
_INDEX_MENDED = False


def choose_triton_mode() -> None:
    """Interpret Triton kernels where there is no CUDA device (call before importing Triton),
    and then mend the interpreter's loop bounds where this triton and numpy need it."""
    if "TRITON_INTERPRET" not in os.environ and "triton" not in sys.modules:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    if interpreter_active() and scalar_index_needs_mending():
        mend_scalar_index()


def scalar_index_needs_mending() -> bool:
    """Whether this triton (< 3.7) and numpy (>= 2.3) break `range(0, K, ...)` in the interpreter.
    Read from the installed versions, so that a process that needs no mend imports no triton."""
    import re
    from importlib import metadata

    def major_minor(name: str) -> tuple[int, ...]:
        try:
            return tuple(int(x) for x in re.findall(r"\d+", metadata.version(name))[:2])
        except (metadata.PackageNotFoundError, ValueError):
            return ()

    triton, numpy = major_minor("triton"), major_minor("numpy")
    return bool(triton) and bool(numpy) and triton < (3, 7) and numpy >= (2, 3)


def mend_scalar_index() -> None:
    """Scalar arguments are 1-element arrays in the interpreter, and its `__index__` converts
    them with int(array), which numpy 2.3 refuses for arrays of one dimension: convert the
    squeezed (0-d) array instead. Patched where the interpreter patches tensors for a run."""
    global _INDEX_MENDED
    if _INDEX_MENDED:
        return
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None:
        return  # a Triton whose interpreter differs; leave it as it is

    def patch_lang_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patch_lang_tensor
    _INDEX_MENDED = True


def interpreter_active() -> bool:
    """Whether Triton kernels run under the interpreter in this process."""
    if "triton" not in sys.modules:
        return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
    from triton import knobs

    return bool(knobs.runtime.interpret)


def mend_bf16_dot() -> None:
    global _MENDED
    if _MENDED:
        return
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return  # no Triton: nothing to interpret
    builder = getattr(interpreter, "InterpreterBuilder", None)
    convert = getattr(interpreter, "_convert_float", None)
    original = getattr(builder, "create_dot", None)
    if builder is None or convert is None or original is None:
        return  # a Triton whose interpreter differs; leave it as it is

    def widened(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        data = convert(handle.data, tl.bfloat16, tl.float32, None).view(np.float32).reshape(handle.data.shape)
        return interpreter.TensorHandle(data, tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16 or b.dtype.scalar == tl.bfloat16:
            a, b = widened(a), widened(b)
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot
    _MENDED = True


def mend_bf16_casts() -> None:
    """Round the interpreter's fp32 -> bf16 casts to nearest even (NaN stays NaN), as the GPU does."""
    global _CASTS_MENDED
    if _CASTS_MENDED:
        return
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    builder = getattr(interpreter, "InterpreterBuilder", None)
    truncating = getattr(builder, "cast_impl", None)
    if truncating is None:
        return

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return truncating(self, src, dst_type)
        values = np.asarray(src.data, dtype=np.float32)
        bits = values.view(np.uint32).astype(np.uint64)  # no wrap-around for the largest patterns
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # ties to the even pattern
        return interpreter.TensorHandle(np.where(np.isnan(values), np.uint16(0x7FC0), rounded), dst_type.scalar)

    builder.cast_impl = cast_impl
    _CASTS_MENDED = True


def mend_fp8_casts() -> None:
    """Round the interpreter's casts to e4m3 and e5m2 to nearest even, saturating at the largest
    finite value (NaN stays NaN), as the GPU's cvt.rn.satfinite does; other casts as they were."""
    global _FP8_MENDED
    if _FP8_MENDED:
        return
    try:
        import numpy as np
        import torch
        import triton.language as tl
        from triton._C.libtriton import ir
        from triton.runtime import interpreter
    except ImportError:
        return
    builder = getattr(interpreter, "InterpreterBuilder", None)
    faulty = getattr(builder, "create_fp_to_fp", None)
    if faulty is None:
        return
    targets = {tl.float8e4nv: (torch.float8_e4m3fn, 448.0), tl.float8e5: (torch.float8_e5m2, 57344.0)}

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        target = targets.get(dst_type.scalar)
        source = src.dtype.scalar
        if target is None or rounding_mode != ir.ROUNDING_MODE.RTNE or \
                source not in (tl.float32, tl.float16, tl.bfloat16):
            return faulty(self, src, dst_type, rounding_mode)
        data = np.asarray(src.data)
        if source == tl.bfloat16:  # stored as its uint16 pattern: the high half of an fp32
            data = (data.astype(np.uint32) << 16).view(np.float32)
        values = torch.from_numpy(np.clip(data.astype(np.float32), -target[1], target[1]))
        return interpreter.TensorHandle(values.to(target[0]).view(torch.uint8).numpy(), dst_type.scalar)

    builder.create_fp_to_fp = create_fp_to_fp
    _FP8_MENDED = True


def mend_interpreter() -> None:
    """The bf16 and FP8 mends (and the loop-bound one where needed): what evaluate() applies
    before running kernels on a CPU."""
    mend_bf16_dot()
    mend_bf16_casts()
    mend_fp8_casts()
    if scalar_index_needs_mending():
        mend_scalar_index()

"""Quantize / dequantize operators: `kforge.ops.quant.quantize_fp8(x, granularity="row")` and friends.

Each is a `torch.library` custom op (`kforge::quantize_fp8`, ...) with a fake implementation,
so torch.compile sees one opaque node with the right output shapes. On CUDA tensors the
Triton kernels of `kforge.kernels.quant.quantize` run; anything they do not take (CPU
tensors, float64, blocks or groups that are not powers of two) runs the PyTorch reference of
`kforge.kernels.quant.formats`. Both give the same bits. Formats and layouts: see formats.py.

    q, scale = quantize_fp8(x, "row")                    # scale [..., 1]
    q, scale = quantize_fp8(x, "block", block=(128, 128))  # scale [ceil(R/128), ceil(C/128)]
    x_hat = dequantize_fp8(q, scale, block=(128, 128))
    qweight, scales = quantize_int4(w, group=128)         # W4A16 weights
    packed, scales = quantize_mxfp4(x); packed, block_scales, global_scale = quantize_nvfp4(x)
"""

from __future__ import annotations

import torch

from kforge.kernels.quant import formats
from kforge.kernels.quant.formats import MX_BLOCK, NV_BLOCK

GRANULARITIES = ("tensor", "row", "block")


def kernels_take(*tensors: torch.Tensor) -> bool:
    """Whether the Triton kernels take these tensors: CUDA, and floating inputs in fp16/bf16/fp32."""
    from kforge.kernels.quant.quantize import KERNEL_DTYPES

    return all(t.is_cuda and (not t.is_floating_point() or t.dtype in KERNEL_DTYPES or t.dtype in formats.FP8_DTYPES)
               for t in tensors)


def power_of_two(*values: int) -> bool:
    return all(v > 0 and v & (v - 1) == 0 for v in values)


def fp8_scale_shape(x: torch.Tensor, granularity: str, block: tuple[int, int]) -> tuple[int, ...]:
    if granularity == "tensor":
        return ()
    if granularity == "row":
        return (*x.shape[:-1], 1)
    return (-(-x.shape[0] // block[0]), -(-x.shape[1] // block[1]))


# -- FP8 ----------------------------------------------------------------------------------------

@torch.library.custom_op("kforge::quantize_fp8", mutates_args=())
def _quantize_fp8(x: torch.Tensor, granularity: str, dtype: torch.dtype,
                  block: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    from kforge.kernels.quant import quantize as kernels

    on_kernel = kernels_take(x)
    if granularity == "tensor":
        return (kernels.quantize_fp8_tensorwise_triton if on_kernel else formats.quantize_fp8_tensorwise)(x, dtype)
    if granularity == "row":
        return (kernels.quantize_fp8_rowwise_triton if on_kernel else formats.quantize_fp8_rowwise)(x, dtype)
    if on_kernel and power_of_two(*block) and block[1] <= kernels.MAX_BLOCK_COLS:
        return kernels.quantize_fp8_blockwise_triton(x, tuple(block), dtype)
    return formats.quantize_fp8_blockwise(x, tuple(block), dtype)


@_quantize_fp8.register_fake
def _(x, granularity, dtype, block):
    return x.new_empty(x.shape, dtype=dtype), x.new_empty(fp8_scale_shape(x, granularity, tuple(block)),
                                                          dtype=torch.float32)


def quantize_fp8(x: torch.Tensor, granularity: str = "row", dtype: torch.dtype = torch.float8_e4m3fn,
                 block=(1, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """(q fp8, scale fp32): one scale per tensor (0-d), per row ([..., 1]) or per block of 2-D x
    ([ceil(R/br), ceil(C/bc)]); scale = amax / fp8_max, 1.0 for a block of zeros."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    formats.check_float_input(x, min_dim=2 if granularity == "block" else 1)
    formats.check_fp8_dtype(dtype)
    if granularity == "block" and x.dim() != 2:
        raise ValueError(f"blockwise fp8 takes a 2-D x [R, C], got shape {tuple(x.shape)}")
    return _quantize_fp8(x, granularity, dtype, list(formats.check_block(block)))


@torch.library.custom_op("kforge::dequantize_fp8", mutates_args=())
def _dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, block: list[int] | None) -> torch.Tensor:
    if kernels_take(q, scale):
        from kforge.kernels.quant.quantize import dequantize_fp8_triton

        return dequantize_fp8_triton(q, scale, block)
    return formats.dequantize_fp8(q, scale, block).contiguous()


@_dequantize_fp8.register_fake
def _(q, scale, block):
    return q.new_empty(q.shape, dtype=torch.float32)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, block=None) -> torch.Tensor:
    """float32 q * scale; block=None for a 0-d or per-row [..., 1] scale, else quantize_fp8's block."""
    if not isinstance(q, torch.Tensor) or q.dtype not in formats.FP8_DTYPES:
        raise ValueError(f"q must be a float8_e4m3fn or float8_e5m2 tensor, got "
                         f"{q.dtype if isinstance(q, torch.Tensor) else type(q).__name__}")
    formats.check_dtype(scale, torch.float32, "scale")
    return _dequantize_fp8(q, scale, None if block is None else list(formats.check_block(block)))


# -- INT4 ---------------------------------------------------------------------------------------

@torch.library.custom_op("kforge::quantize_int4", mutates_args=())
def _quantize_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    if kernels_take(w) and power_of_two(group) and group >= 2:
        from kforge.kernels.quant.quantize import quantize_int4_triton

        return quantize_int4_triton(w, group)
    return formats.quantize_int4(w, group)


@_quantize_int4.register_fake
def _(w, group):
    n, k = w.shape
    return w.new_empty((n, k // 2), dtype=torch.uint8), w.new_empty((n, k // group), dtype=torch.bfloat16)


def quantize_int4(w: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(qweight uint8 [N, K // 2], scales bf16 [N, K // group]) for W [N, K], symmetric per group."""
    formats.check_float_input(w, "w", min_dim=2)
    if w.dim() != 2:
        raise ValueError(f"w must be 2-D [N, K], got shape {tuple(w.shape)}")
    formats.check_int4_group(w.shape[1], group)
    return _quantize_int4(w, group)


@torch.library.custom_op("kforge::dequantize_int4", mutates_args=())
def _dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    if kernels_take(qweight, scales) and power_of_two(group) and group >= 2:
        from kforge.kernels.quant.quantize import dequantize_int4_triton

        return dequantize_int4_triton(qweight, scales, group)
    return formats.dequantize_int4(qweight, scales, group)


@_dequantize_int4.register_fake
def _(qweight, scales, group):
    return qweight.new_empty((qweight.shape[0], 2 * qweight.shape[1]), dtype=torch.bfloat16)


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, group: int = 128) -> torch.Tensor:
    """bf16 [N, K] = q * scale (fp32 product, rounded once)."""
    formats.check_dtype(qweight, torch.uint8, "qweight")
    formats.check_dtype(scales, torch.bfloat16, "scales")
    if qweight.dim() != 2 or scales.dim() != 2 or scales.shape[0] != qweight.shape[0]:
        raise ValueError(f"qweight [N, K // 2] and scales [N, K // group] must be 2-D with the same N, got "
                         f"{tuple(qweight.shape)} and {tuple(scales.shape)}")
    formats.check_int4_group(2 * qweight.shape[1], group)
    if scales.shape[1] * group != 2 * qweight.shape[1]:
        raise ValueError(f"scales must be [N, K // group] = {(qweight.shape[0], 2 * qweight.shape[1] // group)}, "
                         f"got {tuple(scales.shape)}")
    return _dequantize_int4(qweight, scales, group)


# -- MXFP4 and NVFP4 ----------------------------------------------------------------------------

@torch.library.custom_op("kforge::quantize_mxfp4", mutates_args=())
def _quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if kernels_take(x):
        from kforge.kernels.quant.quantize import quantize_mxfp4_triton

        return quantize_mxfp4_triton(x)
    return formats.quantize_mxfp4(x)


@_quantize_mxfp4.register_fake
def _(x):
    return (x.new_empty((*x.shape[:-1], x.shape[-1] // 2), dtype=torch.uint8),
            x.new_empty((*x.shape[:-1], x.shape[-1] // MX_BLOCK), dtype=torch.uint8))


def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 [..., C // 2], E8M0 scales uint8 [..., C // 32])."""
    formats.check_float_input(x)
    formats.check_last_dim(x, MX_BLOCK, "MXFP4 blocks of 32")
    return _quantize_mxfp4(x)


@torch.library.custom_op("kforge::dequantize_mxfp4", mutates_args=())
def _dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    if kernels_take(packed, scales):
        from kforge.kernels.quant.quantize import dequantize_mxfp4_triton

        return dequantize_mxfp4_triton(packed, scales)
    return formats.dequantize_mxfp4(packed, scales)


@_dequantize_mxfp4.register_fake
def _(packed, scales):
    return packed.new_empty((*packed.shape[:-1], 2 * packed.shape[-1]), dtype=torch.float32)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [..., C] = e2m1 value * 2^(s - 127)."""
    formats.check_dtype(packed, torch.uint8, "packed")
    formats.check_dtype(scales, torch.uint8, "scales")
    if packed.dim() == 0 or scales.shape != (*packed.shape[:-1], 2 * packed.shape[-1] // MX_BLOCK):
        raise ValueError(f"MXFP4 scales must be [..., C // 32] for packed [..., C // 2]; got packed "
                         f"{tuple(packed.shape)}, scales {tuple(scales.shape)}")
    return _dequantize_mxfp4(packed, scales)


@torch.library.custom_op("kforge::quantize_nvfp4", mutates_args=())
def _quantize_nvfp4(x: torch.Tensor, global_scale: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if kernels_take(x):
        from kforge.kernels.quant.quantize import quantize_nvfp4_triton

        packed, block_scales, used = quantize_nvfp4_triton(x, global_scale)
    else:
        packed, block_scales, used = formats.quantize_nvfp4(x, global_scale)
    return packed, block_scales, used if global_scale is None else used.clone()  # never a view of an input


@_quantize_nvfp4.register_fake
def _(x, global_scale):
    return (x.new_empty((*x.shape[:-1], x.shape[-1] // 2), dtype=torch.uint8),
            x.new_empty((*x.shape[:-1], x.shape[-1] // NV_BLOCK), dtype=torch.float8_e4m3fn),
            x.new_empty((), dtype=torch.float32))


def quantize_nvfp4(x: torch.Tensor, global_scale=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed uint8 [..., C // 2], block_scales float8_e4m3fn [..., C // 16], global_scale fp32 0-d);
    global_scale = amax(x) / (6 * 448) unless given."""
    formats.check_float_input(x)
    formats.check_last_dim(x, NV_BLOCK, "NVFP4 blocks of 16")
    if global_scale is not None:
        global_scale = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device)
        if global_scale.numel() != 1:
            raise ValueError(f"global_scale must be one value, got shape {tuple(global_scale.shape)}")
        global_scale = global_scale.reshape(())
    return _quantize_nvfp4(x, global_scale)


@torch.library.custom_op("kforge::dequantize_nvfp4", mutates_args=())
def _dequantize_nvfp4(packed: torch.Tensor, block_scales: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    if kernels_take(packed, block_scales, global_scale):
        from kforge.kernels.quant.quantize import dequantize_nvfp4_triton

        return dequantize_nvfp4_triton(packed, block_scales, global_scale)
    return formats.dequantize_nvfp4(packed, block_scales, global_scale)


@_dequantize_nvfp4.register_fake
def _(packed, block_scales, global_scale):
    return packed.new_empty((*packed.shape[:-1], 2 * packed.shape[-1]), dtype=torch.float32)


def dequantize_nvfp4(packed: torch.Tensor, block_scales: torch.Tensor, global_scale) -> torch.Tensor:
    """float32 [..., C] = e2m1 value * (block_scale * global_scale)."""
    formats.check_dtype(packed, torch.uint8, "packed")
    formats.check_dtype(block_scales, torch.float8_e4m3fn, "block_scales")
    if packed.dim() == 0 or block_scales.shape != (*packed.shape[:-1], 2 * packed.shape[-1] // NV_BLOCK):
        raise ValueError(f"NVFP4 block_scales must be [..., C // 16] for packed [..., C // 2]; got packed "
                         f"{tuple(packed.shape)}, block_scales {tuple(block_scales.shape)}")
    global_scale = torch.as_tensor(global_scale, dtype=torch.float32, device=packed.device).reshape(())
    return _dequantize_nvfp4(packed, block_scales, global_scale)

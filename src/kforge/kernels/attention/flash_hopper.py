"""FlashAttention forward for Hopper in CUDA (`flash_hopper.cu`): the launcher.

    out, lse = flash_attention_hopper(q, k, v, causal=True)

The same contract as the Triton forward (`flash_forward.flash_attention_forward`): q is
(batch, heads, n_q, d), k and v (batch, kv_heads, n_k, d) with kv_heads dividing heads; any
strides with a contiguous last dimension and 16-byte aligned starts and strides (TMA reads
them through 4-D tensor maps over (batch, head, seq, dim), so no copy is made); causal is
top-left aligned as SDPA's is_causal; `scale` defaults to 1/sqrt(d). O comes back in q's dtype
and layout, LSE as fp32 (batch, heads, n_q), the natural log of each row's softmax denominator.

What it takes (first version, issue 35): bf16 and fp16, head dims 64 and 128, sm_90 (the kernel
is compiled for sm_90a: wgmma, TMA, setmaxnreg). Anything else is refused with a ValueError
naming what to change: on another GPU or on the CPU, `flash_forward.flash_attention_forward`
is the kernel to call. tests/kernels/test_flash_hopper.py checks the compiled code on any
machine and the numbers on the GPU; measured on the H200 at 361-680 TFLOP/s, 0.81-1.06x cuDNN
(docs/attention.md), which is why `kforge.ops.flash_attention` takes it at head dim 128 only.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from functools import cache
from pathlib import Path

import torch

from kforge.kernels.attention.flash_forward import LOG2E, check_attention_inputs, tma_compatible

SOURCE = Path(__file__).with_name("flash_hopper.cu")
KERNEL = "flash_forward"
# The kernel's lambdas carry no execution space; NVRTC 13.0 (the H200 image's) then takes them for host
# code and refuses the source, where 13.5 compiles it as is.
OPTIONS = ("-default-device",)
HEAD_DIMS = (64, 128)
DTYPES = {torch.bfloat16: 0, torch.float16: 1}  # -> FP16
BLOCK_M, BLOCK_N, THREADS = 128, 128, 384  # query rows a CTA, keys a tile; one producer and two consumer warpgroups
MAX_GRID_YZ = 65535  # heads and batch are the grid's y and z


def kernel_defines(head_dim: int, causal: bool, dtype: torch.dtype) -> dict[str, int]:
    """The build of flash_hopper.cu for one head dim, causal or not, bf16 or fp16."""
    return {"HEAD_DIM": head_dim, "CAUSAL": int(causal), "FP16": DTYPES[dtype]}


def shared_bytes(defines: Mapping[str, int]) -> int:
    """SHARED_BYTES of the source for these defines: the Q tile, STAGES K tiles and V_STAGES
    V tiles (one more than K's unless given), 1024 bytes of alignment slack, the barriers."""
    from kforge.runtime.cuda import integer_defines

    p = {**integer_defines(SOURCE), **defines}
    v_stages = p.get("V_STAGES", p["STAGES"] + 1)
    tile = BLOCK_N * p["HEAD_DIM"]
    stages = p["STAGES"] + v_stages
    return 2 * (BLOCK_M * p["HEAD_DIM"] + stages * tile) + 1024 + 8 * (1 + 2 * stages)


def check_hopper_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> float:
    """Raise ValueError (one line) on anything this kernel cannot take; return the softmax scale."""
    scale = check_attention_inputs(q, k, v, scale)  # shapes, GQA, strides, scale: as the Triton forward
    if q.dtype not in DTYPES:
        raise ValueError(f"flash_attention_hopper takes bfloat16 or float16, got {q.dtype} (the Triton forward "
                         "takes float32)")
    if q.shape[3] not in HEAD_DIMS:
        raise ValueError(f"flash_attention_hopper takes head_dim 64 or 128, got {q.shape[3]} (the Triton forward "
                         "takes 16 to 256)")
    if q.shape[1] > MAX_GRID_YZ or q.shape[0] > MAX_GRID_YZ:
        raise ValueError(f"flash_attention_hopper takes at most {MAX_GRID_YZ} heads and batches, got "
                         f"{q.shape[1]} and {q.shape[0]}")
    if max(q.shape[2], k.shape[2]) >= 2**31:
        raise ValueError(f"flash_attention_hopper: sequence lengths {q.shape[2]}, {k.shape[2]} are beyond its "
                         "32-bit coordinates")
    if not q.is_cuda:
        raise ValueError(f"flash_attention_hopper runs on a CUDA device (sm_90); q is on {q.device} (on the CPU, "
                         "use flash_forward.flash_attention_forward)")
    if torch.cuda.get_device_capability(q.device) != (9, 0):
        major, minor = torch.cuda.get_device_capability(q.device)
        raise ValueError(f"flash_attention_hopper needs a Hopper GPU (sm_90, for wgmma and TMA); {q.device} is "
                         f"sm_{major}{minor} (use flash_forward.flash_attention_forward)")
    return scale


@cache
def _kernel(head_dim: int, causal: bool, dtype: torch.dtype):
    from kforge.runtime.cuda import CudaKernel

    return CudaKernel.from_file(SOURCE, KERNEL, defines=kernel_defines(head_dim, causal, dtype), options=OPTIONS)


@cache
def _launch(head_dim: int, causal: bool, dtype: torch.dtype, grid: tuple[int, int, int], index: int):
    kinds = ("map", "map", "map", "map", "ptr", "i32", "i32", "i32", "i32", "f32")
    return _kernel(head_dim, causal, dtype).lean(grid, THREADS, index, kinds=kinds,
                                                  shared_bytes=shared_bytes(kernel_defines(head_dim, causal, dtype)))


def _tensor_map(t: torch.Tensor, box_rows: int) -> tuple[ctypes.Array, int]:
    """A 4-D TMA descriptor over t (batch, heads, seq, dim): boxes of 64 dim values (128 bytes,
    swizzled as wgmma reads them) by `box_rows` rows of one head; reads past seq come back as
    zeros and writes past it are dropped. Returns the descriptor's storage and its (64-byte
    aligned) address, which the launch passes by value."""
    from kforge.runtime.driver import (DATA_TYPES, SWIZZLES, TENSOR_MAP_ALIGN, TENSOR_MAP_BYTES, DriverError,
                                       libcuda)

    raw = ctypes.create_string_buffer(TENSOR_MAP_BYTES + TENSOR_MAP_ALIGN)
    address = -(-ctypes.addressof(raw) // TENSOR_MAP_ALIGN) * TENSOR_MAP_ALIGN
    size = t.element_size()
    dims = (ctypes.c_uint64 * 4)(t.shape[3], t.shape[2], t.shape[1], t.shape[0])  # innermost first
    strides = (ctypes.c_uint64 * 3)(t.stride(2) * size, t.stride(1) * size, t.stride(0) * size)
    box = (ctypes.c_uint32 * 4)(64, box_rows, 1, 1)
    unit = (ctypes.c_uint32 * 4)(1, 1, 1, 1)
    status = libcuda().cuTensorMapEncodeTiled(address, DATA_TYPES[str(t.dtype).removeprefix("torch.")], 4,
                                              t.data_ptr(), dims, strides, box, unit, 0, SWIZZLES[128], 0, 0)
    if status:
        raise DriverError(f"cuTensorMapEncodeTiled (4-D {tuple(t.shape)}, strides {t.stride()}) failed: CUresult "
                          f"{status}")
    return raw, address


def flash_attention_hopper(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                           scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, LSE) for q (B, H, Nq, d), k and v (B, Hkv, Nk, d), Hkv dividing H, with the CUDA kernel."""
    scale = check_hopper_inputs(q, k, v, scale)
    batch, heads, n_q, dim = q.shape
    out = torch.empty_like(q)
    if not tma_compatible(out):  # empty_like keeps q's layout when it can; else start dense
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads, n_q), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    maps = [_tensor_map(q, BLOCK_M), _tensor_map(k, BLOCK_N), _tensor_map(v, BLOCK_N), _tensor_map(out, 64)]
    grid = (-(-n_q // BLOCK_M), heads, batch)
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    launch = _launch(dim, bool(causal), q.dtype, grid, index)
    launch(torch.cuda.current_stream(q.device).cuda_stream, *(address for _, address in maps), lse.data_ptr(),
           n_q, k.shape[2], heads, heads // k.shape[1], scale * LOG2E)
    return out, lse


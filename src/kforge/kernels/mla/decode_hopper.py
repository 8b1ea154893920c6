"""MLA decode on Hopper in CUDA (`decode_hopper.cu`): the launcher.

    out, lse = mla_decode_hopper(q, kv_cache, block_table, cache_seqlens, causal=True)

`decode.mla_decode`'s contract (FlashMLA's) for the shapes it was built for: DeepSeek's 576 /
512 head dims, a bf16 or fp16 cache paged in pages of 64, 128 or 256 tokens, on an sm_90 GPU.
Kernel 1 is the CUDA kernel (64 query rows and a split of one request's tokens a CTA, products
on wgmma: the .cu's header says how); kernel 2 is decode.py's combine, unchanged. Splits follow
decode.py's waves rule with one CTA an SM (the kernel's ~223 KB of shared memory): by default
sized on the device from the actual lengths (decode.py's schedule kernel in front; a CTA whose
split is past its request's items exits at once), or with `split_size` on the host from the
block table's width. `mla_decode(..., backend="cuda")` calls this; `backend="auto"` takes it
where `hopper_unsupported` finds nothing against it.
"""

from __future__ import annotations

import math
from functools import cache, lru_cache
from pathlib import Path

import torch

from kforge.device import sm_count
from kforge.kernels.mla.decode import (LOG2E, MAX_COMBINE_BLOCK, _empty, _wave_split, check_mla_inputs,
                                       check_mla_table_values, chunks_for, launch_schedule,
                                       mla_decode_combine_kernel)

SOURCE = Path(__file__).with_name("decode_hopper.cu")
KERNEL = "mla_decode_hopper"
OPTIONS = ("-default-device",)
HEAD_DIM, HEAD_DIM_V = 576, 512
BLOCK_M = BLOCK_N = 64
THREADS = 384  # a producer warpgroup and two consumers
PAGE_SIZES = (64, 128, 256)
DTYPES = {torch.bfloat16: 0, torch.float16: 1}  # -> FP16


def kernel_defines(causal: bool, dtype: torch.dtype, page_size: int, scheduled: bool = False) -> dict[str, int]:
    """The build of decode_hopper.cu for one causal rule, dtype, page size, and split source."""
    return {"CAUSAL": int(causal), "FP16": DTYPES[dtype], "PAGE_SIZE": page_size, "SCHEDULED": int(scheduled)}


def shared_bytes(defines: dict[str, int]) -> int:
    """SHARED_BYTES of the source: the Q tile and STAGES cache tiles (64 x 576 each; P takes a
    stage's RoPE chunk), the row maxima and sums of both consumers, the barriers, 1024 bytes of
    alignment slack."""
    from kforge.runtime.cuda import integer_defines

    p = {**integer_defines(SOURCE), **defines}
    return 2 * (1 + p["STAGES"]) * BLOCK_N * HEAD_DIM + 16 * BLOCK_M + 8 * (1 + 2 * p["STAGES"]) + 1024


def hopper_unsupported(q: torch.Tensor, kv_cache: torch.Tensor, head_dim_v: int, scale: float) -> str | None:
    """Why the CUDA kernel cannot take these (already checked) inputs, or None: the dtype, the head
    dims, the page size, a cache whose pages are not packed rows (TMA reads it as one (pages x
    page_size, 576) matrix), q's start off 16 bytes, a pool past 32-bit row coordinates, a scale
    not above 0 (the kernel takes each row's max before scaling), the device (checked last, so each
    other reason reads the same on a CPU)."""
    if q.dtype not in DTYPES:
        return f"takes bfloat16 or float16, not {q.dtype}"
    if q.shape[3] != HEAD_DIM or head_dim_v != HEAD_DIM_V:
        return f"takes head dims {HEAD_DIM} / {HEAD_DIM_V} (DeepSeek's), not {q.shape[3]} / {head_dim_v}"
    pages, page_size = kv_cache.shape[:2]
    if page_size not in PAGE_SIZES:
        return f"takes pages of {', '.join(map(str, PAGE_SIZES))} tokens, not {page_size}"
    row = kv_cache.stride(1) * kv_cache.element_size()
    if kv_cache.stride(0) != page_size * kv_cache.stride(1) or row % 16 or kv_cache.data_ptr() % 16:
        return f"needs pages of packed, 16-byte aligned rows (strides {kv_cache.stride()})"
    if q.is_contiguous() and q.data_ptr() % 16:  # (a strided q is copied into a new, aligned one)
        return "needs q to start on 16 bytes (TMA)"
    if pages * page_size >= 2**31 or q.shape[0] * q.shape[1] * q.shape[2] >= 2**31:
        return "pool or query rows past 32-bit coordinates"
    if not scale > 0:
        return f"takes a softmax scale above 0, not {scale}"
    if not q.is_cuda or torch.cuda.get_device_capability(q.device) != (9, 0):
        return "needs a Hopper GPU (sm_90: wgmma and TMA)"
    return None


def plan_splits(batch: int, rows: int, max_tokens: int, num_sms: int) -> tuple[int, int]:
    """(split_size, num_splits): decode.py's waves rule for one 64-row CTA an SM."""
    programs = batch * math.ceil(rows / BLOCK_M)
    split_size = _wave_split(programs, max_tokens, BLOCK_N, num_sms)
    return split_size, max(1, math.ceil(max_tokens / split_size))


def schedule_chunks(batch: int, rows: int, max_tokens: int, num_sms: int) -> int:
    """The most items a request may get from the device schedule (the grid's y), or 0 for the host
    plan alone: decode.chunks_for with one CTA an SM."""
    _, splits = plan_splits(batch, rows, max_tokens, num_sms)
    return chunks_for(splits, batch * math.ceil(rows / BLOCK_M), num_sms, batch, max_tokens)


@cache
def _kernel(defines: tuple):
    from kforge.runtime.cuda import CudaKernel

    return CudaKernel.from_file(SOURCE, KERNEL, defines=dict(defines), options=OPTIONS)


@lru_cache(maxsize=64)  # (grids differ by batch: bounded, not one a batch size forever)
def _launch(defines: tuple, grid: tuple[int, int], index: int):
    kinds = ("map", "map") + ("ptr",) * 7 + ("i32",) * 6 + ("f32",)
    return _kernel(defines).lean(grid, THREADS, index, kinds=kinds, shared_bytes=shared_bytes(dict(defines)))


@lru_cache(maxsize=32)
def _maps(dtype: torch.dtype, rows: int, row_stride_bytes: int, l2_bytes: int):
    from kforge.runtime.driver import TensorMaps

    return TensorMaps(str(dtype).removeprefix("torch."), rows, HEAD_DIM, row_stride_bytes, (64, 64),
                      l2_promotion_bytes=l2_bytes)


def mla_decode_hopper(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                      cache_seqlens: torch.Tensor, head_dim_v: int = HEAD_DIM_V, *, softmax_scale: float | None = None,
                      causal: bool = False, validate: bool = True,
                      split_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (batch, s_q, h_q, 512), lse (batch, h_q, s_q) fp32), as `decode.mla_decode`.
    `split_size` (a multiple of 64) fixes the splits on the host instead of the device schedule."""
    scale = check_mla_inputs(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale)
    reason = hopper_unsupported(q, kv_cache, head_dim_v, scale)
    if reason:
        raise ValueError(f"mla_decode_hopper {reason} (decode.mla_decode's Triton kernels take the rest)")
    return run_checked(q, kv_cache, block_table, cache_seqlens, head_dim_v, scale, causal, validate, split_size)


def run_checked(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor,
                head_dim_v: int, scale: float, causal: bool, validate: bool,
                split_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`mla_decode_hopper` on inputs `check_mla_inputs` and `hopper_unsupported` have passed (its
    softmax scale resolved): what `decode.mla_decode` calls after its own checks, not repeating them."""
    if validate:
        check_mla_table_values(block_table, cache_seqlens, kv_cache.shape[0], kv_cache.shape[1])
    batch, s_q, h_q, _ = q.shape
    out = _empty((batch, s_q, h_q, head_dim_v), q.dtype, q.device)
    lse = _empty((batch, h_q, s_q), torch.float32, q.device)
    if batch == 0:
        return out, lse
    q = q.contiguous()  # TMA reads it as (batch s_q h_q, 576) rows; decode's queries are contiguous already
    pages, page_size = kv_cache.shape[:2]
    rows, max_pages = s_q * h_q, block_table.shape[1]
    max_tokens = max_pages * page_size
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    num_sms = sm_count(index)
    m_blocks = math.ceil(rows / BLOCK_M)
    chunks = schedule_chunks(batch, rows, max_tokens, num_sms) if split_size is None else 0
    if chunks:  # splits sized on the device from the lengths (decode.py's schedule kernel, one CTA an SM)
        schedule = launch_schedule(cache_seqlens, max_tokens, m_blocks, num_sms, chunks, BLOCK_N)
        part_out = _empty((batch * chunks, rows, head_dim_v), torch.float32, q.device)
        part_lse = _empty((batch * chunks, rows), torch.float32, q.device)
        num_splits, split_size = chunks, BLOCK_N  # (split_size unread)
    else:
        schedule = cache_seqlens  # unread
        if split_size is None:
            split_size, num_splits = plan_splits(batch, rows, max_tokens, num_sms)
        else:
            if split_size < BLOCK_N or split_size % BLOCK_N:
                raise ValueError(f"split_size must be a positive multiple of {BLOCK_N}, got {split_size}")
            num_splits = max(1, math.ceil(max_tokens / split_size))
        if num_splits > 65535:
            raise ValueError(f"{num_splits} splits exceed the grid's 65535: use larger splits")
        if num_splits > 1:
            part_out = _empty((batch, rows, num_splits, head_dim_v), torch.float32, q.device)
            part_lse = _empty((batch, rows, num_splits), torch.float32, q.device)
        else:
            part_out = part_lse = lse  # not written with one split
    element = q.element_size()
    q_map = _maps(q.dtype, batch * rows, HEAD_DIM * element, 0).address_of(q.data_ptr())
    cache_map = _maps(q.dtype, pages * page_size, kv_cache.stride(1) * element, 256).address_of(kv_cache.data_ptr())
    defines = tuple(sorted(kernel_defines(causal, q.dtype, page_size, bool(chunks)).items()))
    _launch(defines, (batch * m_blocks, num_splits), index)(
        torch.cuda.current_stream(q.device).cuda_stream, q_map, cache_map, block_table.data_ptr(),
        cache_seqlens.data_ptr(), out.data_ptr(), lse.data_ptr(), part_out.data_ptr(), part_lse.data_ptr(),
        schedule.data_ptr(), block_table.stride(0), h_q, s_q, max_pages, num_splits, split_size, scale * LOG2E)
    if chunks or num_splits > 1:
        mla_decode_combine_kernel[(batch * rows,)](
            part_out, part_lse, cache_seqlens, out, lse, h_q, s_q, max_tokens, num_splits, split_size, schedule,
            D_V=head_dim_v, BLOCK_S=min(MAX_COMBINE_BLOCK, 1 << (num_splits - 1).bit_length()),
            SCHEDULED=bool(chunks), num_warps=4)
    return out, lse

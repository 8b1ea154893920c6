"""FP8 GEMM on Hopper in Triton: C = (a_scale * A) @ (b_scale * B)^T, three ways to scale.

Operands as a linear layer keeps them: A [M, K] and B [N, K] float8_e4m3fn, both row-major,
so both are K-major, the only layout fp8 wgmma reads (there is no transposed fp8 operand);
C [M, N] bf16 (or fp16, fp32). The scales are fp32, as `formats.py` makes them:

    "tensor": a_scale, b_scale 0-d            C = sa * sb * (A @ B^T)
    "row":    a_scale [M, 1], b_scale [N, 1]  C[m, n] = sa[m] * sb[n] * (A @ B^T)[m, n]
    "block":  a_scale [M, K/128] (1 x 128 tiles of A, DeepGEMM's activations),
              b_scale [ceil(N/128), K/128] (128 x 128 blocks of B, its weights)
              C[m, n] = sum_j sa[m, j] * sb[n // 128, j] * (A_j @ B_j^T)[m, n]

where A_j, B_j are the j-th 128-wide slices along K. Tensor and row scales leave the sum,
so they multiply the finished accumulator once, in the epilogue. Block scales change every
128 along K, so they cannot: each 128-deep K step is its own wgmma chain into a fresh
accumulator `partial` (four k32 instructions), which is then scaled and added to the
running fp32 sum on the CUDA cores, `acc += partial * (sa * sb)`. That is DeepGEMM's
promotion, and it is also why BK is 128 (one scale block per step).

Promotion is about precision as much as scales. Hopper's fp8 wgmma does not keep a full
fp32 sum: it aligns the products to the largest term with about 14 bits (DeepSeek-V3
report, section 3.3.2), so a sum over K = 16384 carried inside the tensor cores drifts by a
fraction of a percent. A fresh accumulator per 128-K step only ever adds 128 products; the
long sum is real fp32. Tensor and row scaling promote the same way (`acc += partial`), as
cuBLAS does without its fast-accumulation flag; `fast_accum=True` keeps the sum in the
tensor cores instead (one accumulator, `acc = dot(a, b, acc)`), as torch._scaled_mm's
use_fast_accum=True does: faster, less exact.

Registers decide the tile. A warpgroup (4 warps) owns 64 rows; with promotion it holds the
running sum AND the partial. A 128 x 256 tile on 8 warps would need 128 + 128 fp32
registers a thread for those alone (the limit is 255), so a wide tile is walked in
SPLIT_N column slices: acc0, acc1 (the two 128-wide halves, 64 registers each) and one
64-register partial at a time, 192 in all. Each half lies inside one 128-wide block of
b_scale, so its weight scale is one scalar per K step; a's scales are a BM-vector, loaded
before the wgmma so that its latency hides behind it. Both come through plain loads
(L2-resident: 2 MB of a_scale at the shape below), A and B through TMA.

The schedule is triton_matmul's (gemm_bf16/triton_matmul.py): persistent, one program per
SM over grouped tiles, A and B through TMA descriptors built on the device, a num_stages
ring of shared memory. C is stored through masked pointers (any N; a TMA store would need
a 64 KB staging tile that 4 stages of 48 KB leave no room for).

What Triton 3.6 makes of it (sm_90 code read on CPU, 2026-11-21; the tests keep checking
it): the K loop of the 128 x 256 block-scaled tile is 275 instructions a warp: 8
QGMMA.64x128x32.E4M3 (four a slice), 128 FFMA (the promotion, scale product fused), 4
scale loads, the TMA issue, and a wgmma drain plus a CTA barrier after each slice. Triton
waits for a dot's result right after issuing it when the result is not a loop-carried
accumulator (checked: a hand-delayed promotion, dot k+1 issued before promoting k, still
got wait(0) at once), and the barrier keeps the two warpgroups in step: the tensor cores
idle while both promote. That is the cost DeepGEMM hides with warp specialization (one
warpgroup promotes while the other's wgmma runs) and what a CUDA port of the hot path
would buy.

Predicted on the H100 (not measured here): at M=4096, N=7168, K=16384 (2*M*N*K = 0.96
PFLOP; A and B 184 MB, read from L2 many times over: compute-bound) a 128-K step of the
128 x 256 tile needs ~1024 tensor-core cycles (8192 fp8 FLOP per SM a cycle at 1979
TFLOP/s) and ~400-500 more in series (2 x 128 FFMA issue cycles with two warps a
scheduler, two drains, four barriers): ~65-70% of the rate a fast-accumulation kernel
gets. Triton's fast-accumulation fp8 GEMMs reach ~1300 TFLOP/s on an H100 (ANCHORS.md),
so ~850-1000 TFLOP/s for block scaling, short of issue 8's 1200; torch._scaled_mm
rowwise (CUTLASS, promoted) is likely ~1100-1300 there: ~0.7-0.85x of it, not >= 1.0x.
Rowwise promoted costs the same minus the multiplies (FADD); fast accumulation should be
near Triton's ~1300.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kforge.device import sm_count
from kforge.kernels.quant.formats import dequantize_fp8
from kforge.runtime.interpreter import interpreter_active

SCALINGS = ("tensor", "row", "block")
SCALE_BLOCK = 128  # K (and N, for B) covered by one block scale
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INTERPRETER_PROGRAMS = 4
INTERPRETER_CONFIG = {"BM": 32, "BN": 64, "SPLIT_N": 1, "GROUP_M": 4}  # the autotuner needs a GPU


def _descriptor_scratch(size: int, alignment: int, stream):
    """Global memory for the device-built TMA descriptors of one launch (Triton asks per launch)."""
    return torch.empty(size, dtype=torch.int8, device="cuda" if torch.cuda.is_available() else "cpu")


triton.set_allocator(_descriptor_scratch)


@triton.jit
def _grouped_tile(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    # GROUP_M tile rows at a time, column by column inside a group: the tiles in flight
    # share panels of A and B in L2.
    per_group = GROUP_M * tiles_n
    first = (tile // per_group) * GROUP_M
    rows = tl.minimum(tiles_m - first, GROUP_M)
    return first + (tile % per_group) % rows, (tile % per_group) // rows


@triton.jit
def _k_step(acc, a, b_desc, off_n, k, kb, row_scale, b_scale_ptr, N, k_blocks,
            SCALING: tl.constexpr, FAST_ACCUM: tl.constexpr):
    # One 128-deep K step of one column slice. The weight scale is loaded before the dot,
    # so its latency hides behind the wgmma; a slice past N loads scale 0 (and stores nothing).
    if SCALING == "block":
        sb = tl.load(b_scale_ptr + (off_n // 128) * k_blocks + kb, mask=off_n < N, other=0.0)
    b = b_desc.load([off_n, k]).T
    if FAST_ACCUM:
        acc = tl.dot(a, b, acc)
    elif SCALING == "block":
        acc += tl.dot(a, b) * (row_scale * sb)[:, None]
    else:
        acc += tl.dot(a, b)
    return acc


@triton.jit
def _store_slice(c_ptr, acc, rows, off_n, epilogue_scale, b_scale_ptr, M, N,
                 SCALING: tl.constexpr, SUB_N: tl.constexpr):
    # epilogue_scale: a's row scales (row), the product of the two scales (tensor), 1 (block)
    cols = off_n + tl.arange(0, SUB_N)
    if SCALING == "row":
        acc = acc * epilogue_scale[:, None] * tl.load(b_scale_ptr + cols, mask=cols < N, other=0.0)[None, :]
    elif SCALING == "tensor":
        acc = acc * epilogue_scale
    keep = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(c_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :],
             acc.to(c_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=keep)


@triton.jit
def fp8_gemm_kernel(a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, M, N, K, stride_asm, stride_ask, M_BUCKET,
                    NUM_PROGRAMS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    SPLIT_N: tl.constexpr, GROUP_M: tl.constexpr, FLATTEN: tl.constexpr,
                    SCALING: tl.constexpr, FAST_ACCUM: tl.constexpr):
    # A [M, K], B [N, K] row-major fp8; TMA boxes reaching past M, N or K load zeros. A tile
    # is BM x BN, computed as SPLIT_N slices of SUB_N columns (see the module docstring).
    # a_scale's strides are arguments: DeepGEMM keeps it M-major ([K/128, M] transposed),
    # which makes the per-step load of BM scales coalesced. M_BUCKET is only the autotuner's key.
    SUB_N: tl.constexpr = BN // SPLIT_N
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[K, 1], block_shape=[SUB_N, BK])
    tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    k_blocks = tl.cdiv(K, BK)
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, NUM_PROGRAMS, flatten=FLATTEN):
        tm, tn = _grouped_tile(tile, tiles_m, tiles_n, GROUP_M)
        off_m, off_n = tm * BM, tn * BN
        rows = off_m + tl.arange(0, BM)
        acc0 = tl.zeros((BM, SUB_N), dtype=tl.float32)
        acc1 = tl.zeros((BM, SUB_N), dtype=tl.float32)
        for kb in range(0, k_blocks):
            k = kb * BK
            if SCALING == "block":
                a_block_scale = tl.load(a_scale_ptr + rows * stride_asm + kb * stride_ask, mask=rows < M, other=0.0)
            else:
                a_block_scale = 1.0  # no scale inside the loop
            a = a_desc.load([off_m, k])
            acc0 = _k_step(acc0, a, b_desc, off_n, k, kb, a_block_scale, b_scale_ptr, N, k_blocks, SCALING,
                           FAST_ACCUM)
            if SPLIT_N == 2:
                acc1 = _k_step(acc1, a, b_desc, off_n + SUB_N, k, kb, a_block_scale, b_scale_ptr, N, k_blocks,
                               SCALING, FAST_ACCUM)
        if SCALING == "row":
            epilogue_scale = tl.load(a_scale_ptr + rows * stride_asm, mask=rows < M, other=0.0)
        elif SCALING == "tensor":
            epilogue_scale = tl.load(a_scale_ptr) * tl.load(b_scale_ptr)
        else:
            epilogue_scale = 1.0
        _store_slice(c_ptr, acc0, rows, off_n, epilogue_scale, b_scale_ptr, M, N, SCALING, SUB_N)
        if SPLIT_N == 2:
            _store_slice(c_ptr, acc1, rows, off_n + SUB_N, epilogue_scale, b_scale_ptr, M, N, SCALING, SUB_N)


def _config(bm, bn, split, stages, warps=8, flatten=False):
    return triton.Config({"BM": bm, "BN": bn, "BK": 128, "SPLIT_N": split, "GROUP_M": 8, "FLATTEN": flatten},
                         num_stages=stages, num_warps=warps)


# Shared memory is num_stages x (BM + BN) x 128 bytes plus the epilogue's scratch, within
# the 227 KB a block may use; tests/kernels/test_fp8_gemm.py compiles each for sm_90 and
# checks that, wgmma on e4m3 and a mainloop that never touches local memory (ptxas spills a
# few registers around the epilogue of the 255-register tiles, once per tile, not per K
# step). 128 x 256 in two slices is the big tile for promotion; 128 x 256 unsplit holds
# one accumulator, so it is for fast_accum only; 64 x 128 on one warpgroup is for M <= 64.
# Dropped after reading their sm_90 code: 128 x 256 with a flattened loop, and 64 x 256 on
# 4 warps (both spill inside the mainloop).
CONFIGS = [
    _config(128, 256, 2, 4), _config(128, 128, 1, 5), _config(128, 128, 1, 4, flatten=True),
    _config(64, 128, 1, 6, warps=4), _config(128, 256, 1, 4),
]


def _keep_configs(configs, named_args, **kwargs):
    """The autotuner's pruning (it passes the launch's keyword arguments, FAST_ACCUM among
    them): with promotion, a slice wider than 128 columns would spill."""
    promote = not kwargs["FAST_ACCUM"]
    return [c for c in configs if not (promote and c.kwargs["BN"] // c.kwargs["SPLIT_N"] > 128)]


fp8_gemm_autotuned = triton.autotune(CONFIGS, key=["M_BUCKET", "N", "K", "SCALING", "FAST_ACCUM"],
                                     prune_configs_by={"early_config_prune": _keep_configs})(fp8_gemm_kernel)
# Each shape's pick, once tuned: later calls launch it directly, without the autotuner's
# per-call dispatch (as triton_matmul does).
_TUNED: dict[tuple, dict] = {}


def check_fp8_gemm_operands(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
                            scaling: str) -> None:
    """Raise ValueError, in one line, unless (a, b, scales) is an fp8 GEMM of this scaling."""
    if scaling not in SCALINGS:
        raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}")
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float8_e4m3fn or t.dim() != 2:
            raise ValueError(f"{name} must be a 2-D torch.float8_e4m3fn tensor, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    (m, k), (n, kb) = a.shape, b.shape
    if k != kb or k == 0:
        raise ValueError(f"a is [M, K] = {tuple(a.shape)} and b is [N, K] = {tuple(b.shape)}: K must match and be > 0")
    for name, t in (("a_scale", a_scale), ("b_scale", b_scale)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
            raise ValueError(f"{name} must be a float32 tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    blocks = -(-k // SCALE_BLOCK)
    shapes = {"tensor": ((), ()), "row": ((m, 1), (n, 1)), "block": ((m, blocks), (-(-n // SCALE_BLOCK), blocks))}
    want_a, want_b = shapes[scaling]
    if tuple(a_scale.shape) != want_a or tuple(b_scale.shape) != want_b:
        raise ValueError(f"{scaling} scaling takes a_scale {list(want_a)} and b_scale {list(want_b)}, got "
                         f"{list(a_scale.shape)} and {list(b_scale.shape)}")
    if scaling == "block" and k % SCALE_BLOCK:
        raise ValueError(f"block scaling needs K (= {k}) to be a multiple of {SCALE_BLOCK}")
    devices = {t.device for t in (a, b, a_scale, b_scale)}
    if len(devices) != 1:
        raise ValueError(f"a, b and the scales must be on one device, got {sorted(map(str, devices))}")


def check_fp8_gemm_inputs(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
                          scaling: str, *, fast_accum: bool = False,
                          out_dtype: torch.dtype = torch.bfloat16) -> None:
    """check_fp8_gemm_operands, then what the kernel itself needs (TMA rows, the GPU)."""
    check_fp8_gemm_operands(a, b, a_scale, b_scale, scaling)
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    if scaling == "block" and fast_accum:
        raise ValueError("fast_accum applies to tensor and row scaling: block scales are applied per 128-K step")
    if a.shape[1] % 16:
        raise ValueError(f"K = {a.shape[1]}: TMA reads rows of a multiple of 16 bytes, so K must be a multiple of 16")
    if not (a.is_contiguous() and b.is_contiguous()) or a.data_ptr() % 16 or b.data_ptr() % 16:
        raise ValueError("a and b must be contiguous (row-major) and 16-byte aligned: TMA reads them")
    if a.is_cuda and torch.cuda.get_device_capability(a.device) < (9, 0):
        raise ValueError("the fp8 kernel needs a Hopper GPU (sm_90: wgmma and TMA)")
    if not (a.is_cuda or (a.device.type == "cpu" and interpreter_active())):
        raise ValueError(f"the kernel runs on a CUDA device, or on CPU under the Triton interpreter; a is on "
                         f"{a.device}")
    if a_scale.numel() >= 2**31:
        raise ValueError("a_scale has 2^31 elements or more: the kernel's offsets into it are 32-bit")


def fp8_gemm(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
             scaling: str = "block", *, fast_accum: bool = False, out_dtype: torch.dtype = torch.bfloat16,
             config: dict | None = None, prefer_cuda: bool = True) -> torch.Tensor:
    """C [M, N] = dequant(a) @ dequant(b)^T for fp8 e4m3 a [M, K], b [N, K] (see the module docstring).

    scaling: "tensor" (0-d scales), "row" (a_scale [M, 1], b_scale [N, 1]) or "block"
    (a_scale [M, K/128], b_scale [ceil(N/128), K/128]; a_scale may also be the transpose
    of a contiguous [K/128, M] tensor). fp32 accumulation, promoted every 128 K unless
    fast_accum. `config` (BM, BN, BK, SPLIT_N, GROUP_M, FLATTEN, num_stages, num_warps)
    skips the autotuner: the CPU tests run small tiles under the Triton interpreter. Block
    scaling to bf16 on a GPU (N a multiple of 8, no config) runs the CUDA kernel instead
    (`fp8_block_gemm.py`, 1.33x this one at 4096 x 7168 x 16384), unless prefer_cuda=False.
    """
    check_fp8_gemm_inputs(a, b, a_scale, b_scale, scaling, fast_accum=fast_accum, out_dtype=out_dtype)
    (m, k), n = a.shape, b.shape[0]
    if prefer_cuda and scaling == "block" and out_dtype == torch.bfloat16 and a.is_cuda and config is None \
            and n % 8 == 0:
        from kforge.kernels.quant.fp8_block_gemm import fp8_block_gemm

        return fp8_block_gemm(a, b, a_scale, b_scale)
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return c
    if scaling == "row":
        a_scale, b_scale = a_scale.reshape(m), b_scale.reshape(n).contiguous()
        stride_asm, stride_ask = a_scale.stride(0), 0
    elif scaling == "block":
        b_scale = b_scale.contiguous()
        stride_asm, stride_ask = a_scale.stride()
    else:
        stride_asm, stride_ask = 0, 0
    args = dict(SCALING=scaling, FAST_ACCUM=bool(fast_accum))
    shape_key = (m, n, k, scaling, bool(fast_accum), a.device)
    if config is None and shape_key in _TUNED:
        config = _TUNED[shape_key]
    if config is None and not a.is_cuda:
        config = INTERPRETER_CONFIG
    slots = sm_count(a.device) if a.is_cuda else INTERPRETER_PROGRAMS
    if config is None:
        fp8_gemm_autotuned[(slots,)](a, b, c, a_scale, b_scale, m, n, k, stride_asm, stride_ask,
                                     triton.next_power_of_2(m), NUM_PROGRAMS=slots, **args)
        if a.is_cuda:
            best = fp8_gemm_autotuned.best_config
            _TUNED[shape_key] = dict(best.kwargs, num_stages=best.num_stages, num_warps=best.num_warps)
        return c
    tiles = {name: config[name] for name in ("BM", "BN")}
    tiles.update(BK=config.get("BK", 128), SPLIT_N=config.get("SPLIT_N", 1), GROUP_M=config.get("GROUP_M", 8),
                 FLATTEN=config.get("FLATTEN", False))
    if scaling == "block" and tiles["BK"] != SCALE_BLOCK:
        raise ValueError(f"block scaling needs BK = {SCALE_BLOCK} (one scale block a K step), got {tiles['BK']}")
    sub_n = tiles["BN"] // tiles["SPLIT_N"]
    if tiles["SPLIT_N"] not in (1, 2) or (scaling == "block" and SCALE_BLOCK % sub_n):
        raise ValueError(f"SPLIT_N must be 1 or 2 and, for block scaling, BN / SPLIT_N must divide {SCALE_BLOCK}; "
                         f"got BN = {tiles['BN']}, SPLIT_N = {tiles['SPLIT_N']}")
    programs = min(slots, triton.cdiv(m, tiles["BM"]) * triton.cdiv(n, tiles["BN"]))
    fp8_gemm_kernel[(programs,)](a, b, c, a_scale, b_scale, m, n, k, stride_asm, stride_ask,
                                 triton.next_power_of_2(m), NUM_PROGRAMS=programs, **tiles, **args,
                                 num_stages=config.get("num_stages", 3), num_warps=config.get("num_warps", 4))
    return c


def fp8_gemm_reference(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
                       scaling: str = "block", out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The same product in PyTorch: dequantize both operands to fp32 (formats.dequantize_fp8),
    matmul in fp32, round once to out_dtype. The custom op runs this off the GPU."""
    a_block, b_block = ((1, SCALE_BLOCK), (SCALE_BLOCK, SCALE_BLOCK)) if scaling == "block" else (None, None)
    return (dequantize_fp8(a, a_scale, a_block) @ dequantize_fp8(b, b_scale, b_block).T).to(out_dtype)


def fp8_gemm_flops(m: int, n: int, k: int) -> int:
    """Tensor-core FLOPs of one fp8 GEMM: a multiply and an add per (m, n, k); the scaling's
    few per-output (or per-128-K) multiplies run on CUDA cores and are not counted."""
    return 2 * m * n * k

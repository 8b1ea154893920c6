"""FP8 weight-only GEMV: y = x @ dequant(q, scale).T for 1 to 16 token rows, x in bf16.

The weight W [N, K] is stored as `formats.quantize_fp8_blockwise(w, (128, 128))` makes it (the
engine's `Fp8Weight`, DeepGEMM's weight layout): q [N, K] float8_e4m3fn codes and scale
[ceil(N/128), K/128] fp32, one per 128 x 128 block, W ~ q * scale. x [M, K] and y [M, N] are bf16,
sums in fp32. x is NOT quantized: at decode the weight's bytes are the whole cost, and an fp8 x
would add a kernel and an error for nothing. K must be a multiple of 128 (the format's blocks);
N may end in a partial block.

What is computed: sum_k x[m, k] * q[n, k] * s[n // 128, k // 128], each q * x exact (q is an
e4m3 value, exact in bf16), the sum over each 128-k chunk multiplied by its scale. The eager
reference (`fp8_gemv_reference`) dequantizes W to fp32 first; the two differ by fp32 roundings
only, far below y's bf16 rounding.

Bytes per call: N * K (one a weight) + 4 * ceil(N/128) * K/128 (the scales, 1/4096 of it) + x and
y (kilobytes): half the bf16 GEMV's, so at decode the kernel is judged by bytes over time against
HBM bandwidth. FLOPs 2 M N K. At 3 TB/s an SM must take in ~13 weights a clock (132 SMs, ~1.75
GHz) and can issue 128 thread-instructions: ~9 a weight for decoding, multiplying and addressing.

Two kernels:

1. `fp8_gemv.cu` (CUDA, the GPU path): the weights enter the tensor cores as the rows of a bf16
   mma.sync (m16n8k16), the tokens as its columns, so the multiply costs the same at 1 token as
   at 8 (16: two n-tiles). A pair of e4m3 codes becomes a bf16 pair in four instructions (the
   hardware's e4m3 -> f16 pair conversion, two f16 -> f32, one pack to bf16x2, all exact): the
   sm_90 loop is ~3 instructions a weight at any batch, a third of the budget. Each lane loads 32
   contiguous bytes of a row per 128-k chunk (two 16-byte loads that skip L1); the k16 steps
   take the lane's k in an order the A and B fragments agree on, so x's bf16 pairs feed B as
   loaded. A block is 16 rows x all of K, its KW warps splitting K chunk by chunk and adding
   their sums in shared memory in a fixed order (one launch, deterministic). With 16 rows a
   block, N = 4096 is 256 blocks of 8 warps: ~16 warps an SM, each with one 2 KB chunk in flight
   while it computes the one before, ~32 KB an SM against the ~25 KB Little's law asks at 3.35
   TB/s and ~1 us. The launch is a kept lean launch (`runtime/driver.py`): a few microseconds of
   host time, and capturable in the decode step's CUDA graph.

2. `fp8_gemv_kernel` (Triton): where the CUDA kernel does not fit (unaligned rows), and under
   Triton's interpreter on a machine with no GPU, where the CPU tests run it. A program owns
   BLOCK_N rows (a divisor of 128, so they share a row of scales) for all tokens, loads fp8 codes
   with 16-byte loads, widens them to fp32 (Triton's conversion) and multiplies by x * scale,
   summing a (BLOCK_B, BLOCK_N, BLOCK_K) fp32 accumulator over K once at the end, as the bf16
   decode GEMV (`serving/gemv.py`) does.

Why 16 rows at most: x and y are M * (K + N) * 2 bytes, under 1% of W's at M = 16 on Llama
widths, so a GEMV still reads essentially W alone; the bf16 GEMV stops at 16 too, so every decode
bucket up to 16 takes a GEMV in every weight format. Above, a GEMM reads W once per 128 rows:
`fp8_gemm` (x quantized per 1 x 128 tile, fp8 tensor cores), or, in the Llama engine, the weight
dequantized onto the bf16 GEMM so that x is never quantized at any batch (`models/llama/model.py`).

Measured on the H100 (`scripts/fp8_gemv_sweep.py`, every variant against the bf16 GEMV on the
dequantized W and a read stream of the same bytes): at one token 44.7 us at N = 28672, K = 4096
(85% of copy; the bf16 GEMV 79.8 us), 10.7 us at 4096 x 4096 (launch-bound: a read stream of
the same bytes takes 10.2 us). On the H200 at one token, eight calls in a CUDA graph: 33.0-33.1 us
at 28672 x 4096 (3.55 TB/s, 84-85% of a read stream of the same bytes), 7.2-7.6 us at 4096 x 4096
(the read stream 6.8). `cuda_variant` holds the choices the sweeps made.
"""

from __future__ import annotations

from pathlib import Path

import torch
import triton
import triton.language as tl

from kforge.device import sm_count

MAX_BATCH = 16
SCALE_BLOCK = 128  # the format's block: 128 x 128 weights a scale
CODE_DTYPE = torch.float8_e4m3fn


# --- the Triton kernel -----------------------------------------------------------------------------

@triton.jit
def _gemv_step(acc, x_ptrs, q_ptrs, s_ptrs, k_index, k0, k_left, MASKED: tl.constexpr):
    """acc[b, n, k] += q[n, k0 + k] * (x[b, k0 + k] * s[k0 + k]) over one BLOCK_K step (k0 a multiple of 128)."""
    if MASKED:  # past K: codes, x and scales all 0
        inside = k_index < k_left
        q = tl.load(q_ptrs + k0, mask=inside, other=0.0)
        x = tl.load(x_ptrs + k0, mask=inside, other=0.0)
        s = tl.load(s_ptrs + k0 // 128, mask=inside, other=0.0)
    else:
        q = tl.load(q_ptrs + k0)
        x = tl.load(x_ptrs + k0)
        s = tl.load(s_ptrs + k0 // 128)
    return acc + q.to(tl.float32) * (x.to(tl.float32) * s)


@triton.jit
def fp8_gemv_kernel(x_ptr, q_ptr, s_ptr, y_ptr, batch, n_out, k_in, stride_xb, stride_qn, stride_sn, stride_yb,
                    BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # BLOCK_N divides 128 and BLOCK_K is a multiple of 128: a program's rows share one row of scales
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_b = tl.arange(0, BLOCK_B)
    k_index = tl.arange(0, BLOCK_K)[None, None, :]
    rows = tl.minimum(offs_n, n_out - 1)  # past the end: re-read the last row, never store it
    x_rows = tl.minimum(offs_b, batch - 1)
    q_ptrs = q_ptr + rows[None, :, None] * stride_qn + k_index  # [1, n, k]
    x_ptrs = x_ptr + x_rows[:, None, None] * stride_xb + k_index  # [b, 1, k]
    s_ptrs = s_ptr + (pid * BLOCK_N // 128) * stride_sn + k_index // 128  # [1, 1, k]
    acc = tl.zeros((BLOCK_B, BLOCK_N, BLOCK_K), tl.float32)
    k_full = k_in // BLOCK_K * BLOCK_K
    for k0 in range(0, k_full, BLOCK_K):
        acc = _gemv_step(acc, x_ptrs, q_ptrs, s_ptrs, k_index, k0, BLOCK_K, False)
    if k_full < k_in:
        acc = _gemv_step(acc, x_ptrs, q_ptrs, s_ptrs, k_index, k_full, k_in - k_full, True)
    y = tl.sum(acc, 2)
    keep = (offs_b[:, None] < batch) & (offs_n[None, :] < n_out)
    tl.store(y_ptr + offs_b[:, None] * stride_yb + offs_n[None, :], y.to(y_ptr.dtype.element_ty), mask=keep)


# On a GPU (the fallback): 16 codes a thread along K (16-byte loads), BLOCK_B * BLOCK_N = 8 rows of
# 512 k in the accumulator, 32 fp32 registers a thread at 4 warps. Under the interpreter: small tiles
# that still cut K into a full and a masked step in the tests.
TRITON_CONFIG = {"ROWS": 8, "BLOCK_K": 512, "num_warps": 4}
INTERPRETER_CONFIG = {"BLOCK_N": 4, "BLOCK_K": 256, "num_warps": 1}


def triton_tile(batch: int, config: dict | None, interpreted: bool) -> dict:
    """The Triton kernel's tile: `config` if given, else the interpreter's or the GPU fallback's."""
    if config is not None:
        return config
    if interpreted:
        return INTERPRETER_CONFIG
    block_n = max(1, TRITON_CONFIG["ROWS"] // triton.next_power_of_2(batch))
    return {"BLOCK_N": block_n, "BLOCK_K": TRITON_CONFIG["BLOCK_K"], "num_warps": TRITON_CONFIG["num_warps"]}


def launch_triton_gemv(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, y: torch.Tensor,
                       config: dict) -> None:
    """y (M, N) on `fp8_gemv_kernel` with `config`'s BLOCK_N (a power of two dividing 128), BLOCK_K
    (a multiple of 128) and num_warps."""
    batch, k = x.shape
    n = q.shape[0]
    block_n, block_k = config["BLOCK_N"], config["BLOCK_K"]
    if SCALE_BLOCK % block_n or block_k % SCALE_BLOCK or block_n & (block_n - 1) or block_k & (block_k - 1):
        raise ValueError(f"BLOCK_N must be a power of two dividing {SCALE_BLOCK} and BLOCK_K a power-of-two "
                         f"multiple of it, got {block_n} and {block_k}")
    fp8_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, q, scale, y, batch, n, k, x.stride(0), q.stride(0), scale.stride(0), y.stride(0),
        BLOCK_B=triton.next_power_of_2(batch), BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=config.get("num_warps", 4), num_stages=1)


# --- the CUDA kernel -------------------------------------------------------------------------------

CUDA_SOURCE = Path(__file__).with_name("fp8_gemv.cu")
CUDA_KINDS = ("ptr",) * 5 + ("i32",) * 8
CUDA_SHARED_LIMIT = 48 * 1024  # the cross-warp sums are static shared memory
_CUDA_KERNELS: dict[tuple, object] = {}
_CUDA_PLANS: dict[tuple, tuple] = {}
_CAPABILITY: dict[int, tuple[int, int]] = {}  # by device index (a query costs microseconds a call)


def capability(index: int) -> tuple[int, int]:
    if index not in _CAPABILITY:
        _CAPABILITY[index] = torch.cuda.get_device_capability(index)
    return _CAPABILITY[index]


def cuda_shared_bytes(m_tiles: int, n_tiles: int, k_warps: int) -> int:
    """`fp8_gemv.cu`'s shared memory: every warp but the first hands warp 0 its fp32 sums."""
    return max(k_warps - 1, 1) * m_tiles * n_tiles * 4 * 32 * 4


def cuda_variant(n: int, batch: int, sms: int) -> tuple[int, int, bool, int]:
    """(MT, KW, XPF, MINB) of `fp8_gemv.cu` for N rows, `batch` tokens, on a GPU of `sms` SMs: 16-row
    m-tiles a warp, warps a block (splitting K), whether x is loaded a chunk ahead with W, and the
    blocks an SM its registers are capped for.

    At up to 8 tokens (one n-tile), chosen on the H200 at one token (eight calls in a CUDA graph at
    the Llama-3-8B widths; nvidia-h200/gemv-one-token.txt, three runs):
    - x ahead over 8 warps, 2 blocks an SM, where the grid (one block per 16 rows) is one wave at 2
      blocks an SM: 4096 x 4096 7.2-7.6 us against 7.6-8.0 (the last run a tie), 4096 x 14336
      17.8-18.3 against 19.0-20.3. At 6144 rows that grid is 1.45 waves and lost (11.1 against 9.7).
    - over 8192 rows, x ahead over 2 warps, 6 blocks an SM: 28672 x 4096 33.0-33.1 against 35.1,
      14336 x 4096 18.0 against 20.9.
    - otherwise one m-tile over 8 warps, x loaded when its chunk is computed, 3 blocks an SM.
    The H100 (also 132 SMs) gets the same; its own sweep (`scripts/fp8_gemv_sweep.py`,
    fp8-gemv-sweep.txt) had put the last variant within 9% of the best at every width and was not
    repeated. Batches 2-8 follow the one-token choice, not timed apart. At 16 tokens (two n-tiles)
    two m-tiles a warp over four warps, x ahead, 2 blocks an SM came within 9% of the best
    everywhere on the H100 (28.3 us against 38.0 at N = 14336); batches 9-15 take it too, not
    measured between."""
    if batch > 8:
        return (2, 4, True, 2)
    if n <= 2 * sms * 16:
        return (1, 8, True, 2)
    if n > 8192:
        return (1, 2, True, 6)
    return (1, 8, False, 3)


def cuda_kernel_fits(x: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether `fp8_gemv.cu` takes (checked) 2-D x and q: a GPU with the e4m3 -> f16 conversion
    (sm_89 on) and 16-byte loads of W and x (rows and addresses 16-byte aligned)."""
    return (x.is_cuda and capability(x.device.index) >= (8, 9) and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0
            and q.stride(0) % 16 == 0 and q.data_ptr() % 16 == 0)


def launch_cuda_gemv(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, y: torch.Tensor, *,
                     m_tiles: int | None = None, k_warps: int | None = None, x_ahead: bool | None = None,
                     min_blocks: int | None = None, residual: torch.Tensor | None = None) -> None:
    """y (M, N) on `fp8_gemv.cu` for operands that `cuda_kernel_fits`; the keywords pick its MT, KW,
    XPF and MINB (default: `cuda_variant`), NT follows M; `residual` (M, N) bf16 with contiguous rows
    is added in the store (the RESIDUAL build). A plan per shape and strides keeps the lean launch
    with its scalar arguments: a call passes the five pointers."""
    r_row = None if residual is None else residual.stride(0)
    key = (x.shape, q.shape[0], x.stride(0), q.stride(0), scale.stride(0), y.stride(0), r_row, x.device.index,
           m_tiles, k_warps, x_ahead, min_blocks)
    plan = _CUDA_PLANS.get(key)
    if plan is None:
        plan = _CUDA_PLANS[key] = _cuda_plan(x, q, scale, y, m_tiles, k_warps, x_ahead, min_blocks, r_row)
    launch, index, scalars = plan
    launch(torch._C._cuda_getCurrentRawStream(index), q.data_ptr(), scale.data_ptr(), x.data_ptr(), y.data_ptr(),
           0 if residual is None else residual.data_ptr(), *scalars)


def _cuda_plan(x, q, scale, y, m_tiles, k_warps, x_ahead, min_blocks, r_row) -> tuple:
    """(lean launch, device index, the scalar arguments) of `fp8_gemv.cu` for one shape."""
    batch, k = x.shape
    n = q.shape[0]
    if None in (m_tiles, k_warps, x_ahead, min_blocks):
        # (once a plan: the plans are cached; the rule above 8 tokens needs no device)
        sms = sm_count(x.device) if batch <= 8 else 0
        default_mt, default_kw, default_xpf, default_minb = cuda_variant(n, batch, sms)
        m_tiles, k_warps, min_blocks = m_tiles or default_mt, k_warps or default_kw, min_blocks or default_minb
        x_ahead = default_xpf if x_ahead is None else x_ahead
    n_tiles = triton.cdiv(batch, 8)
    if m_tiles not in (1, 2, 4, 8):
        raise ValueError(f"fp8_gemv.cu takes 1, 2, 4 or 8 m-tiles a warp (16 MT rows inside one 128-row scale "
                         f"band), got {m_tiles}")
    shared = cuda_shared_bytes(m_tiles, n_tiles, k_warps)
    if shared > CUDA_SHARED_LIMIT:
        raise ValueError(f"fp8_gemv.cu with MT={m_tiles}, NT={n_tiles}, KW={k_warps} needs {shared} bytes of shared "
                         f"memory, over {CUDA_SHARED_LIMIT}")
    variant = (m_tiles, n_tiles, k_warps, x_ahead, min_blocks, r_row is not None)
    kernel = _CUDA_KERNELS.get(variant)
    if kernel is None:
        from kforge.runtime.cuda import CudaKernel

        kernel = _CUDA_KERNELS[variant] = CudaKernel.from_file(
            CUDA_SOURCE, "fp8_gemv", defines={"MT": m_tiles, "NT": n_tiles, "KW": k_warps, "XPF": int(x_ahead),
                                              "MINB": min_blocks, "RESIDUAL": int(r_row is not None)})
    index = x.device.index
    launch = kernel.lean(triton.cdiv(n, 16 * m_tiles), 32 * k_warps, index, kinds=CUDA_KINDS)
    scalars = (n, batch, k // SCALE_BLOCK, q.stride(0) // 16, scale.stride(0), x.stride(0) // 8, y.stride(0),
               r_row or 0)
    return launch, index, scalars


# --- the Python API --------------------------------------------------------------------------------

def _describe(t) -> str:
    return f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def check_fp8_gemv_operands(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """Raise ValueError, in one line, unless (x, q, scale) is a GEMV this format defines: dtypes,
    shapes, the batch limit, one device. (`check_fp8_gemv_inputs` adds what the kernels need.)"""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() not in (1, 2):
        raise ValueError(f"x must be a (K,) or (M, K) torch.bfloat16 tensor, got {_describe(x)}")
    if not isinstance(q, torch.Tensor) or q.dtype != CODE_DTYPE or q.dim() != 2:
        raise ValueError(f"q must be an (N, K) {CODE_DTYPE} tensor, got {_describe(q)}")
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or scale.dim() != 2:
        raise ValueError(f"scale must be a (ceil(N/128), K/128) torch.float32 tensor, got {_describe(scale)}")
    n, k = q.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has K = {x.shape[-1]} but q (N, K) is {tuple(q.shape)}")
    if k == 0 or k % SCALE_BLOCK:
        raise ValueError(f"K = {k} must be a positive multiple of {SCALE_BLOCK} (the format's scale blocks)")
    want = (triton.cdiv(n, SCALE_BLOCK), k // SCALE_BLOCK)
    if tuple(scale.shape) != want:
        raise ValueError(f"scale must be (ceil(N/128), K/128) = {want} for q {tuple(q.shape)}, got "
                         f"{tuple(scale.shape)}")
    batch = 1 if x.dim() == 1 else x.shape[0]
    if batch > MAX_BATCH:
        raise ValueError(f"fp8_gemv takes at most {MAX_BATCH} rows, got {batch}: use fp8_gemm for more")
    if not x.device == q.device == scale.device:
        raise ValueError(f"x, q and scale must be on one device, got {x.device}, {q.device}, {scale.device}")


def check_fp8_gemv_inputs(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """`check_fp8_gemv_operands`, then what the kernels need: rows contiguous along K, 32-bit offsets."""
    check_fp8_gemv_operands(x, q, scale)
    if x.stride(-1) != 1 or q.stride(1) != 1 or scale.stride(1) != 1:
        raise ValueError(f"x, q and scale need contiguous rows (stride 1 along K); got strides {x.stride()}, "
                         f"{q.stride()}, {scale.stride()}")
    if q.numel() >= 2**31:
        raise ValueError(f"q has {q.numel()} codes: the kernels' offsets are 32-bit")


def launch_fp8_gemv(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, config: dict | None,
                    residual: torch.Tensor | None = None) -> torch.Tensor:
    """y (M, N) bf16 for checked 2-D x (and `residual`, `check_fp8_residual`: then residual + y, the
    add in the CUDA kernel's store, after the Triton kernel otherwise; the same bits). `config`
    None: the CUDA kernel where it fits (`cuda_kernel_fits`), else the Triton kernel (the
    interpreter's tile off the GPU); a config (BLOCK_N, BLOCK_K, num_warps) runs the Triton kernel
    with that tile."""
    batch = x.shape[0]
    y = torch.empty((batch, q.shape[0]), dtype=torch.bfloat16, device=x.device)
    if y.numel() == 0:
        return y
    if config is None and cuda_kernel_fits(x, q):
        launch_cuda_gemv(x, q, scale, y, residual=residual)
        return y
    from kforge.runtime.interpreter import interpreter_active

    launch_triton_gemv(x, q, scale, y, triton_tile(batch, config, interpreter_active()))
    return y if residual is None else residual + y


def check_fp8_residual(y_shape: tuple[int, ...], x: torch.Tensor, residual: torch.Tensor) -> None:
    """Raise ValueError, in one line, unless `residual` can be added to a GEMV's y of `y_shape`:
    that shape, bf16, x's device, contiguous rows."""
    if not isinstance(residual, torch.Tensor) or residual.dtype != torch.bfloat16 or tuple(residual.shape) != y_shape:
        raise ValueError(f"residual must be a torch.bfloat16 tensor of y's shape {y_shape}, got {_describe(residual)}")
    if residual.device != x.device or residual.stride(-1) != 1:
        raise ValueError(f"residual must be on {x.device} with contiguous rows, got {residual.device}, strides "
                         f"{residual.stride()}")


def fp8_gemv(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, *, config: dict | None = None,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """x @ (q * scale).T for x (K,) or (M <= 16, K) bf16, q (N, K) e4m3 codes and scale
    (ceil(N/128), K/128) fp32 (128 x 128 blocks); fp32 sums, y (N,) or (M, N) bf16; with
    `residual` (y's shape, bf16), residual + y with the unfused pair's bits.

    On a GPU the CUDA kernel runs where it fits, else the Triton one; `config` (BLOCK_N, BLOCK_K,
    num_warps) runs the Triton kernel with that tile (the CPU tests pick the interpreter's).
    """
    check_fp8_gemv_inputs(x, q, scale)
    if residual is not None:
        check_fp8_residual((*x.shape[:-1], q.shape[0]), x, residual)
        residual = residual.view(1, -1) if x.dim() == 1 else residual
    y = launch_fp8_gemv(x.view(1, -1) if x.dim() == 1 else x, q, scale, config, residual)
    return y.view(-1) if x.dim() == 1 else y


def fp8_gemv_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Eager PyTorch: W dequantized to fp32 (formats.dequantize_fp8), x @ W.T in fp32, rounded once to bf16."""
    from kforge.kernels.quant.formats import dequantize_fp8

    w = dequantize_fp8(q, scale, (SCALE_BLOCK, SCALE_BLOCK))
    return (x.float() @ w.T).to(torch.bfloat16)


def fp8_gemv_min_bytes(batch: int, n: int, k: int) -> int:
    """HBM bytes the GEMV must move: the codes and fp32 scales once, x read and y written in bf16."""
    return n * k + 4 * triton.cdiv(n, SCALE_BLOCK) * (k // SCALE_BLOCK) + 2 * batch * (k + n)

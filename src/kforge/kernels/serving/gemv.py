"""Decode GEMV in Triton: y = x @ W^T for 1 to 16 token rows, W read from HBM once.

At decode a linear layer sees a few rows x (batch, K) against a weight W (N, K) stored
row-major, as nn.Linear keeps it. The FLOPs are 2 * batch * N * K, the bytes are
essentially W's: N * K * 2 for bf16 (x and y are batch * (K + N) * 2, under 0.4% of it
at batch 16 on Llama widths). So the kernel is judged by the share of HBM bandwidth it
reaches, `gemv_min_bytes / time`, and everything below serves one aim: stream W once,
with enough bytes in flight on every SM, and never stall on anything else.

One program owns BLOCK_N output columns (rows of W) for every batch row: it walks K in
BLOCK_K steps, loading its (BLOCK_N, BLOCK_K) slice of W and the (batch, BLOCK_K) slice
of x, and accumulates in fp32. Each W element is loaded by one program only; x (at most
16 x 14336 x 2 = 448 KB) is re-read by every program, from L2, where it stays. Those L2
reads are batch / BLOCK_N of W's HBM bytes: nothing at batch 1, as much as W at batch
16 with BLOCK_N = 16, which L2 (2-3x HBM's bandwidth) absorbs; BLOCK_N = 32 halves it.
The K loop runs unmasked over the whole BLOCK_K steps and one masked step takes the tail.

Two ways to do the multiply-add, both in the autotuner's list (the H100 decides):
- CUDA cores (USE_DOT=False), for batch 1 to 4. The W tile is 3-D, (1, BLOCK_N,
  BLOCK_K), x is (BLOCK_B, 1, BLOCK_K), and acc += w * x is a broadcast FMA into a
  (BLOCK_B, BLOCK_N, BLOCK_K) fp32 accumulator summed over K once at the end. With
  BLOCK_K = 256 * num_warps each thread holds 8 consecutive K elements of every row,
  so every load is 16 bytes (LDG.128), W and x come out of their loads in the same
  register layout (no shared-memory shuffle inside the loop), and the only reduction is
  the final one. Batch 1, BLOCK_N = 8, 4 warps: 8 LDG.128 of W in flight per thread per
  step, 64 accumulator registers, 105 registers a thread (ptxas, sm_90): 4 programs
  (16 warps) per SM, 64 KB of W requested per SM per step. Little's law wants about
  3.35 TB/s x ~1 us / 132 SMs = 25 KB in flight per SM; that leaves a 2.5x margin.
  The accumulator grows with the batch (BLOCK_B * BLOCK_N * 8 registers), hence
  BLOCK_N = 4 at batch 2 and 2 at batch 4; beyond that the FMAs themselves (16 per W
  element at batch 16, ~105 per clock per SM against a peak of 128) would be the limit.
- Tensor cores (USE_DOT=True), any batch: acc (BLOCK_N, BLOCK_B) += W_tile @ x_tile^T
  with mma.sync (m16n8k16; the batch is padded up to the instruction by the compiler,
  the wasted FLOPs are free here). Because its operands feed a tl.dot, Triton's
  pipeliner streams W through a num_stages-deep cp.async ring in shared memory: with
  BLOCK_N = 16, BLOCK_K = 256 and 4 stages, 24 KB of W is in flight per program
  (26-50 KB of shared memory and 64-117 registers from batch 1 to 16).

Grid and tails, for the Llama-3-8B shapes (N = 4096, 6144, 14336, 28672): with BLOCK_N =
8 the smallest, N = 4096, is 512 programs, which fit the 4 x 132 = 528 resident slots
at once (one wave, no tail wave); the wider ones are 768-3584 programs, many short
waves, and the partial last wave still has more than 2.7 MB in flight. So no split-K:
N / BLOCK_N already covers the 132 SMs several times over at every shape asked for.
Rows past N read row N - 1 (clamped, so the loads stay unpredicated) and are never
stored. Measured on the H100 at batch 1 (numbers below): 69-92% of copy bandwidth from the
smallest W to the largest, the launch and the ramp weighing most on the smallest.

For one bf16 token a CUDA kernel beside it takes over (`gemv_rows.cu`, one warp per row of
W, every warp streaming from launch like a copy kernel). It launches through the lean
driver path (`runtime/driver.py`), with no autotuner and no per-call specialization. On
the H100 (2026-11-22, `scripts/gemv_sweep.py`) it beat every Triton tile at every 8B
width: 71.8 / 79.9 / 90.6 / 96.8 / 89.0% of copy bandwidth at N x K = 4096 x 4096,
6144 x 4096, 14336 x 4096, 28672 x 4096 and 4096 x 14336 (Triton autotuned: 69.2 / 75.4 /
87.9 / 92.0 / 87.0; cuBLAS: 60.5 / 72.4 / 86.2 / 90.4 / 83.2), and 97-100% of a read-only
stream of the same bytes. The small widths are bounded by the launch: an empty kernel
times 3.3 us under the same events, so 33.6 MB cannot show more than ~77% of copy, nor
50.4 MB more than ~83%.

With NORM=True the same kernel is the decode path of RMSNorm fused into the QKV
projection (`norm_qkv.py`): each program also accumulates sum(x^2) of its rows from the
x it streams anyway, scales x by gamma as it loads it, and multiplies its outputs by
r = 1/sqrt(mean(x^2) + eps) at the end. The normalized rows never exist in memory.
"""

from __future__ import annotations

from pathlib import Path

import torch
import triton
import triton.language as tl

from kforge.kernels.serving.swiglu import swiglu_reference

MAX_BATCH = 16
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ROWS_SOURCE = Path(__file__).with_name("gemv_rows.cu")
ROWS_PER_BLOCK = 8  # WARPS in gemv_rows.cu
ROWS_KERNEL_ENABLED = True  # one bf16 token on gemv_rows.cu (measured on the H100: docstring)


@triton.jit
def _gemv_step(acc, sumsq, x_ptrs, w_ptrs, gamma_ptr, k_index, k0, k_left, MASKED: tl.constexpr,
               USE_DOT: tl.constexpr, NORM: tl.constexpr, DOT_PRECISION: tl.constexpr):
    if MASKED:
        inside = k_index < k_left
        x = tl.load(x_ptrs + k0, mask=inside, other=0.0)
        w = tl.load(w_ptrs + k0, mask=inside, other=0.0)
    else:
        x = tl.load(x_ptrs + k0)
        w = tl.load(w_ptrs + k0)
    if NORM:
        xf = x.to(tl.float32)
        sumsq += xf * xf
        if gamma_ptr is not None:  # None: gamma is already folded into W
            if MASKED:
                gamma = tl.load(gamma_ptr + k0 + k_index, mask=inside, other=0.0)
            else:
                gamma = tl.load(gamma_ptr + k0 + k_index)
            x = xf * gamma.to(tl.float32)
    if USE_DOT:  # x * gamma is rounded to W's dtype for the tensor cores, as eager rounds the normed rows
        acc = tl.dot(w, tl.trans(x.to(w.dtype)), acc, input_precision=DOT_PRECISION)
    else:
        acc += w.to(tl.float32) * x.to(tl.float32)
    return acc, sumsq


@triton.jit
def _gemv_tile(x_ptr, w_ptr, gamma_ptr, w_rows, x_rows, k_in, stride_xb, stride_wn, BLOCK_B: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr, NORM: tl.constexpr,
               DOT_PRECISION: tl.constexpr):
    """(BLOCK_B, BLOCK_N) fp32 of x @ W[w_rows]^T, and each x row's sum of squares (NORM)."""
    offs_k = tl.arange(0, BLOCK_K)
    if USE_DOT:
        k_index = offs_k[None, :]
        w_ptrs = w_ptr + w_rows[:, None] * stride_wn + k_index
        x_ptrs = x_ptr + x_rows[:, None] * stride_xb + k_index
        acc = tl.zeros((BLOCK_N, BLOCK_B), tl.float32)
        sumsq = tl.zeros((BLOCK_B, BLOCK_K), tl.float32)
    else:  # 3-D tiles: W and x load straight into the accumulator's layout
        k_index = offs_k[None, None, :]
        w_ptrs = w_ptr + w_rows[None, :, None] * stride_wn + k_index
        x_ptrs = x_ptr + x_rows[:, None, None] * stride_xb + k_index
        acc = tl.zeros((BLOCK_B, BLOCK_N, BLOCK_K), tl.float32)
        sumsq = tl.zeros((BLOCK_B, 1, BLOCK_K), tl.float32)

    k_full = k_in // BLOCK_K * BLOCK_K
    for k0 in range(0, k_full, BLOCK_K):
        acc, sumsq = _gemv_step(acc, sumsq, x_ptrs, w_ptrs, gamma_ptr, k_index, k0, BLOCK_K, False, USE_DOT, NORM,
                                DOT_PRECISION)
    if k_full < k_in:
        acc, sumsq = _gemv_step(acc, sumsq, x_ptrs, w_ptrs, gamma_ptr, k_index, k_full, k_in - k_full, True, USE_DOT,
                                NORM, DOT_PRECISION)
    if USE_DOT:
        y = tl.trans(acc)
        row_sumsq = tl.sum(sumsq, 1, keep_dims=True)
    else:
        y = tl.sum(acc, 2)
        row_sumsq = tl.sum(sumsq, 2)
    return y, row_sumsq


# What follows the projection, fused into its store (EPILOGUE): see `launch_gemv`.
EPI_NONE, EPI_RESIDUAL, EPI_SWIGLU = 0, 1, 2


@triton.jit
def gemv_kernel(x_ptr, w_ptr, y_ptr, gamma_ptr, residual_ptr, batch, n_out, k_in, stride_xb, stride_wn, stride_yb,
                stride_rb, eps, weight_rows, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                USE_DOT: tl.constexpr, NORM: tl.constexpr, DOT_PRECISION: tl.constexpr, EPILOGUE: tl.constexpr = 0):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_b = tl.arange(0, BLOCK_B)
    w_rows = tl.minimum(offs_n, n_out - 1)  # past the end: re-read the last row, never store it
    x_rows = tl.minimum(offs_b, batch - 1)
    y, row_sumsq = _gemv_tile(x_ptr, w_ptr, gamma_ptr, w_rows, x_rows, k_in, stride_xb, stride_wn, BLOCK_B, BLOCK_N,
                              BLOCK_K, USE_DOT, NORM, DOT_PRECISION)
    if NORM:  # r = 1/sqrt(mean(x^2) + eps) of each batch row, as (BLOCK_B, 1)
        r = tl.rsqrt(row_sumsq / k_in + eps)
        y = y * r
    keep = (offs_b[:, None] < batch) & (offs_n[None, :] < n_out)
    out_type = y_ptr.dtype.element_ty
    # The epilogues round the product to the output's dtype first, as the unfused pair would
    if EPILOGUE == 1:  # EPI_RESIDUAL: y = residual + x W^T
        residual = tl.load(residual_ptr + offs_b[:, None] * stride_rb + offs_n[None, :], mask=keep, other=0.0)
        y = residual.to(tl.float32) + y.to(out_type).to(tl.float32)
    elif EPILOGUE == 2:  # EPI_SWIGLU: W has 2 n_out rows, gate then up; y = silu(gate) * up
        up, _ = _gemv_tile(x_ptr, w_ptr, gamma_ptr, w_rows + n_out, x_rows, k_in, stride_xb, stride_wn, BLOCK_B,
                           BLOCK_N, BLOCK_K, USE_DOT, NORM, DOT_PRECISION)
        if NORM:
            up = up * r
        gate = y.to(out_type).to(tl.float32)
        y = gate * tl.sigmoid(gate) * up.to(out_type).to(tl.float32)  # kernels/serving/swiglu.py's arithmetic
    tl.store(y_ptr + offs_b[:, None] * stride_yb + offs_n[None, :], y.to(out_type), mask=keep)


def _config(block_n, block_k, use_dot, warps, stages=1):
    return triton.Config({"BLOCK_N": block_n, "BLOCK_K": block_k, "USE_DOT": use_dot}, num_warps=warps,
                         num_stages=stages)


# CUDA-core tiles: BLOCK_K = 256 * num_warps (16-byte loads, no layout shuffle) and
# BLOCK_B * BLOCK_N = 8 accumulators of 8 K elements, 64 fp32 registers a thread: batch 1
# takes BLOCK_N = 8, batch 2 takes 4, batch 4 takes 2. Tensor-core tiles: any batch.
CONFIGS = [
    _config(8, 1024, False, 4), _config(8, 512, False, 2), _config(4, 1024, False, 4), _config(2, 1024, False, 4),
    _config(16, 256, True, 4, 4), _config(16, 512, True, 4, 3), _config(32, 256, True, 4, 4),
    _config(16, 128, True, 2, 6),
]
CUDA_CORE_ROWS = 8  # BLOCK_B * BLOCK_N of a CUDA-core tile


def _configs_for(configs, named_args, **kwargs):
    block_b = kwargs.get("BLOCK_B", named_args.get("BLOCK_B"))
    return [c for c in configs if c.kwargs["USE_DOT"] or block_b * c.kwargs["BLOCK_N"] == CUDA_CORE_ROWS]


# Keyed by the weight's rows, not the output's, and not by the epilogue: a fused call and the plain GEMV
# of the same weight share one tuned tile, so they add up K in the same order and the fused one keeps
# the unfused pair's bits (tiles of the two kinds, CUDA-core and tensor-core, sum in different orders).
gemv_autotuned = triton.autotune(CONFIGS, key=["weight_rows", "k_in", "BLOCK_B", "NORM"],
                                 prune_configs_by={"early_config_prune": _configs_for})(gemv_kernel)

INTERPRETER_CONFIG = {"BLOCK_N": 16, "BLOCK_K": 128, "USE_DOT": False}


def check_gemv_inputs(x: torch.Tensor, weight: torch.Tensor) -> None:
    """Raise ValueError on anything the kernel cannot take."""
    if x.dim() not in (1, 2) or weight.dim() != 2:
        raise ValueError(f"x must be (K,) or (batch, K) and weight (N, K); got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if x.dtype != weight.dtype or x.dtype not in DTYPES:
        raise ValueError(f"x and weight must share one dtype of float16, bfloat16, float32; got {x.dtype} and "
                         f"{weight.dtype}")
    if x.device != weight.device:
        raise ValueError(f"x and weight are on different devices: {x.device} and {weight.device}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x has K = {x.shape[-1]} but weight (N, K) is {tuple(weight.shape)}")
    batch = 1 if x.dim() == 1 else x.shape[0]
    if batch > MAX_BATCH:
        raise ValueError(f"gemv takes at most {MAX_BATCH} rows, got {batch}: use a GEMM (kforge.ops.matmul, "
                         f"torch.matmul) for more")
    if x.stride(-1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"x and weight need contiguous rows (stride 1 along K); got strides {x.stride()} and "
                         f"{weight.stride()}")
    if weight.numel() >= 2**31:
        raise ValueError(f"weight has {weight.numel()} elements: the kernel's offsets are 32-bit")


def rows_kernel_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the CUDA one-token kernel takes (batch, K) x and (N, K) weight: one bf16 row on a
    GPU, K a multiple of 8, 16-byte aligned rows (its loads are 16 bytes)."""
    return (x.is_cuda and x.shape[0] == 1 and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
            and x.shape[1] % 8 == 0 and weight.stride(0) % 8 == 0 and x.stride(1) == 1
            and x.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0)


_ROWS_LAUNCHES: dict[tuple, object] = {}


def launch_rows_kernel(x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, epilogue: int = EPI_NONE,
                       residual: torch.Tensor | None = None) -> None:
    """y (1, N) = epilogue(x (1, K) @ weight^T) on gemv_rows.cu (one build per epilogue), launched
    through a kept LeanLaunch; N is y's width (weight has 2N rows with EPI_SWIGLU)."""
    n, k = y.shape[1], weight.shape[1]
    index = x.device.index
    key = (epilogue, n, k, weight.stride(0), index)
    launch = _ROWS_LAUNCHES.get(key)
    if launch is None:
        from kforge.runtime.cuda import CudaKernel

        kernel = _ROWS_LAUNCHES.get(epilogue)
        if kernel is None:
            kernel = _ROWS_LAUNCHES[epilogue] = CudaKernel.from_file(ROWS_SOURCE, "gemv_bf16",
                                                                     defines={"EPILOGUE": epilogue})
        launch = _ROWS_LAUNCHES[key] = kernel.lean(triton.cdiv(n, ROWS_PER_BLOCK), 32 * ROWS_PER_BLOCK, index,
                                                   kinds=("ptr", "ptr", "ptr", "i32", "i32", "i32", "ptr"))
    launch(torch._C._cuda_getCurrentRawStream(index), weight.data_ptr(), x.data_ptr(), y.data_ptr(), n, k // 8,
           weight.stride(0) // 8, 0 if residual is None else residual.data_ptr())


def launch_gemv(x: torch.Tensor, weight: torch.Tensor, config: dict | None, *, norm_eps: float | None = None,
                norm_weight: torch.Tensor | None = None, epilogue: int = EPI_NONE,
                residual: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W^T (batch, N) for checked 2-D x (and residual: `check_epilogue_inputs`); with
    `norm_eps`, y = rmsnorm(x; norm_weight, norm_eps) @ W^T
    (no norm_weight: gamma is folded into W). `epilogue` fuses what follows: EPI_RESIDUAL adds
    `residual` (batch, N); EPI_SWIGLU takes W (2N, K) as gate rows then up rows and gives
    silu(x W_gate^T) * x W_up^T (batch, N). Either rounds the product to x's dtype before it,
    so the result has the bits of the unfused pair (`gemv_epilogue_reference`). With
    ROWS_KERNEL_ENABLED, one bf16 token without a norm or a config takes the CUDA kernel
    (`rows_kernel_fits`)."""
    if (epilogue == EPI_RESIDUAL) != (residual is not None):  # the autotuned launch lends y for a missing one
        raise ValueError("a residual goes with EPI_RESIDUAL, and only with it")
    batch, k = x.shape
    n = weight.shape[0] // 2 if epilogue == EPI_SWIGLU else weight.shape[0]
    y = torch.empty((batch, n), dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    if ROWS_KERNEL_ENABLED and config is None and norm_eps is None and rows_kernel_fits(x, weight):
        launch_rows_kernel(x, weight, y, epilogue, residual)
        return y
    args = dict(BLOCK_B=triton.next_power_of_2(batch), NORM=norm_eps is not None,
                DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", EPILOGUE=epilogue)
    eps = 0.0 if norm_eps is None else norm_eps
    strides = (x.stride(0), weight.stride(0), y.stride(0), 0 if residual is None else residual.stride(0))
    tail = (eps, weight.shape[0])
    if config is None and not x.is_cuda:  # the Triton interpreter: one small tile, no autotuning
        config = INTERPRETER_CONFIG
    if config is None:
        def grid(meta):
            return (triton.cdiv(n, meta["BLOCK_N"]),)

        # Triton's autotuner adds every tensor argument's dtype to the key, and None has none: y stands in
        # for a missing residual (unread: EPILOGUE says so), so the residual-add call and the plain
        # GEMV of its weight share one tuned tile. Apart, each picked its own by timing, and the
        # fused decode step once lost the unfused one's bits (H200, test_decode_graphs.py).
        gemv_autotuned[grid](x, weight, y, norm_weight, y if residual is None else residual, batch, n, k, *strides,
                             *tail, **args)
    else:
        blocks = {key: config[key] for key in ("BLOCK_N", "BLOCK_K", "USE_DOT")}
        gemv_kernel[(triton.cdiv(n, blocks["BLOCK_N"]),)](
            x, weight, y, norm_weight, residual, batch, n, k, *strides, *tail, **args, **blocks,
            num_warps=config.get("num_warps", 4), num_stages=config.get("num_stages", 1))
    return y


def check_epilogue_inputs(x: torch.Tensor, weight: torch.Tensor, epilogue: int,
                          residual: torch.Tensor | None) -> None:
    """Raise ValueError on an epilogue's operands `check_gemv_inputs` does not cover (x 2-D)."""
    if epilogue == EPI_SWIGLU and weight.shape[0] % 2:
        raise ValueError(f"a fused gate/up weight has 2 x hidden rows, got {weight.shape[0]}")
    if epilogue == EPI_RESIDUAL:
        if residual is None or residual.shape != (x.shape[0], weight.shape[0]):
            raise ValueError(f"residual must be (batch, N) = {(x.shape[0], weight.shape[0])}, got "
                             f"{None if residual is None else tuple(residual.shape)}")
        if residual.dtype != x.dtype or residual.device != x.device or residual.stride(1) != 1:
            raise ValueError(f"residual must be a {x.dtype} tensor on {x.device} with contiguous rows, got "
                             f"{residual.dtype} on {residual.device}, strides {residual.stride()}")


def gemv_epilogue_reference(x: torch.Tensor, weight: torch.Tensor, epilogue: int,
                            residual: torch.Tensor | None = None) -> torch.Tensor:
    """The unfused pair in eager PyTorch: the product rounded to x's dtype, then the add or
    SwiGLU (`swiglu_reference`: fp32 arithmetic, one rounding)."""
    y = gemv_reference(x, weight)
    if epilogue == EPI_RESIDUAL:
        return residual + y
    if epilogue == EPI_SWIGLU:
        return swiglu_reference(y)
    return y


def gemv(x: torch.Tensor, weight: torch.Tensor, *, config: dict | None = None, epilogue: int = EPI_NONE,
         residual: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T for x (K,) or (batch <= 16, K) and weight (N, K), fp32 accumulation.

    The result has x's dtype and shape (N,) or (batch, N). `config` (BLOCK_N, BLOCK_K,
    USE_DOT, num_warps, num_stages) skips the autotuner: the CPU tests pick tiles for
    the Triton interpreter. `epilogue` and `residual` as `launch_gemv` takes them (the
    residual shaped as the result).
    """
    check_gemv_inputs(x, weight)
    rows = x.view(1, -1) if x.dim() == 1 else x
    if residual is not None and x.dim() == 1:
        residual = residual.view(1, -1)
    check_epilogue_inputs(rows, weight, epilogue, residual)
    y = launch_gemv(rows, weight, config, epilogue=epilogue, residual=residual)
    return y.view(-1) if x.dim() == 1 else y


def gemv_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, in eager PyTorch (cuBLAS on a GPU)."""
    return x @ weight.T


def gemv_min_bytes(batch: int, n: int, k: int, itemsize: int = 2) -> int:
    """HBM bytes any GEMV must move: W and x read once, y written once."""
    return (n * k + batch * k + batch * n) * itemsize

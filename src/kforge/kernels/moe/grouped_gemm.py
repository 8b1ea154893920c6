"""Grouped GEMM for mixture-of-experts layers in Triton: all experts in one launch.

The math. Expert e multiplies the n_e rows routed to it (ragged, possibly none) by its
own weight: Y_e = X_e W_e^T, W_e (N, K) as nn.Linear stores it. `routing.py` lays the
rows out expert by expert in one matrix X (M, K), each expert's run padded to a multiple
of ALIGN rows, and names the expert of every ALIGN-row block. A tile of BM rows (BM
dividing ALIGN) then lies inside one expert's run, so the grouped GEMM is one GEMM whose
tile at rows [m, m + BM) reads W[block_experts[m // ALIGN]]: one launch whatever the
counts, an expert without rows has no tiles, and the eager loop's E launches of a few
hundred rows each (every one with its own partial last wave) become one grid.

Two epilogues, for the two projections of a SwiGLU expert:
- GATED: W_e is (2N, K), gate rows then up rows (w1 then w3 in Mixtral's names). Each X
  tile feeds two accumulators, gate = X W_gate^T and up = X W_up^T, and the tile stores
  silu(gate) * up, rounded once: the (rows, 2N) projection never reaches HBM, where the
  eager expert writes two of them, reads one for silu, then both for the product.
- SCATTER: each row is scaled by its routing weight and stored at its destination row
  (its assignment t * top_k + j; padding rows, marked -1, are dropped), so a token's
  top_k results end up adjacent and the combine is a sum over them, not an index_add.

FLOPs 2 * rows * N * K (4 * ... gated), counting padding rows, which are computed and
dropped; bytes: X and the weights of the experts in use read once (an expert's panels
come back from L2 for its other row tiles), the output written once.

Choices for the H100 (132 SMs, 227 KB of shared memory a block):
- The schedule of `gemm_bf16/triton_matmul.py` (~0.96x cuBLAS at 4096^3): one program
  per SM walks the output tiles in grouped order, GROUP_M tile rows sweeping the columns
  together; an expert's run is a few tile rows (4 at 512 rows), so the tiles in flight
  share its weight panels in L2.
- TMA descriptors built on the device. X is [M, K]; the weights are [E, N, K] (gated
  [E, 2, N, K]) with boxes [1, BN, BK]: a box reaching past N reads zeros, never the
  next expert's rows, so any N works.
- How many tiles are in use is read on the device (used_rows): the launch never waits
  for the router. Stores go through pointers, masked on N (and on padding rows when
  scattering), so the output needs no 16-byte rows.
- Tiles: triton_matmul's list for the plain GEMM; the gated one holds two accumulators
  and two weight boxes a stage, so its list halves BN (128 x 128 gated is the work and
  the registers of 128 x 256 plain). The CPU tests compile each for sm_90 and check its
  shared memory.

Expected on the H100 (not measured here): within a few percent of the triton_matmul
mainloop on the same total rows, i.e. ~0.9x of cuBLAS's rate on one big GEMM; against
the eager loop's E x 3 cuBLAS calls it gains their partial waves and the elementwise
passes (silu, the product, the routing weight, index_add): see
`problems/level3/moe_ffn_bf16.py` for the layer's figures.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Importing triton_matmul also installs the scratch allocator that device-built TMA
# descriptors need (triton.set_allocator).
from kforge.kernels.gemm_bf16.triton_matmul import _tile_coords

ROW_ALIGN = 128  # the tallest tile below: expert runs are padded to it on the GPU
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INTERPRETER_CONFIG = {"BM": 16, "BN": 32, "BK": 32, "GROUP_M": 2, "FLATTEN": False}
INTERPRETER_PROGRAMS = 4


@triton.jit
def grouped_gemm_kernel(x_ptr, w_ptr, out_ptr, block_experts_ptr, used_rows_ptr, row_scale_ptr, dest_rows_ptr,
                        M, N, K, E, stride_out,
                        NUM_PROGRAMS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        GROUP_M: tl.constexpr, FLATTEN: tl.constexpr, ALIGN: tl.constexpr, GATED: tl.constexpr,
                        SCATTER: tl.constexpr, DOT_PRECISION: tl.constexpr):
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    if GATED:
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[E, 2, N, K], strides=[2 * N * K, N * K, K, 1],
                                           block_shape=[1, 1, BN, BK])
    else:
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[E, N, K], strides=[N * K, K, 1], block_shape=[1, BN, BK])
    # used_rows is a multiple of ALIGN, so of BM: every tile below is all real rows or padding
    tiles_m = tl.load(used_rows_ptr) // BM
    tiles_n = tl.cdiv(N, BN)
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, NUM_PROGRAMS, flatten=FLATTEN):
        tm, tn = _tile_coords(tile, tiles_m, tiles_n, GROUP_M)
        expert = tl.load(block_experts_ptr + tm * BM // ALIGN)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        if GATED:
            acc_up = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, K, BK):
            x = x_desc.load([tm * BM, k])
            if GATED:
                gate = w_desc.load([expert, 0, tn * BN, k]).reshape(BN, BK)
                acc = tl.dot(x, gate.T, acc, input_precision=DOT_PRECISION)
                up = w_desc.load([expert, 1, tn * BN, k]).reshape(BN, BK)
                acc_up = tl.dot(x, up.T, acc_up, input_precision=DOT_PRECISION)
            else:
                w = w_desc.load([expert, tn * BN, k]).reshape(BN, BK)
                acc = tl.dot(x, w.T, acc, input_precision=DOT_PRECISION)
        if GATED:
            acc = acc * tl.sigmoid(acc) * acc_up  # silu(gate) * up, in fp32
        rows = tm * BM + tl.arange(0, BM)
        cols = tn * BN + tl.arange(0, BN)
        keep = (cols < N)[None, :]
        if SCATTER:
            acc = acc * tl.load(row_scale_ptr + rows)[:, None]
            rows = tl.load(dest_rows_ptr + rows)
            keep = keep & (rows >= 0)[:, None]
        out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=keep)


def _config(bm, bn, stages, warps, flatten=False):
    return triton.Config({"BM": bm, "BN": bn, "BK": 64, "GROUP_M": 8, "FLATTEN": flatten}, num_stages=stages,
                         num_warps=warps)


# Plain: triton_matmul's H100 list (128 x 256 x 64, 8 warps, 3 stages won at 4096^3).
# Gated: a stage holds an X box and two weight boxes, (BM + 2 BN) x BK x 2 bytes, 48 KB at
# 128 x 128: four stages fit the 227 KB, and two 128 x 128 fp32 accumulators over 8 warps
# are the 128 registers a thread of the plain 128 x 256 tile.
PLAIN_CONFIGS = [
    _config(128, 256, 3, 8), _config(128, 256, 3, 8, flatten=True), _config(128, 128, 4, 8),
    _config(128, 128, 4, 8, flatten=True), _config(128, 128, 5, 4), _config(64, 128, 5, 4),
]
GATED_CONFIGS = [
    _config(128, 128, 3, 8), _config(128, 128, 3, 8, flatten=True), _config(128, 128, 4, 8),
    _config(128, 64, 4, 8), _config(128, 64, 5, 4), _config(64, 128, 4, 4),
]


def _dividing_align(configs, named_args, **kwargs):
    align = kwargs.get("ALIGN", named_args.get("ALIGN"))
    return [c for c in configs if align % c.kwargs["BM"] == 0]


_KEY = ["M", "N", "K", "ALIGN", "SCATTER"]
plain_autotuned = triton.autotune(PLAIN_CONFIGS, key=_KEY,
                                  prune_configs_by={"early_config_prune": _dividing_align})(grouped_gemm_kernel)
gated_autotuned = triton.autotune(GATED_CONFIGS, key=_KEY,
                                  prune_configs_by={"early_config_prune": _dividing_align})(grouped_gemm_kernel)
# Each (shape, mode)'s pick once tuned, launched directly afterwards: the autotuner's
# per-call dispatch is host time an eager caller waits on (triton_matmul's docstring).
_TUNED: dict[tuple, dict] = {}


def check_grouped_gemm_inputs(x: torch.Tensor, weight: torch.Tensor, block_experts: torch.Tensor,
                              used_rows: torch.Tensor, gated: bool, row_scale: torch.Tensor | None,
                              dest_rows: torch.Tensor | None, out_size: int | None, align: int) -> None:
    """Raise ValueError on anything the kernel cannot take."""
    if x.dim() != 2 or weight.dim() != 3:
        raise ValueError(f"x must be (rows, K) and weight (experts, N, K); got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    rows, k = x.shape
    experts, n_rows, k_w = weight.shape
    if k_w != k or k == 0 or n_rows == 0 or experts == 0:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)}: K must match; N, K, experts > 0")
    if gated and n_rows % 2:
        raise ValueError(f"a gated weight stacks gate rows then up rows: (experts, 2N, K), got {tuple(weight.shape)}")
    if x.dtype not in DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share one dtype of float16, bfloat16, float32; got {x.dtype} and "
                         f"{weight.dtype}")
    if align < 1 or rows % align:
        raise ValueError(f"x has {rows} rows: the padded layout has a multiple of align = {align} (routing.py)")
    if block_experts.shape != (rows // align,) or block_experts.dtype != torch.int32:
        raise ValueError(f"block_experts must be int32 ({rows // align},), one expert per {align} rows; got "
                         f"{block_experts.dtype} {tuple(block_experts.shape)}")
    if used_rows.shape != (1,) or used_rows.dtype != torch.int32:
        raise ValueError(f"used_rows must be an int32 tensor of one element, got {used_rows.dtype} "
                         f"{tuple(used_rows.shape)}")
    if (row_scale is None) != (dest_rows is None) or (dest_rows is None) != (out_size is None):
        raise ValueError("row_scale, dest_rows and out_size come together (the scattering epilogue) or not at all")
    if dest_rows is not None:
        if gated:
            raise ValueError("the gated epilogue does not scatter: scale and scatter the down projection")
        if row_scale.shape != (rows,) or row_scale.dtype != torch.float32:
            raise ValueError(f"row_scale must be float32 ({rows},), got {row_scale.dtype} {tuple(row_scale.shape)}")
        if dest_rows.shape != (rows,) or dest_rows.dtype != torch.int32:
            raise ValueError(f"dest_rows must be int32 ({rows},), got {dest_rows.dtype} {tuple(dest_rows.shape)}")
        if out_size < 0:
            raise ValueError(f"out_size must be >= 0, got {out_size}")
    tensors = [t for t in (x, weight, block_experts, used_rows, row_scale, dest_rows) if t is not None]
    if any(t.device != x.device for t in tensors):
        raise ValueError(f"all tensors must be on x's device {x.device}")
    if any(not t.is_contiguous() for t in tensors):
        raise ValueError("x, weight and the layout tensors must be contiguous")
    if k * x.element_size() % 16 or x.data_ptr() % 16 or weight.data_ptr() % 16:
        raise ValueError(f"K = {k} {x.dtype} elements: TMA reads rows of 16-byte multiples from 16-byte aligned "
                         f"x and weight")
    if max(x.numel(), weight.numel(), max(rows, out_size or 0) * n_rows) >= 2**31:
        raise ValueError("an operand or the output has 2^31 elements or more: the descriptors' coordinates are 32-bit")


def grouped_gemm(x: torch.Tensor, weight: torch.Tensor, block_experts: torch.Tensor, used_rows: torch.Tensor, *,
                 gated: bool = False, row_scale: torch.Tensor | None = None, dest_rows: torch.Tensor | None = None,
                 out_size: int | None = None, align: int = ROW_ALIGN, config: dict | None = None) -> torch.Tensor:
    """Row r of x times its expert's weight: x (rows, K) in the padded layout of
    `routing.sort_by_expert` (`align` rows a block, block_experts, used_rows), weight
    (experts, N, K); fp32 accumulation, one rounding to x's dtype.

    Plain: out (rows, N); rows past used_rows are not written. gated: weight is
    (experts, 2N, K), gate rows then up rows, and out (rows, N) = silu(x W_gate^T) * (x W_up^T).
    With row_scale, dest_rows and out_size: out (out_size, N), row r's result times
    row_scale[r] stored at row dest_rows[r] (dropped where -1). `config` (BM, BN, BK,
    GROUP_M, FLATTEN, num_stages, num_warps; BM dividing align) skips the autotuner; on
    the CPU (the Triton interpreter) one small tile runs.
    """
    check_grouped_gemm_inputs(x, weight, block_experts, used_rows, gated, row_scale, dest_rows, out_size, align)
    return launch_grouped_gemm(x, weight, block_experts, used_rows, gated, row_scale, dest_rows, out_size, align,
                               config)


def launch_grouped_gemm(x, weight, block_experts, used_rows, gated, row_scale, dest_rows, out_size, align,
                        config) -> torch.Tensor:
    """grouped_gemm on checked inputs."""
    rows, k = x.shape
    experts, n = weight.shape[0], weight.shape[1] // (2 if gated else 1)
    scatter = dest_rows is not None
    out = torch.empty((out_size if scatter else rows, n), dtype=x.dtype, device=x.device)
    if rows == 0 or out.numel() == 0:
        return out
    operands = (x, weight, out, block_experts, used_rows, row_scale if scatter else used_rows,
                dest_rows if scatter else used_rows, rows, n, k, experts, out.stride(0))
    mode = dict(ALIGN=align, GATED=gated, SCATTER=scatter, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32")
    key = (rows, n, k, align, gated, scatter, x.dtype, x.device)
    if config is None:
        config = _TUNED.get(key)
    if config is None and not x.is_cuda:
        config = INTERPRETER_CONFIG
    if config is None:
        tuner = gated_autotuned if gated else plain_autotuned
        programs = _sm_count(x.device)
        tuner[(programs,)](*operands, NUM_PROGRAMS=programs, **mode)
        best = tuner.best_config
        _TUNED[key] = dict(best.kwargs, num_stages=best.num_stages, num_warps=best.num_warps)
        return out
    if align % config["BM"]:
        raise ValueError(f"the tile height BM = {config['BM']} must divide align = {align}")
    blocks = {name: config[name] for name in ("BM", "BN", "BK", "GROUP_M")}
    blocks["FLATTEN"] = config.get("FLATTEN", False)
    programs = _sm_count(x.device) if x.is_cuda else INTERPRETER_PROGRAMS
    grouped_gemm_kernel[(programs,)](*operands, NUM_PROGRAMS=programs, **blocks, **mode,
                                     num_stages=config.get("num_stages", 3), num_warps=config.get("num_warps", 4))
    return out


_SM_COUNT: dict[torch.device, int] = {}


def _sm_count(device: torch.device) -> int:
    if device not in _SM_COUNT:
        _SM_COUNT[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNT[device]


def grouped_gemm_reference(x: torch.Tensor, weight: torch.Tensor, block_experts: torch.Tensor,
                           used_rows: torch.Tensor, *, gated: bool = False, row_scale: torch.Tensor | None = None,
                           dest_rows: torch.Tensor | None = None, out_size: int | None = None,
                           align: int = ROW_ALIGN) -> torch.Tensor:
    """The same math in float64, expert block by expert block (the tests' oracle). Rows the
    kernel leaves unwritten are NaN here."""
    used = int(used_rows[0])
    n = weight.shape[1] // (2 if gated else 1)
    y = torch.full((x.shape[0], n), float("nan"), dtype=torch.float64, device=x.device)
    for block in range(used // align):
        rows = slice(block * align, (block + 1) * align)
        w = weight[int(block_experts[block])].double()
        v = x[rows].double() @ w.T
        if gated:
            v = torch.nn.functional.silu(v[:, :n]) * v[:, n:]
        y[rows] = v
    if dest_rows is None:
        return y
    out = torch.full((out_size, n), float("nan"), dtype=torch.float64, device=x.device)
    keep = dest_rows[:used] >= 0
    out[dest_rows[:used][keep].long()] = y[:used][keep] * row_scale[:used][keep, None].double()
    return out

"""Grouped GEMM for mixture-of-experts layers in Triton: all experts in one launch.

Two kernels. `grouped_gemm_kernel` (below) reads the padded layout of `routing.py` and can
scatter in its epilogue (the Mixtral layer of `ffn.py`). `grouped_layout_kernel` (the second
half of the file) takes DeepGEMM's two layouts, contiguous and masked, in bf16 or block-scaled
FP8, SwiGLU fused or not (`grouped_gemm_contiguous`, `grouped_gemm_masked`; the ops
`kforge.ops.grouped_gemm_contiguous` / `_masked`); its contract and design are the comment
heading that half. What follows describes the first; both share the schedule and the tiles.

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

from kforge.device import sm_count

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
        programs = sm_count(x.device)
        tuner[(programs,)](*operands, NUM_PROGRAMS=programs, **mode)
        best = tuner.best_config
        _TUNED[key] = dict(best.kwargs, num_stages=best.num_stages, num_warps=best.num_warps)
        return out
    if align % config["BM"]:
        raise ValueError(f"the tile height BM = {config['BM']} must divide align = {align}")
    blocks = {name: config[name] for name in ("BM", "BN", "BK", "GROUP_M")}
    blocks["FLATTEN"] = config.get("FLATTEN", False)
    programs = sm_count(x.device) if x.is_cuda else INTERPRETER_PROGRAMS
    grouped_gemm_kernel[(programs,)](*operands, NUM_PROGRAMS=programs, **blocks, **mode,
                                     num_stages=config.get("num_stages", 3), num_warps=config.get("num_warps", 4))
    return out


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


# --- DeepGEMM's two layouts: contiguous and masked, bf16 and block-scaled FP8 -------------------
#
# The kernel above reads the dispatch's padded layout (an expert per `align`-row block) and
# scatters in its epilogue. DeepGEMM's grouped GEMMs fix two layouts instead, and the kernel
# below runs both, in bf16 (fp16, fp32) and in FP8 with DeepGEMM's block scales:
#
# Contiguous (prefill): x [M, K] holds the groups one after another along M, each group's run
# starting at a multiple of `align` rows (padded); m_indices [M] int32 names each row's group,
# -1 on a padding row. out [M, N]. A BM-row tile (BM dividing align) reads its group from its
# first row; a tile whose first row is -1 (the buffer's tail past the last group) is skipped.
# Each tile stores only the rows whose m_indices equals its group: padding rows (-1) are left
# as they were allocated, and a row of another group, which a run misaligned against `align`
# would put in the tile, is left unwritten too (a visible hole, not a wrong product).
#
# Masked (decode): x [E, max_m, K], a fixed block an expert, with masked_m [E] valid rows in
# expert e's block (the rest whatever the buffer held). out [E, max_m, N]; rows r >=
# masked_m[e] are NOT written: a decode buffer sized for the worst case is mostly empty, and
# writing zeros there would cost as many bytes as the useful rows. Tiles are scheduled over
# the valid rows only: every program reads masked_m once (E <= E_BLOCK counts, one vector),
# prefix-sums the per-expert tile counts and maps each of its persistent-loop tiles to
# (expert, row tile, column tile) by one comparison against that prefix sum, so the empty
# experts and the empty tails of the blocks cost no loop iterations and the programs share
# the real tiles evenly (DeepGEMM's scheduler does the same walk over groups).
#
# Epilogues: plain, out = x W_e^T; gated (SwiGLU), weight [E, 2N, K] as [gate; up] rows per
# expert (as ops.swiglu reads a gate_up projection), out [.., N] = silu(x W_gate^T) * (x W_up^T),
# the two products accumulated side by side from one x tile, the (rows, 2N) projection never
# stored. fp32 accumulation, one rounding to the output dtype.
#
# FP8 (DeepGEMM's format; `kernels/quant/fp8_gemm.py` explains the promotion): x e4m3 with
# x_scale per 1 x 128 (contiguous [M, K/128], masked [E, max_m, K/128]; any strides, so
# DeepGEMM's M-major transposed scales are taken as they are), weight e4m3 with w_scale
# [E, ceil(NW/128), K/128] per 128 x 128 block of each expert's [NW, K] (NW = N, or 2N gated).
# BK is 128, one scale block a K step; each step's dot goes into a fresh fp32 partial that is
# scaled by x_scale[row] * w_scale[col // 128] and added to the running sum on the CUDA cores
# (promotion: the tensor cores never carry more than 128 products). The weight scale is loaded
# per column, so a tile of any width, and an up half starting mid-block (N not a multiple of
# 128), read the right block; that costs one more multiply an element a step than the scalar
# scale of a tile inside one block (`fp8_gemm.py`). Output bf16.
#
# FLOPs: 2 * rows * N * K (gated 4 *), counting the padding rows of computed tiles. Bytes: x
# and the weights of the experts with rows read once (a weight panel is re-read from L2 by
# the expert's other row tiles), out written once; FP8 halves the operand bytes. At decode
# (masked, a few rows an expert) the weights are the bytes: the floor is E_used * NW * K *
# itemsize / bandwidth.

LAYOUTS = ("contiguous", "masked")
LAYOUT_INTERPRETER_CONFIG = {"BM": 16, "BN": 32, "BK": 32, "GROUP_M": 2}
FP8_INTERPRETER_CONFIG = {"BM": 16, "BN": 32, "BK": 128, "GROUP_M": 2}
FP8_BLOCK = 128  # K (and weight rows) covered by one block scale


@triton.jit
def _masked_tile(tile, ends, tiles, counts, experts, tiles_n, BM: tl.constexpr, GROUP_M: tl.constexpr):
    # the expert whose tiles hold `tile`: how many experts' tiles end at or before it
    e = tl.sum((ends <= tile).to(tl.int32), axis=0)
    mine = experts == e
    start = tl.sum(tl.where(mine, ends - tiles, 0), axis=0)
    rows = tl.sum(tl.where(mine, counts, 0), axis=0)
    tm, tn = _tile_coords(tile - start, tl.cdiv(rows, BM), tiles_n, GROUP_M)
    return e, rows, tm, tn


@triton.jit
def grouped_layout_kernel(x_ptr, w_ptr, out_ptr, groups_ptr, x_scale_ptr, w_scale_ptr,
                          M, N, K, E, stride_xse, stride_xsm, stride_xsk, M_BUCKET,
                          NUM_PROGRAMS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                          GROUP_M: tl.constexpr, E_BLOCK: tl.constexpr, ALIGN: tl.constexpr,
                          MASKED: tl.constexpr, GATED: tl.constexpr, FP8: tl.constexpr,
                          DOT_PRECISION: tl.constexpr):
    # M: the rows of x (contiguous) or of each expert's block (masked, max_m). N: output
    # columns (gated: half the weight's rows). M_BUCKET (a power of two of M) and ALIGN only
    # key and prune the autotuner: a new token count reuses its bucket's pick.
    NW = 2 * N if GATED else N
    if MASKED:
        x_desc = tl.make_tensor_descriptor(x_ptr, shape=[E, M, K], strides=[M * K, K, 1], block_shape=[1, BM, BK])
    else:
        x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    # a box reaching past an expert's NW rows reads zeros (the 3-D shape), never the next expert
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[E, NW, K], strides=[NW * K, K, 1], block_shape=[1, BN, BK])
    tiles_n = tl.cdiv(N, BN)
    k_blocks = tl.cdiv(K, BK)
    scale_rows = tl.cdiv(NW, BK)  # FP8: BK == 128, one weight scale block per 128 rows
    if MASKED:
        experts = tl.arange(0, E_BLOCK)
        counts = tl.minimum(tl.load(groups_ptr + experts, mask=experts < E, other=0), M)
        tiles = tl.cdiv(counts, BM) * tiles_n
        ends = tl.cumsum(tiles, axis=0)
        total = tl.sum(tiles, axis=0)
    else:
        total = tl.cdiv(M, BM) * tiles_n
    for tile in tl.range(tl.program_id(0), total, NUM_PROGRAMS):
        if MASKED:
            e, rows_e, tm, tn = _masked_tile(tile, ends, tiles, counts, experts, tiles_n, BM, GROUP_M)
        else:
            tm, tn = _tile_coords(tile, tl.cdiv(M, BM), tiles_n, GROUP_M)
            e = tl.load(groups_ptr + tm * BM)
            rows_e = M
        if e >= 0:
            rows = tm * BM + tl.arange(0, BM)
            cols = tn * BN + tl.arange(0, BN)
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            if GATED:
                acc_up = tl.zeros((BM, BN), dtype=tl.float32)
            for kb in range(0, k_blocks):
                k = kb * BK
                if MASKED:
                    x = x_desc.load([e, tm * BM, k]).reshape(BM, BK)
                else:
                    x = x_desc.load([tm * BM, k])
                w = w_desc.load([e, tn * BN, k]).reshape(BN, BK)
                if GATED:
                    w_up = w_desc.load([e, N + tn * BN, k]).reshape(BN, BK)
                if FP8:
                    xs = tl.load(x_scale_ptr + e * stride_xse + rows * stride_xsm + kb * stride_xsk,
                                 mask=rows < rows_e, other=0.0)
                    ws = tl.load(w_scale_ptr + (e * scale_rows + cols // BK) * k_blocks + kb, mask=cols < N,
                                 other=0.0)
                    acc += tl.dot(x, w.T) * (xs[:, None] * ws[None, :])
                    if GATED:
                        ws_up = tl.load(w_scale_ptr + (e * scale_rows + (N + cols) // BK) * k_blocks + kb,
                                        mask=cols < N, other=0.0)
                        acc_up += tl.dot(x, w_up.T) * (xs[:, None] * ws_up[None, :])
                else:
                    acc = tl.dot(x, w.T, acc, input_precision=DOT_PRECISION)
                    if GATED:
                        acc_up = tl.dot(x, w_up.T, acc_up, input_precision=DOT_PRECISION)
            if GATED:
                acc = acc * tl.sigmoid(acc) * acc_up  # silu(gate) * up, in fp32
            if MASKED:
                keep = rows < rows_e
                out_rows = e.to(tl.int64) * M + rows
            else:
                keep = tl.load(groups_ptr + rows, mask=rows < M, other=-1) == e
                out_rows = rows.to(tl.int64)
            mask = keep[:, None] & (cols < N)[None, :]
            tl.store(out_ptr + out_rows[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def _layout_config(bm, bn, bk, stages, warps):
    return triton.Config({"BM": bm, "BN": bn, "BK": bk, "GROUP_M": 8}, num_stages=stages, num_warps=warps)


# bf16: the lists above, BK 64 (the plain kernel's mainloop, its winners on paper). 64-row
# tiles for decode, where a block holds a few rows and only the weight panel's bytes count.
# FP8: BK 128 (a scale block a step); promotion keeps a partial beside each accumulator, so
# 128 x 128 (acc + partial: 128 registers a thread over 8 warps) is the widest plain tile and
# the gated one, with two accumulators, halves BN (fp8_gemm.py's register budget).
LAYOUT_CONFIGS = {
    (False, False): [_layout_config(128, 256, 64, 3, 8), _layout_config(128, 128, 64, 4, 8),
                     _layout_config(128, 128, 64, 5, 4), _layout_config(64, 128, 64, 5, 4),
                     _layout_config(64, 256, 64, 4, 8)],
    (True, False): [_layout_config(128, 128, 64, 3, 8), _layout_config(128, 128, 64, 4, 8),
                    _layout_config(128, 64, 64, 4, 8), _layout_config(64, 128, 64, 4, 4),
                    _layout_config(64, 64, 64, 5, 4)],
    (False, True): [_layout_config(128, 128, 128, 4, 8), _layout_config(128, 128, 128, 5, 8),
                    _layout_config(64, 128, 128, 6, 4), _layout_config(128, 64, 128, 5, 4)],
    (True, True): [_layout_config(128, 64, 128, 4, 8), _layout_config(128, 64, 128, 3, 8),
                   _layout_config(64, 64, 128, 5, 4), _layout_config(64, 128, 128, 4, 8)],
}


def _tiles_fit(configs, named_args, **kwargs):
    """Contiguous: the tile height must divide the runs' alignment (a tile inside one group)."""
    align = kwargs.get("ALIGN", named_args.get("ALIGN"))
    kept = [c for c in configs if kwargs.get("MASKED", named_args.get("MASKED")) or align % c.kwargs["BM"] == 0]
    return kept or configs[-1:]


_LAYOUT_KEY = ["M_BUCKET", "N", "K", "E", "ALIGN", "MASKED", "GATED", "FP8"]


_LAYOUT_TUNERS = {mode: triton.autotune(configs, key=_LAYOUT_KEY, prune_configs_by={"early_config_prune": _tiles_fit})(
    grouped_layout_kernel) for mode, configs in LAYOUT_CONFIGS.items()}
_LAYOUT_TUNED: dict[tuple, dict] = {}


def check_layout_inputs(x: torch.Tensor, weight: torch.Tensor, groups: torch.Tensor, layout: str, gated: bool,
                        x_scale: torch.Tensor | None, w_scale: torch.Tensor | None, align: int) -> None:
    """Raise a one-line ValueError unless (x, weight, groups[, scales]) is a grouped GEMM of
    `layout` the kernel takes (the op runs the same checks before its CPU fallback)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    want_x = 3 if layout == "masked" else 2
    if not isinstance(x, torch.Tensor) or x.dim() != want_x or not isinstance(weight, torch.Tensor) or \
            weight.dim() != 3:
        shape = "[E, max_m, K]" if layout == "masked" else "[M, K]"
        raise ValueError(f"{layout}: x must be {shape} and weight [E, N, K]; got {tuple(getattr(x, 'shape', ()))} "
                         f"and {tuple(getattr(weight, 'shape', ()))}")
    experts, n_rows, k = weight.shape
    if x.shape[-1] != k or k == 0 or n_rows == 0 or experts == 0:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)}: K must match; N, K, E > 0")
    if gated and n_rows % 2:
        raise ValueError(f"a gated weight stacks gate rows then up rows, [E, 2N, K]: got {tuple(weight.shape)}")
    if layout == "masked":
        if x.shape[0] != experts:
            raise ValueError(f"masked: x has {x.shape[0]} expert blocks and weight {experts} experts")
        if groups.shape != (experts,) or groups.dtype != torch.int32:
            raise ValueError(f"masked_m must be int32 [{experts}], got {groups.dtype} {tuple(groups.shape)}")
    else:
        if groups.shape != (x.shape[0],) or groups.dtype != torch.int32:
            raise ValueError(f"m_indices must be int32 [{x.shape[0]}] (a group a row, -1 on padding), got "
                             f"{groups.dtype} {tuple(groups.shape)}")
        if align < 1:
            raise ValueError(f"align must be >= 1, got {align}")
    fp8 = x.dtype == torch.float8_e4m3fn
    if fp8:
        if weight.dtype != torch.float8_e4m3fn or x_scale is None or w_scale is None:
            raise ValueError("fp8: x and weight both float8_e4m3fn, with x_scale and w_scale")
        if k % FP8_BLOCK:
            raise ValueError(f"fp8 block scaling needs K (= {k}) to be a multiple of {FP8_BLOCK}")
        want_xs = (*x.shape[:-1], k // FP8_BLOCK)
        want_ws = (experts, -(-n_rows // FP8_BLOCK), k // FP8_BLOCK)
        for name, t, want in (("x_scale", x_scale, want_xs), ("w_scale", w_scale, want_ws)):
            if t.dtype != torch.float32 or tuple(t.shape) != want:
                raise ValueError(f"{name} must be float32 {list(want)}, got {t.dtype} {list(t.shape)}")
    else:
        if x.dtype not in DTYPES or weight.dtype != x.dtype:
            raise ValueError(f"x and weight must share one dtype of float16, bfloat16, float32 (or both be "
                             f"float8_e4m3fn); got {x.dtype} and {weight.dtype}")
        if x_scale is not None or w_scale is not None:
            raise ValueError("scales go with float8_e4m3fn operands only")
    tensors = [t for t in (x, weight, groups, x_scale, w_scale) if t is not None]
    if any(t.device != x.device for t in tensors):
        raise ValueError(f"all tensors must be on x's device {x.device}")
    if not (x.is_contiguous() and weight.is_contiguous() and groups.is_contiguous()):
        raise ValueError("x, weight and the group tensor must be contiguous")
    if k * x.element_size() % 16 or x.data_ptr() % 16 or weight.data_ptr() % 16:
        raise ValueError(f"K = {k} {x.dtype} elements: TMA reads rows of 16-byte multiples from 16-byte aligned "
                         f"x and weight")
    # the descriptors take 32-bit sizes and the kernel forms the strides NW * K and max_m * K in
    # 32 bits; whole tensors may pass 2^31 elements (DeepSeek-V3's w13 has 7.5e9): the expert
    # is a descriptor coordinate, and output offsets are 64-bit
    if max(x.shape[-2] * k, n_rows * k, x.shape[0]) >= 2**31:
        raise ValueError("a row block of x or one expert's weight has 2^31 elements or more: the kernel's strides are "
                         "32-bit")


# FP8, contiguous, not gated, on Hopper: the CUDA block-scaled GEMM built for groups (quant/fp8_block_gemm.cu,
# GROUPED), in place of the Triton kernel below (661 TFLOP/s at DeepGEMM's 4 x 8192 x 4096 x 7168 shape on
# an H200; the CUDA kernel ran at ~1,390 TFLOP/s ungrouped on an H100). Grouped, on the H200: 1,267-1,283
# TFLOP/s kernel-alone, 1.03x a loop of block-scaled _scaled_mm, its GPU tests passing (docs/moe.md). False
# keeps every call on the Triton kernel.
CUDA_FP8_CONTIGUOUS = True


def cuda_fp8_contiguous_fits(x: torch.Tensor, weight: torch.Tensor, layout: str, gated: bool, align: int) -> bool:
    """Whether the CUDA grouped FP8 GEMM takes a checked grouped GEMM: FP8 contiguous, not gated, on a
    Hopper GPU (its build is sm_90a's alone), runs aligned to its 128-row tile, N a multiple of 8."""
    return (CUDA_FP8_CONTIGUOUS and layout == "contiguous" and not gated and x.dtype == torch.float8_e4m3fn
            and x.is_cuda and torch.cuda.get_device_capability(x.device)[0] == 9 and align % 128 == 0
            and weight.shape[1] % 8 == 0)


def grouped_gemm_layout(x: torch.Tensor, weight: torch.Tensor, groups: torch.Tensor, layout: str, *,
                        gated: bool = False, x_scale: torch.Tensor | None = None,
                        w_scale: torch.Tensor | None = None, align: int = ROW_ALIGN,
                        config: dict | None = None) -> torch.Tensor:
    """DeepGEMM's grouped GEMM, contiguous or masked (the section's comment above):

    contiguous: x [M, K], groups = m_indices [M] int32 (-1 on padding, runs starting at
      multiples of `align`) -> out [M, N]; padding rows not written.
    masked: x [E, max_m, K], groups = masked_m [E] int32 -> out [E, max_m, N]; rows past
      masked_m[e] not written.

    weight [E, N, K] (gated: [E, 2N, K], gate rows then up rows, out N = silu(gate) * up).
    bf16/fp16/fp32 operands give out in their dtype; float8_e4m3fn operands with x_scale
    (1 x 128 blocks) and w_scale (128 x 128 blocks per expert) give bf16, promoted every
    128 K. `config` (BM, BN, BK, GROUP_M, num_stages, num_warps) skips the autotuner; on the
    CPU (the Triton interpreter) one small tile runs.
    """
    check_layout_inputs(x, weight, groups, layout, gated, x_scale, w_scale, align)
    masked, fp8 = layout == "masked", x.dtype == torch.float8_e4m3fn
    if config is None and cuda_fp8_contiguous_fits(x, weight, layout, gated, align):
        from kforge.kernels.quant.fp8_block_gemm import fp8_grouped_gemm_contiguous

        return fp8_grouped_gemm_contiguous(x, weight, groups, x_scale, w_scale, align=align)
    experts, n_rows, k = weight.shape
    n = n_rows // 2 if gated else n_rows
    m = x.shape[1] if masked else x.shape[0]
    out_dtype = torch.bfloat16 if fp8 else x.dtype
    out = torch.empty((*x.shape[:-1], n), dtype=out_dtype, device=x.device)
    if out.numel() == 0:
        return out
    if fp8:
        strides = x_scale.stride() if masked else (0, *x_scale.stride())
        w_scale = w_scale.contiguous()
    else:
        strides, x_scale, w_scale = (0, 0, 0), groups, groups  # unused pointers
    operands = (x, weight, out, groups, x_scale, w_scale, m, n, k, experts, *strides)
    mode = dict(E_BLOCK=triton.next_power_of_2(experts), ALIGN=1 if masked else align, MASKED=masked, GATED=gated,
                FP8=fp8, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32")
    key = (m, n, k, experts, mode["ALIGN"], masked, gated, x.dtype, x.device)
    if config is None:
        config = _LAYOUT_TUNED.get(key)
    if config is None and not x.is_cuda:
        config = FP8_INTERPRETER_CONFIG if fp8 else LAYOUT_INTERPRETER_CONFIG
    if config is None:
        tuner = _LAYOUT_TUNERS[(gated, fp8)]
        programs = sm_count(x.device)
        tuner[(programs,)](*operands, triton.next_power_of_2(m), NUM_PROGRAMS=programs, **mode)
        best = tuner.best_config
        _LAYOUT_TUNED[key] = dict(best.kwargs, num_stages=best.num_stages, num_warps=best.num_warps)
        return out
    if not masked and align % config["BM"]:
        raise ValueError(f"the tile height BM = {config['BM']} must divide align = {align}")
    if fp8 and config.get("BK", FP8_BLOCK) != FP8_BLOCK:
        raise ValueError(f"fp8 block scaling needs BK = {FP8_BLOCK} (one scale block a K step), got {config['BK']}")
    blocks = {name: config[name] for name in ("BM", "BN", "BK", "GROUP_M")}
    programs = sm_count(x.device) if x.is_cuda else INTERPRETER_PROGRAMS
    grouped_layout_kernel[(programs,)](*operands, triton.next_power_of_2(m), NUM_PROGRAMS=programs, **blocks, **mode,
                                       num_stages=config.get("num_stages", 3), num_warps=config.get("num_warps", 4))
    return out


def grouped_gemm_contiguous(x: torch.Tensor, weight: torch.Tensor, m_indices: torch.Tensor, *, gated: bool = False,
                            x_scale: torch.Tensor | None = None, w_scale: torch.Tensor | None = None,
                            align: int = ROW_ALIGN, config: dict | None = None) -> torch.Tensor:
    """grouped_gemm_layout(..., "contiguous"): x [M, K], m_indices [M] -> out [M, N]."""
    return grouped_gemm_layout(x, weight, m_indices, "contiguous", gated=gated, x_scale=x_scale, w_scale=w_scale,
                               align=align, config=config)


def grouped_gemm_masked(x: torch.Tensor, weight: torch.Tensor, masked_m: torch.Tensor, *, gated: bool = False,
                        x_scale: torch.Tensor | None = None, w_scale: torch.Tensor | None = None,
                        config: dict | None = None) -> torch.Tensor:
    """grouped_gemm_layout(..., "masked"): x [E, max_m, K], masked_m [E] -> out [E, max_m, N]."""
    return grouped_gemm_layout(x, weight, masked_m, "masked", gated=gated, x_scale=x_scale, w_scale=w_scale,
                               config=config)


def dequantize_grouped(x: torch.Tensor, scale: torch.Tensor | None, block_rows: int) -> torch.Tensor:
    """fp32 values of a grouped operand: x itself, or fp8 x times its block scales (block_rows
    x 128 blocks over the last two dims: 1 for activations, 128 for weights)."""
    if scale is None:
        return x.float()
    expanded = scale.repeat_interleave(FP8_BLOCK, -1)
    if block_rows > 1:
        expanded = expanded.repeat_interleave(block_rows, -2)[..., :x.shape[-2], :]
    return x.float() * expanded


def grouped_gemm_layout_reference(x: torch.Tensor, weight: torch.Tensor, groups: torch.Tensor, layout: str, *,
                                  gated: bool = False, x_scale: torch.Tensor | None = None,
                                  w_scale: torch.Tensor | None = None, dtype: torch.dtype = torch.float64,
                                  fill: float = float("nan")) -> torch.Tensor:
    """The same product group by group in `dtype` (float64: the tests' oracle; float32: the op's
    CPU path), from the dequantized operands; rows the kernel leaves unwritten hold `fill`."""
    xf = dequantize_grouped(x, x_scale, 1).to(dtype)
    wf = dequantize_grouped(weight, w_scale, FP8_BLOCK).to(dtype)
    n = weight.shape[1] // 2 if gated else weight.shape[1]

    def product(rows, e):
        v = rows @ wf[e].T
        return torch.nn.functional.silu(v[:, :n]) * v[:, n:] if gated else v

    out = torch.full((*x.shape[:-1], n), fill, dtype=dtype, device=x.device)
    for e in range(weight.shape[0]):
        if layout == "masked":
            count = min(int(groups[e]), x.shape[1])
            out[e, :count] = product(xf[e, :count], e)
        else:
            mine = groups == e
            if mine.any():
                out[mine] = product(xf[mine], e)
    return out


def quantize_grouped_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight [E, NW, K], w_scale [E, ceil(NW/128), K/128]): each expert's [NW, K] in
    128 x 128 blocks (`ops.quantize_fp8(w_e, "block", block=(128, 128))`, expert by expert, so a
    block never spans two experts)."""
    from kforge.ops.quant import quantize_fp8

    pairs = [quantize_fp8(w_e, "block", block=(FP8_BLOCK, FP8_BLOCK)) for w_e in weight]
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


def quantize_grouped_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 x, x_scale) per 1 x 128 block of rows: x [M, K] -> [M, K/128] scales, x [E, max_m, K]
    -> [E, max_m, K/128]."""
    from kforge.ops.quant import quantize_fp8

    q, s = quantize_fp8(x.reshape(-1, x.shape[-1]), "block", block=(1, FP8_BLOCK))
    return q.view(x.shape), s.view(*x.shape[:-1], s.shape[-1])


def contiguous_m_indices(layout) -> torch.Tensor:
    """m_indices [rows] int32 of a dispatch layout (`routing.ExpertRows`): each row's expert,
    -1 on padding rows and past used_rows (no host sync)."""
    expert_of_row = layout.block_experts.repeat_interleave(layout.align, output_size=layout.rows)
    return torch.where(layout.dest_rows >= 0, expert_of_row, -1).to(torch.int32)


def grouped_gemm_layout_flops(rows: int, n: int, k: int, gated: bool = False) -> int:
    """Tensor-core FLOPs of `rows` rows (real and padding rows of computed tiles alike): 2 * rows
    * N * K, twice that gated (gate and up)."""
    return (4 if gated else 2) * rows * n * k

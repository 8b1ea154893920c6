"""Cross-entropy straight from the last hidden states: loss_t = lse_v(x_t . W_v) - x_t . W_{y_t},
with the logits computed tile by tile and never stored, in Triton.

The math. For T tokens x (T, D), the LM head W (V, D) and targets y (T,), the logits are
z = x W^T (T, V) and each token's loss is log sum_v exp(z_tv) - z_{t, y_t}. The log-sum-exp
splits over any partition of the vocabulary into tiles j, each keeping only its max and
its sum of exponentials relative to that max:

    m_j = max_{v in j} z_v        s_j = sum_{v in j} exp(z_v - m_j)
    lse = M + log sum_j s_j exp(m_j - M),   M = max_j m_j

So a GEMM whose epilogue reduces each (BM, BN) logits tile to (m_j, s_j) per row, and
picks out z_{t, y_t} in the one tile that holds column y_t, leaves two fp32 numbers per row
and tile (T x V/BN of them) instead of the T x V logits. A second small kernel merges them
per row as above. Targets equal to ignore_index (-100, F.cross_entropy's default) lose 0
and leave the mean, which is a sum and a count in PyTorch: two tiny launches.

What it saves. Eager (F.linear, then F.cross_entropy on fp32 logits) writes the bf16
logits (2 bytes per logit), reads them to make fp32 ones (2 + 4), and log_softmax reads
those and writes fp32 log-probabilities (4 + 4, more where it reads twice): 16 bytes
per logit or more, 8.4 GB at T = 4096, V = 128256 (~2.8 ms at 3 TB/s), and 5 GB of peak
memory. Here the partials are 8 bytes per row and *tile* (1/BN of a logit's), and peak
memory is x, W and 33 MB of partials.

The GEMM is `gemm_epilogue.py`'s mainloop (persistent, TMA boxes, wgmma) with tiles
walked vocab tile by vocab tile, every row tile of one vocab tile before the next: W
(1 GB at Llama-3's V = 128256, D = 4096) then streams from HBM once while x (32 MB at
T = 4096) stays in the 50 MB L2. Columns past V load as zeros from TMA and are masked to
-inf before the max. The logits stay fp32 (eager rounds them to bf16 first: within
~2^-9 of each other, averaged away by the softmax).

Expected on the H100 (not measured here): the GEMM's time (2 T V D FLOPs: 4.3 TFLOP at
T = 4096, ~5.9 ms at 0.95x cuBLAS) plus ~4% for the epilogue (one MUFU exp per logit at
16 a clock per SM, ~150 us; a few fp32 compares and selects) and a ~20 us merge, against
eager's ~5.6 ms GEMM plus ~3-4 ms of cross-entropy passes: ~1.4x.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kforge.device import sm_count

# Importing it also installs the scratch allocator for device-built TMA descriptors.
from kforge.kernels.fused.gemm_epilogue import DTYPES, INTERPRETER_PROGRAMS, SHARED_LIMIT

INTERPRETER_CONFIG = {"BM": 16, "BN": 32, "BK": 32, "FLATTEN": False}
MERGE_ROWS = 64  # rows per program of the merge
MERGE_TILES = 32  # vocab tiles merged per step


@triton.jit
def lse_partials_kernel(x_ptr, w_ptr, target_ptr, max_ptr, sum_ptr, target_logit_ptr, T, V, D,
                        NUM_PROGRAMS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        FLATTEN: tl.constexpr):
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[T, D], strides=[D, 1], block_shape=[BM, BK])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[V, D], strides=[D, 1], block_shape=[BN, BK])
    tiles_t, tiles_v = tl.cdiv(T, BM), tl.cdiv(V, BN)
    for tile in tl.range(tl.program_id(0), tiles_t * tiles_v, NUM_PROGRAMS, flatten=FLATTEN):
        tt, tv = tile % tiles_t, tile // tiles_t  # every row tile of a vocab tile before the next
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, D, BK):
            acc = tl.dot(x_desc.load([tt * BM, k]), w_desc.load([tv * BN, k]).T, acc)
        rows = tt * BM + tl.arange(0, BM)
        cols = tv * BN + tl.arange(0, BN)
        logits = tl.where((cols < V)[None, :], acc, float("-inf"))
        tile_max = tl.max(logits, 1)
        tile_sum = tl.sum(tl.exp(logits - tile_max[:, None]), 1)
        in_rows = rows < T
        tl.store(max_ptr + tv * T + rows, tile_max, mask=in_rows)
        tl.store(sum_ptr + tv * T + rows, tile_sum, mask=in_rows)
        target = tl.load(target_ptr + rows, mask=in_rows, other=-1)
        hit = cols[None, :] == target[:, None]
        mine = in_rows & (target >= tv * BN) & (target < tv * BN + BN)  # this tile holds the target column
        tl.store(target_logit_ptr + rows, tl.sum(tl.where(hit, logits, 0.0), 1), mask=mine)


@triton.jit
def lse_merge_kernel(max_ptr, sum_ptr, target_logit_ptr, target_ptr, loss_ptr, T, tiles_v, ignore_index,
                     BLOCK_T: tl.constexpr, BLOCK_TILES: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_rows = rows < T
    run_max = tl.full([BLOCK_T], float("-inf"), tl.float32)
    run_sum = tl.zeros([BLOCK_T], tl.float32)
    for start in range(0, tiles_v, BLOCK_TILES):
        tiles = start + tl.arange(0, BLOCK_TILES)
        mask = (tiles < tiles_v)[:, None] & in_rows[None, :]
        offs = tiles[:, None] * T + rows[None, :]
        m = tl.load(max_ptr + offs, mask=mask, other=float("-inf"))
        s = tl.load(sum_ptr + offs, mask=mask, other=0.0)
        new_max = tl.maximum(run_max, tl.max(m, 0))
        # every real tile has a finite max, so new_max is finite for rows in range; masked
        # entries have s = 0 and contribute 0 * exp(-inf) = 0
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        run_sum = run_sum * tl.exp(run_max - safe_max) + tl.sum(s * tl.exp(m - safe_max[None, :]), 0)
        run_max = new_max
    lse = run_max + tl.log(tl.where(in_rows, run_sum, 1.0))
    # an ignored row's target logit was never written: select 0, never compute with it
    ignored = tl.load(target_ptr + rows, mask=in_rows, other=ignore_index) == ignore_index
    target_logit = tl.load(target_logit_ptr + rows, mask=in_rows & ~ignored, other=0.0)
    tl.store(loss_ptr + rows, tl.where(ignored, 0.0, lse - target_logit), mask=in_rows)


def _config(bm, bn, stages, warps, flatten=False):
    return triton.Config({"BM": bm, "BN": bn, "BK": 64, "FLATTEN": flatten}, num_stages=stages, num_warps=warps)


def shared_bytes(config: triton.Config) -> int:
    """The ring of x and W boxes (no C tile: nothing (BM, BN) is stored)."""
    return config.num_stages * (config.kwargs["BM"] + config.kwargs["BN"]) * config.kwargs["BK"] * 2


# gemm_epilogue's tiles; with no C staging tile, deeper rings fit. 128 x 256 only flattened:
# unflattened, the epilogue's exp and compare over the 128 x 256 tile spill (ptxas, sm_90).
CONFIGS = [c for c in [
    _config(128, 256, 3, 8, flatten=True), _config(128, 128, 4, 8), _config(128, 128, 5, 8, flatten=True),
    _config(64, 256, 4, 8), _config(64, 128, 6, 4),
] if shared_bytes(c) <= SHARED_LIMIT]
lse_partials_autotuned = triton.autotune(CONFIGS, key=["T", "V", "D"])(lse_partials_kernel)
_TUNED: dict[tuple, dict] = {}


def check_linear_cross_entropy_inputs(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> None:
    """Raise ValueError on anything the kernels cannot take (target values are not checked:
    that would cost a device sync; each must be in [0, V))."""
    if x.dim() != 2 or weight.dim() != 2 or targets.shape != (x.shape[0],):
        raise ValueError(f"x must be (T, D), weight (V, D) and targets (T,); got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}, {tuple(targets.shape)}")
    if x.dtype not in DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share one dtype of float16, bfloat16; got {x.dtype} and {weight.dtype}")
    if targets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"targets must be int32 or int64 class indices, got {targets.dtype}")
    (t, d), v = x.shape, weight.shape[0]
    if weight.shape[1] != d or d == 0 or v == 0 or t == 0:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)}: D must match, all sizes > 0")
    if not x.device == weight.device == targets.device:
        raise ValueError(f"x, weight and targets must share a device; got {x.device}, {weight.device}, "
                         f"{targets.device}")
    if d % 8:
        raise ValueError(f"D = {d} must be a multiple of 8: TMA reads rows of 16-byte multiples")
    for name, tensor in (("x", x), ("weight", weight)):
        if not tensor.is_contiguous() or tensor.data_ptr() % 16:
            raise ValueError(f"{name} must be contiguous and 16-byte aligned (TMA); call .contiguous() first")
    if t * triton.cdiv(v, 16) >= 2**31 or weight.numel() >= 2**31:
        raise ValueError("T x V / 16 or V x D reaches 2^31: the kernels' offsets are 32-bit")


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                         ignore_index: int = -100, reduction: str = "mean",
                         config: dict | None = None) -> torch.Tensor:
    """Cross-entropy of the logits x @ weight.T against `targets`, without the logits.

    x (T, D) and weight (V, D) fp16/bf16, targets (T,) int in [0, V) or `ignore_index`
    (as F.cross_entropy's: such tokens lose 0 and leave the mean). Returns fp32 losses
    (T,) with reduction="none", or their mean over the tokens not ignored (a 0-d tensor)
    with "mean". `config` (BM, BN, BK, FLATTEN, num_stages, num_warps) skips the autotuner.
    """
    if reduction not in ("mean", "none"):
        raise ValueError(f"reduction must be 'mean' or 'none', got {reduction!r}")
    check_linear_cross_entropy_inputs(x, weight, targets)
    losses = launch_linear_cross_entropy(x, weight, targets, int(ignore_index), config)
    if reduction == "none":
        return losses
    return losses.sum() / (targets != ignore_index).sum()


def launch_linear_cross_entropy(x, weight, targets, ignore_index, config) -> torch.Tensor:
    """Per-token losses on checked inputs (0 where the target is ignore_index)."""
    (t, d), v = x.shape, weight.shape[0]
    key = (t, v, d, x.dtype, x.device)
    if config is None:
        config = _TUNED.get(key)
    if config is None and not x.is_cuda:
        config = INTERPRETER_CONFIG
    block_v = config["BN"] if config is not None else min(c.kwargs["BN"] for c in CONFIGS)
    # partials for the narrowest tile any config may pick; a wider one fills a prefix
    tiles_v = triton.cdiv(v, block_v)
    maxes = torch.empty((tiles_v, t), dtype=torch.float32, device=x.device)
    sums = torch.empty((tiles_v, t), dtype=torch.float32, device=x.device)
    target_logits = torch.empty(t, dtype=torch.float32, device=x.device)
    args = (x, weight, targets, maxes, sums, target_logits, t, v, d)
    if config is None:
        programs = sm_count(x.device)
        lse_partials_autotuned[(programs,)](*args, NUM_PROGRAMS=programs)
        best = lse_partials_autotuned.best_config
        config = _TUNED[key] = dict(best.kwargs, num_stages=best.num_stages, num_warps=best.num_warps)
    else:
        blocks = {name: config[name] for name in ("BM", "BN", "BK")}
        slots = sm_count(x.device) if x.is_cuda else INTERPRETER_PROGRAMS
        programs = min(slots, triton.cdiv(t, blocks["BM"]) * tiles_v)
        lse_partials_kernel[(programs,)](*args, NUM_PROGRAMS=programs, **blocks, FLATTEN=config.get("FLATTEN", False),
                                         num_stages=config.get("num_stages", 3), num_warps=config.get("num_warps", 4))
    losses = torch.empty(t, dtype=torch.float32, device=x.device)
    lse_merge_kernel[(triton.cdiv(t, MERGE_ROWS),)](maxes, sums, target_logits, targets, losses, t,
                                                    triton.cdiv(v, config["BN"]), ignore_index,
                                                    BLOCK_T=MERGE_ROWS, BLOCK_TILES=MERGE_TILES)
    return losses


def linear_cross_entropy_reference(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                   ignore_index: int = -100) -> torch.Tensor:
    """Per-token losses in float64 from the full logits (0 where ignored)."""
    logits = x.double() @ weight.double().T
    return torch.nn.functional.cross_entropy(logits, targets.long(), ignore_index=ignore_index, reduction="none")


def linear_cross_entropy_min_bytes(t: int, v: int, d: int, itemsize: int = 2) -> int:
    """HBM bytes the op must move: x and W read once, the targets read, the loss written."""
    return (t * d + v * d) * itemsize + t * 8 + 4

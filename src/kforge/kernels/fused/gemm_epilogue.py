"""A linear layer with its epilogue fused: y = act(x W^T + b) [* (x U^T)] [+ residual], in Triton.

The math. For x (M, K), a weight W (N, K) as nn.Linear stores it, and one fp32 accumulator
tile acc = x W^T per (BM, BN) block of y, everything that eager PyTorch does to y
afterwards is a function of acc and of data at the same (row, column):

    bias          acc + b[n]                          (cuBLAS fuses this one too)
    activation    gelu (erf), gelu_tanh, silu         on acc + b, in fp32
    gated         act(x W^T) * (x U^T)                two accumulators over one x tile:
                                                      SwiGLU (silu) / GeGLU (gelu) of a
                                                      gate/up pair, U the up weight
    residual      ... + r[m, n]                       a residual stream added last

so all of it runs on the accumulator in registers before the only store. What fusing
saves is eager's round trips through HBM: y written by the GEMM and read back by each
elementwise kernel (GPT-2's gelu_new alone is eight kernels in eager), and, gated, the
two (M, N) projections written, read by silu, and read again by the product.
The product is rounded once, to x's dtype: eager rounds after every kernel.

    gelu(v)      = 0.5 v (1 + erf(v / sqrt 2))
    gelu_tanh(v) = 0.5 v (1 + tanh(u)), u = sqrt(2/pi) (v + 0.044715 v^3)
                 = v * sigmoid(2u)                     (1 + tanh(u) = 2 sigmoid(2u))
    silu(v)      = v * sigmoid(v)

gelu_tanh is computed through the sigmoid identity: one exp and one division, no tanh
(which Triton's interpreter also lacks).

The schedule is the persistent TMA GEMM of `gemm_bf16/triton_matmul.py` (~0.96x cuBLAS
at 4096^3 on the H100): one program per SM walking the output tiles in grouped order,
TMA descriptors built on the device, x and W boxes through a num_stages-deep ring into
wgmma. Boxes reaching past M, N or K load zeros and store nothing, so no masks; the
residual is a TMA box like C's. The bias (a masked vector load) is where each tile's sum
starts, not a term of the epilogue: added there, its 64 fp32 registers a thread (a
128 x 256 tile over 8 warps) lived through the erf GELU, which then spilled 64-112
bytes (ptxas, sm_90). Gated, the x box feeds two wgmmas (W's and U's rows at the same n):
the tile's effective width is 2 * BN.

Tiles: the list below, pruned per mode by the shared memory it needs (`shared_bytes`,
the ring plus C's staging tile, plus the residual's): a residual or a second weight
does not fit beside 128 x 256 x 3 stages in the 227 KB a block may use (`configs_for`).
The CPU tests compile every (config, mode) pair that survives the pruning for sm_90 and
check its shared memory, wgmma, TMA and that nothing spills.

Expected on the H100 (not measured here): the mainloop is triton_matmul's, ~0.95x of
cuBLAS's time for x W^T. The epilogue is ALU work the mainloop does not hide (no warp
specialization): per output element ~10 fp32 instructions and two MUFU ops (exp and a
reciprocal) for silu and gelu_tanh, ~30 instructions for erf GELU; ~0.6-1 ps an element
over 132 SMs, beside 2K / 770 TFLOP/s of mainloop (5.3 ps at K = 2048, 10.6 gated). What
it saves is eager's elementwise traffic at 3 TB/s: 4 bytes an output element for one
activation kernel (1.3 ps: erf GELU alone barely gains, so Megatron's bias_gelu is
`bias_act.py` instead), 14 gated (4.7 ps), ~40 for gelu_new's chain (13 ps).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kforge.device import sm_count

# Importing triton_matmul also installs the scratch allocator that device-built TMA
# descriptors need (triton.set_allocator).
from kforge.kernels.gemm_bf16 import epilogue_reference
from kforge.kernels.gemm_bf16.triton_matmul import _tile_coords

ACTIVATIONS = ("none", "gelu", "gelu_tanh", "silu")
DTYPES = (torch.float16, torch.bfloat16)
SHARED_LIMIT = 220 * 1024  # of the 227 KB: Triton adds barriers and alignment on top of the estimate
INTERPRETER_CONFIG = {"BM": 32, "BN": 32, "BK": 32, "GROUP_M": 2, "FLATTEN": False}
INTERPRETER_PROGRAMS = 4


@triton.jit
def apply_activation(v, ACTIVATION: tl.constexpr):
    """The named activation of an fp32 tile (see the module docstring for the formulas)."""
    if ACTIVATION == "gelu":
        v = 0.5 * v * (1.0 + tl.math.erf(v * 0.7071067811865476))
    elif ACTIVATION == "gelu_tanh":
        # 2u = 2 sqrt(2/pi) (v + 0.044715 v^3); exp(-2u) -> inf for very negative v gives v / inf = -0
        v = v / (1.0 + tl.exp(-1.5957691216057308 * (v + 0.044715 * v * v * v)))
    elif ACTIVATION == "silu":
        v = v / (1.0 + tl.exp(-v))
    return v


@triton.jit
def gemm_epilogue_kernel(a_ptr, b_ptr, up_ptr, c_ptr, bias_ptr, res_ptr, M, N, K,
                         NUM_PROGRAMS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                         GROUP_M: tl.constexpr, FLATTEN: tl.constexpr, ACTIVATION: tl.constexpr,
                         HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GATED: tl.constexpr):
    # Row-major x (M x K), W and U (N x K), C and the residual (M x N).
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    if GATED:
        up_desc = tl.make_tensor_descriptor(up_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    if HAS_RESIDUAL:
        res_desc = tl.make_tensor_descriptor(res_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, NUM_PROGRAMS, flatten=FLATTEN):
        tm, tn = _tile_coords(tile, tiles_m, tiles_n, GROUP_M)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        if HAS_BIAS:  # the sum starts at b: no bias registers live through the epilogue's activation
            offs_n = tn * BN + tl.arange(0, BN)
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, K, BK):
            a = a_desc.load([tm * BM, k])
            acc = tl.dot(a, b_desc.load([tn * BN, k]).T, acc)
            if GATED:
                acc_up = tl.dot(a, up_desc.load([tn * BN, k]).T, acc_up)
        y = apply_activation(acc, ACTIVATION)
        if GATED:
            y = y * acc_up
        if HAS_RESIDUAL:
            y += res_desc.load([tm * BM, tn * BN]).to(tl.float32)
        c_desc.store([tm * BM, tn * BN], y.to(c_desc.dtype))


def shared_bytes(config: triton.Config, *, gated: bool, residual: bool) -> int:
    """Shared memory a config needs, estimated: num_stages x (x box + weight boxes), plus
    C's staging tile for the TMA store and the residual's box (2-byte elements)."""
    bm, bn, bk = (config.kwargs[name] for name in ("BM", "BN", "BK"))
    ring = config.num_stages * (bm + bn * (2 if gated else 1)) * bk * 2
    return ring + bm * bn * 2 * (2 if residual else 1)


def _config(bm, bn, stages, warps, flatten=False):
    return triton.Config({"BM": bm, "BN": bn, "BK": 64, "GROUP_M": 8, "FLATTEN": flatten}, num_stages=stages,
                         num_warps=warps)


# triton_matmul's H100 list (128 x 256 x 64, 8 warps, 3 stages won at 4096^3) and narrower
# tiles for the gated and residual modes, which need room for a second weight box or a
# residual box; `configs_for` keeps those of each mode that fit.
CONFIGS = [
    _config(128, 256, 3, 8), _config(128, 256, 3, 8, flatten=True), _config(128, 128, 4, 8),
    _config(128, 128, 4, 8, flatten=True), _config(128, 128, 3, 8), _config(128, 128, 3, 8, flatten=True),
    _config(128, 128, 5, 4), _config(64, 128, 5, 4), _config(128, 64, 4, 4), _config(64, 64, 6, 4),
]


def configs_for(configs, gated: bool, residual: bool, activation: str = "none") -> list:
    """The configs of `configs` whose tiles fit a mode's shared memory (128 x 256 gated would
    also need 256 accumulator registers a thread: its ring alone is over the limit). Erf GELU
    also drops the flattened 128 x 256 tile: the next tile's bias and first loads overlap
    erf's temporaries there, and ptxas spilled 112 bytes (sm_90)."""
    return [c for c in configs if shared_bytes(c, gated=gated, residual=residual) <= SHARED_LIMIT
            and not (activation == "gelu" and c.kwargs["FLATTEN"] and c.kwargs["BN"] == 256)]


def _fitting(configs, named_args, **kwargs):
    def arg(name):
        return kwargs.get(name, named_args.get(name))

    return configs_for(configs, bool(arg("GATED")), bool(arg("HAS_RESIDUAL")), arg("ACTIVATION"))


gemm_epilogue_autotuned = triton.autotune(
    CONFIGS, key=["M", "N", "K", "ACTIVATION", "HAS_BIAS", "HAS_RESIDUAL", "GATED"],
    prune_configs_by={"early_config_prune": _fitting},
)(gemm_epilogue_kernel)
# Each (shape, mode)'s pick once tuned, launched directly afterwards: the autotuner's
# per-call dispatch is host time an eager caller waits on (triton_matmul's docstring).
_TUNED: dict[tuple, dict] = {}


def check_gemm_epilogue_inputs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                               activation: str, residual: torch.Tensor | None,
                               up_weight: torch.Tensor | None) -> None:
    """Raise ValueError on anything the kernel cannot take."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}; got {activation!r}")
    if x.dim() == 0 or weight.dim() != 2:
        raise ValueError(f"x must be (..., K) and weight (N, K); got {tuple(x.shape)} and {tuple(weight.shape)}")
    n, k = weight.shape
    if x.shape[-1] != k or k == 0 or n == 0:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)}: K must match and N, K be > 0")
    if x.dtype not in DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share one dtype of float16, bfloat16; got {x.dtype} and {weight.dtype}")
    if up_weight is not None and (up_weight.shape != weight.shape or up_weight.dtype != x.dtype):
        raise ValueError(f"up_weight must be {x.dtype} {tuple(weight.shape)} like weight; got {up_weight.dtype} "
                         f"{tuple(up_weight.shape)}")
    if up_weight is not None and bias is not None:
        raise ValueError("a gated GEMM takes no bias (no gated model here has one)")
    if bias is not None and (bias.shape != (n,) or not bias.is_floating_point()):
        raise ValueError(f"bias must be a floating-point vector of N = {n}; got {bias.dtype} {tuple(bias.shape)}")
    if residual is not None and (residual.shape != (*x.shape[:-1], n) or residual.dtype != x.dtype):
        raise ValueError(f"residual must be {x.dtype} {(*x.shape[:-1], n)}; got {residual.dtype} "
                         f"{tuple(residual.shape)}")
    tensors = [t for t in (x, weight, bias, residual, up_weight) if t is not None]
    if any(t.device != x.device for t in tensors):
        raise ValueError(f"all tensors must be on {x.device}")
    if k % 8 or n % 8:
        raise ValueError(f"K = {k} and N = {n} must be multiples of 8: TMA reads and writes rows of 16-byte multiples")
    for name, t in (("x", x), ("weight", weight), ("residual", residual), ("up_weight", up_weight)):
        if t is not None and (not t.is_contiguous() or t.data_ptr() % 16):
            raise ValueError(f"{name} must be contiguous and 16-byte aligned (TMA); call .contiguous() first")
    if bias is not None and not bias.is_contiguous():
        raise ValueError("bias must be contiguous")
    if x.numel() // k * n >= 2**31 or weight.numel() >= 2**31:
        raise ValueError("the output or a weight has 2^31 elements or more: the kernel's coordinates are 32-bit")


def gemm_epilogue(x: torch.Tensor, weight: torch.Tensor, *, bias: torch.Tensor | None = None,
                  activation: str = "none", residual: torch.Tensor | None = None,
                  up_weight: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """act(x @ weight.T + bias) [* (x @ up_weight.T)] [+ residual], for x (..., K) and weights (N, K).

    Returns (..., N) in x's dtype; fp32 accumulation and epilogue, one rounding. fp16 or
    bf16, K and N multiples of 8. `config` (BM, BN, BK, GROUP_M, FLATTEN, num_stages,
    num_warps) skips the autotuner; on the CPU (the Triton interpreter) one small tile runs.
    """
    check_gemm_epilogue_inputs(x, weight, bias, activation, residual, up_weight)
    return launch_gemm_epilogue(x, weight, bias, activation, residual, up_weight, config)


def launch_gemm_epilogue(x, weight, bias, activation, residual, up_weight, config) -> torch.Tensor:
    """gemm_epilogue on checked inputs."""
    n, k = weight.shape
    a = x.reshape(-1, k)
    m = a.shape[0]
    c = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return c.view(*x.shape[:-1], n)
    mode = dict(ACTIVATION=activation, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
                GATED=up_weight is not None)
    operands = (a, weight, up_weight if up_weight is not None else weight, c, bias if bias is not None else c,
                residual if residual is not None else c, m, n, k)
    key = (m, n, k, activation, bias is not None, residual is not None, up_weight is not None, x.dtype, x.device)
    if config is None:
        config = _TUNED.get(key)
    if config is None and not x.is_cuda:
        config = INTERPRETER_CONFIG
    if config is None:
        programs = sm_count(x.device)
        gemm_epilogue_autotuned[(programs,)](*operands, NUM_PROGRAMS=programs, **mode)
        best = gemm_epilogue_autotuned.best_config
        _TUNED[key] = dict(best.kwargs, num_stages=best.num_stages, num_warps=best.num_warps)
    else:
        blocks = {name: config[name] for name in ("BM", "BN", "BK", "GROUP_M")}
        blocks["FLATTEN"] = config.get("FLATTEN", False)
        slots = sm_count(x.device) if x.is_cuda else INTERPRETER_PROGRAMS
        programs = min(slots, triton.cdiv(m, blocks["BM"]) * triton.cdiv(n, blocks["BN"]))
        gemm_epilogue_kernel[(programs,)](*operands, NUM_PROGRAMS=programs, **blocks, **mode,
                                          num_stages=config.get("num_stages", 3), num_warps=config.get("num_warps", 4))
    return c.view(*x.shape[:-1], n)


def gemm_epilogue_reference(x: torch.Tensor, weight: torch.Tensor, *, bias: torch.Tensor | None = None,
                            activation: str = "none", residual: torch.Tensor | None = None,
                            up_weight: torch.Tensor | None = None) -> torch.Tensor:
    """The same math in PyTorch at float64 (or wider of x's dtype and float64), unrounded."""
    work = torch.float64
    v = x.to(work) @ weight.to(work).T
    if up_weight is None:
        return epilogue_reference(v, bias, activation, residual)
    v = epilogue_reference(v, bias, activation) * (x.to(work) @ up_weight.to(work).T)
    return v + residual.to(work) if residual is not None else v


def gemm_epilogue_min_bytes(m: int, n: int, k: int, *, bias: bool = False, residual: bool = False,
                            gated: bool = False, itemsize: int = 2) -> int:
    """HBM bytes the fused op must move: x and the weight(s) read once, the bias and the
    residual read once, y written once."""
    weights = (2 if gated else 1) * n * k
    return (m * k + weights + (n if bias else 0) + (m * n if residual else 0) + m * n) * itemsize

"""Batched GEMM in Triton: C[b] = A[b] @ B[b] for b < BATCH, bf16/fp16 with fp32 accumulation,
in one persistent launch.

Why not kforge's bf16 GEMM once per matrix: a batch of 64 products of 1024^3 is 64 launches
of a 2.1 GFLOP kernel (~3 us of tensor-core work each), so the host's launch path (tens of
microseconds a launch) and the ramp-up and tail of each little grid would dominate. Here
one grid walks every output tile of every matrix: tile t belongs to matrix t // T (T
tiles a matrix), and within a matrix tiles go in grouped order (GROUP_M row tiles per
column sweep, so neighbouring programs share panels of A and B in L2).

Loads and stores go through 3-D TMA descriptors over (BATCH, rows, columns) with boxes
[1, rows, columns]: the copy engine clips every box at its own matrix's edge, so a tile
that overhangs M, N or K reads zeros and stores nothing, and never touches the next
matrix. The descriptors are built on the device (`tl.make_tensor_descriptor`, scratch from
triton.set_allocator, as kforge's Triton GEMM does), so a launch costs no host encoding.
`tl.dot` on the boxes becomes wgmma on sm_90, `num_stages` the depth of the TMA ring;
`FLATTEN` lets Triton pipeline across tile boundaries (the next tile's first loads fly
during this tile's store). One program per SM.

TMA needs 16-byte row strides: K and N multiples of 8 (2-byte types). Operands may be any
view whose last dimension is contiguous and whose other strides are 16-byte multiples.

Work: 2 BATCH M N K FLOPs over 2 BATCH (M K + K N + M N) bytes; at 64 x 1024^3: 137
GFLOP over 403 MB, compute-bound (~0.18 ms at ~790 TFLOP/s). Expected on the H100 (not
measured here): as kforge's persistent Triton GEMM, 0.95-1.0x cuBLAS at large sizes
(its 4096^3 read 0.96-0.97x); 1024^2 matrices give 32 tiles of 128 x 256 each, 2048 in
all, 15.5 waves over 132 SMs, so the tail costs ~3%.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kforge.device import sm_count

DTYPES = (torch.float16, torch.bfloat16)


def _descriptor_scratch(size: int, alignment: int, stream):
    """Global memory for the device-built TMA descriptors of one launch (Triton asks per launch)."""
    return torch.empty(size, dtype=torch.int8, device="cuda" if torch.cuda.is_available() else "cpu")


triton.set_allocator(_descriptor_scratch)


@triton.jit
def bmm_persistent(a_ptr, b_ptr, c_ptr, batch, M, N, K, sa_b, sa_m, sb_b, sb_k, sc_b, sc_m,
                   NUM_PROGRAMS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   GROUP_M: tl.constexpr, FLATTEN: tl.constexpr):
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[batch, M, K], strides=[sa_b, sa_m, 1], block_shape=[1, BM, BK])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[batch, K, N], strides=[sb_b, sb_k, 1], block_shape=[1, BK, BN])
    c_desc = tl.make_tensor_descriptor(c_ptr, shape=[batch, M, N], strides=[sc_b, sc_m, 1], block_shape=[1, BM, BN])
    tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    per_matrix = tiles_m * tiles_n
    per_group = GROUP_M * tiles_n
    for tile in tl.range(tl.program_id(0), batch * per_matrix, NUM_PROGRAMS, flatten=FLATTEN):
        matrix, t = tile // per_matrix, tile % per_matrix
        first = (t // per_group) * GROUP_M
        rows = tl.minimum(tiles_m - first, GROUP_M)
        tm, tn = first + (t % per_group) % rows, (t % per_group) // rows
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, K, BK):
            a = a_desc.load([matrix, tm * BM, k]).reshape(BM, BK)
            b = b_desc.load([matrix, k, tn * BN]).reshape(BK, BN)
            acc = tl.dot(a, b, acc)
        c_desc.store([matrix, tm * BM, tn * BN], acc.to(c_desc.dtype).reshape(1, BM, BN))


# Shared memory per config: stages x (BM + BN) x BK x 2 bytes plus C's tile for the TMA
# store, within the 227 KB a block may use (tests/kernels/test_bmm.py compiles each for sm_90).
CONFIGS = [
    triton.Config({"BM": bm, "BN": bn, "BK": 64, "GROUP_M": 8, "FLATTEN": flat}, num_stages=s, num_warps=w)
    for bm, bn, s, w, flat in [(128, 256, 3, 8, True), (128, 256, 3, 8, False), (128, 128, 4, 8, True),
                               (128, 128, 4, 8, False), (128, 128, 5, 4, False), (64, 128, 5, 4, False)]
]
bmm_autotuned = triton.autotune(CONFIGS, key=["batch", "M", "N", "K"])(bmm_persistent)
INTERPRETER_CONFIG = {"BM": 32, "BN": 32, "BK": 32, "GROUP_M": 2, "FLATTEN": False}
INTERPRETER_PROGRAMS = 4
# Each shape's pick, once tuned: later calls launch it directly, without the autotuner's dispatch.
_TUNED: dict[tuple, dict] = {}


def _tma_ready(t: torch.Tensor) -> bool:
    return t.stride(2) == 1 and all(s * t.element_size() % 16 == 0 for s in t.stride()[:2]) and t.data_ptr() % 16 == 0


def check_bmm_inputs(a: torch.Tensor, b: torch.Tensor) -> None:
    """ValueError on anything the kernel cannot take."""
    if a.dim() != 3 or b.dim() != 3:
        raise ValueError(f"bmm takes a (BATCH, M, K) and b (BATCH, K, N), got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype not in DTYPES or b.dtype != a.dtype:
        raise ValueError(f"a and b must share one dtype of float16, bfloat16; got {a.dtype} and {b.dtype}")
    if a.device != b.device:
        raise ValueError(f"a is on {a.device}, b on {b.device}")
    if a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise ValueError(f"a {tuple(a.shape)} and b {tuple(b.shape)}: batch or inner dimensions differ")
    if a.shape[2] % 8 or b.shape[2] % 8:
        raise ValueError(f"K ({a.shape[2]}) and N ({b.shape[2]}) must be multiples of 8: TMA reads 16-byte rows")


def bmm(a: torch.Tensor, b: torch.Tensor, *, config: dict | None = None) -> torch.Tensor:
    """a (BATCH, M, K) @ b (BATCH, K, N) -> (BATCH, M, N) in a's dtype, fp32 accumulation.
    Views with a contiguous last dimension are read in place (others are copied first).
    `config` (BM, BN, BK, GROUP_M, FLATTEN, num_stages, num_warps) skips the autotuner."""
    check_bmm_inputs(a, b)
    a, b = (t if _tma_ready(t) else t.contiguous() for t in (a, b))
    batch, m, k = a.shape
    n = b.shape[2]
    c = torch.empty((batch, m, n), dtype=a.dtype, device=a.device)
    if c.numel() == 0:
        return c
    if k == 0:
        return c.zero_()
    strides = (a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1))
    shape = (batch, m, n, k, a.dtype)
    if config is None and not a.is_cuda:  # the Triton interpreter: one small tile, no autotuning
        config = INTERPRETER_CONFIG
    if config is None and shape in _TUNED:
        config = _TUNED[shape]
    programs = _programs(a.device)
    if config is None:
        bmm_autotuned[(programs,)](a, b, c, batch, m, n, k, *strides, NUM_PROGRAMS=programs)
        best = bmm_autotuned.best_config
        _TUNED[shape] = dict(best.kwargs, num_stages=best.num_stages, num_warps=best.num_warps)
    else:
        blocks = {key: config[key] for key in ("BM", "BN", "BK", "GROUP_M")}
        blocks["FLATTEN"] = config.get("FLATTEN", False)
        tiles = batch * triton.cdiv(m, blocks["BM"]) * triton.cdiv(n, blocks["BN"])
        grid = min(programs, tiles)
        bmm_persistent[(grid,)](a, b, c, batch, m, n, k, *strides, NUM_PROGRAMS=grid, **blocks,
                                num_stages=config.get("num_stages", 3), num_warps=config.get("num_warps", 4))
    return c


def _programs(device: torch.device) -> int:
    """One program per SM (INTERPRETER_PROGRAMS under the interpreter)."""
    return sm_count(device) if device.type == "cuda" else INTERPRETER_PROGRAMS


def bmm_flops(batch: int, m: int, n: int, k: int) -> int:
    return 2 * batch * m * n * k

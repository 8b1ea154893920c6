"""Row softmax in CuTe DSL: y = exp(x - max x) / sum exp(x - max x), bf16 in and out, fp32 inside.

The algorithm of the other levels: one CTA a row, two passes (a 128k-entry row is too long
for registers). Pass 1 keeps, in each of a thread's 8 slots, a running max m and sum s of
exp(x - m), one exp an element (e = exp(-|x - m|): s += e if x <= m, else s = s * e + 1,
m = x); the row's max and then its sum are reduced once over the CTA; pass 2 re-reads the
row (from L2, mostly) and writes exp(x - M) / S. Everything is in base 2.

What CuTe makes the kernel writer state:
- the row as a tensor of 16-byte vectors: `zipped_divide` of the row by 8 gives (8, vectors),
  and thread t takes vectors t, t + THREADS, ... (a CTA's sweep is 8 x THREADS contiguous
  elements, coalesced). The row's length is a multiple of 8, so there is no partial vector
  and no mask: the loop's bound is the bounds check;
- the copy: a 128-bit `CopyUniversalOp` atom, global to registers and back, which the
  compiler must prove aligned (the tensors are declared 16-byte aligned, the row a multiple
  of 8 entries), so each is one LDG.128 or STG.128;
- the math on register fragments as `TensorSSA` values, elementwise (`cute.where`,
  `cute.math.exp2`), and each thread's 8 slots folded by `reduce`;
- the reductions across threads, one call in the tile DSLs: a butterfly of shuffles in each
  warp (`warp_reduction`), then the warps' results through shared memory;
- the launch bounds: 4 CTAs of 512 threads an SM, so ptxas fits the 16 slots, the vector and
  its addresses in 32 registers (38 without them: 3 CTAs, a quarter fewer loads in flight).

CuTe DSL compiles the host function (grid, launch) and the kernel together for one shape;
`compiled` does it without a GPU (fake tensors), `softmax` on a GPU from the tensors.
"""

from __future__ import annotations

import operator
import tempfile

import cuda.bindings.driver as cuda
import cutlass
import torch
from cutlass import Float32, cute
from cutlass.cute.runtime import from_dlpack, make_fake_compact_tensor, make_fake_stream
from cutlass.memory import SmemAllocator

VECTOR = 8  # bf16 a thread loads at once: 16 bytes
THREADS = 512  # as the CUDA level: a sweep of the CTA is 4096 entries, 31.3 of them a 128256-entry row
CTAS_PER_SM = 4  # 2048 threads, all an SM holds: the most 16-byte loads in flight (<= 32 registers a thread)
WARPS = THREADS // 32  # a power of 2 up to 32: `cta_reduce`'s second butterfly runs over them
LOG2E = 1.4426950408889634
LADDER_ROWS = 2048  # the problem's TOKENS: `compiled` builds for the ladder's whole shape
MINUS_INFINITY = -float("inf")


@cute.jit
def cta_reduce(value: Float32, op, per_warp: cute.Tensor) -> Float32:
    """`op` over every thread's `value`, the result in every thread: a butterfly of shuffles in each
    warp, then the WARPS results through shared memory and one more butterfly over them in every
    warp (lane l reads warp l % WARPS's result, so each group of WARPS lanes holds them all)."""
    # warp_idx is a full-warp shuffle (it makes the index warp-uniform): every lane must reach it, so
    # it is read here, not under `lane == 0`, where the other 31 lanes never would (the kernel hung)
    warp = cute.arch.warp_idx()
    value = cute.arch.warp_reduction(value, op)
    lane = cute.arch.lane_idx()
    if lane == 0:
        per_warp[warp] = value
    cute.arch.sync_threads()
    return cute.arch.warp_reduction(per_warp[lane % WARPS], op, threads_in_group=WARPS)


@cute.kernel
def softmax_kernel(x: cute.Tensor, y: cute.Tensor):
    thread, _, _ = cute.arch.thread_idx()
    row = cutlass.Int64(cute.arch.block_idx()[0])  # 64-bit offsets: rows x cols may pass 2^31
    x_vectors = cute.zipped_divide(x[row, None], (VECTOR,))  # (8, vectors)
    y_vectors = cute.zipped_divide(y[row, None], (VECTOR,))
    vectors = cute.size(x_vectors, mode=[1])
    wide = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.BFloat16, num_bits_per_copy=128)
    loaded = cute.make_rmem_tensor((VECTOR,), cutlass.BFloat16)
    slot_max = cute.make_rmem_tensor((VECTOR,), Float32)
    slot_sum = cute.make_rmem_tensor((VECTOR,), Float32)
    slot_max.fill(MINUS_INFINITY)
    slot_sum.fill(0.0)

    # Pass 1: per-slot running max and sum of exp2(x - max), one exp2 an element.
    for vector in cutlass.range(thread, vectors, THREADS):
        cute.copy(wide, x_vectors[(None, vector)], loaded)
        x2 = loaded.load().to(Float32) * LOG2E  # x in base 2
        m, s = slot_max.load(), slot_sum.load()
        rises = x2 > m
        # exp2(-|x - m|), and 0 for a -inf x, even while the slot's max is -inf too
        scale = cute.where(x2 == MINUS_INFINITY, 0.0, cute.math.exp2(-cute.math.abs(x2 - m), fastmath=True))
        slot_sum.store(s * cute.where(rises, scale, 1.0) + cute.where(rises, 1.0, scale))  # in place: one FFMA
        slot_max.store(cute.where(rises, x2, m))

    # The row's statistics: its max, then each slot's sum rescaled to it and summed. An all -inf
    # row has max -inf and sum NaN (exp2(-inf - -inf)), so its probabilities are NaN, as torch's.
    shared = SmemAllocator()
    row_max = cta_reduce(slot_max.load().reduce(cute.ReductionOp.MAX, MINUS_INFINITY, 0), cute.arch.fmax,
                         shared.allocate_tensor(Float32, cute.make_layout(WARPS)))
    rescaled = slot_sum.load() * cute.math.exp2(slot_max.load() - row_max, fastmath=True)
    row_sum = cta_reduce(rescaled.reduce(cute.ReductionOp.ADD, 0.0, 0), operator.add,
                         shared.allocate_tensor(Float32, cute.make_layout(WARPS)))
    inverse = 1.0 / row_sum

    # Pass 2: normalize and write, rounded once to bf16.
    probabilities = cute.make_rmem_tensor((VECTOR,), cutlass.BFloat16)
    for vector in cutlass.range(thread, vectors, THREADS):
        cute.copy(wide, x_vectors[(None, vector)], loaded)
        p = cute.math.exp2(loaded.load().to(Float32) * LOG2E - row_max, fastmath=True) * inverse
        probabilities.store(p.to(cutlass.BFloat16))
        cute.copy(wide, probabilities, y_vectors[(None, vector)])


@cute.jit
def softmax_rows(x: cute.Tensor, y: cute.Tensor, stream: cuda.CUstream):
    """The host function: one CTA a row, CTAS_PER_SM of them an SM at once."""
    # min_blocks_per_mp: the launch bounds that keep ptxas to 32 registers a thread. With it, CuTe
    # asks the GPU for its shared memory to pick an L1 carveout, unless one is given: all L1 (the
    # kernel's shared memory is two 64-byte arrays), so that it compiles without a GPU too.
    softmax_kernel(x, y).launch(grid=[x.shape[0], 1, 1], block=[THREADS, 1, 1], min_blocks_per_mp=CTAS_PER_SM,
                                preferred_smem_carveout=int(cuda.CUshared_carveout.CU_SHAREDMEM_CARVEOUT_MAX_L1),
                                stream=stream)


def compiled(cols: int, rows: int = LADDER_ROWS):
    """The kernel for one shape on the H100, from fake tensors (row-major bf16, no memory, 16-byte
    aligned like a torch allocation); `--keep-cubin` hands its cubin back in `.artifacts.CUBIN`
    (written, on the way, to a scratch folder)."""
    fake = make_fake_compact_tensor(cutlass.BFloat16, (rows, cols), stride_order=(1, 0), assumed_align=16)
    with tempfile.TemporaryDirectory(prefix="kforge-cute-") as scratch:
        return cute.compile(softmax_rows, fake, fake, make_fake_stream(),
                            options=f"--gpu-arch=sm_90a --keep-cubin --dump-dir={scratch}")


def operands(x: torch.Tensor, y: torch.Tensor) -> list[cute.Tensor]:
    """The torch tensors as CuTe tensors (static layouts, 16-byte aligned as `softmax` checks)."""
    return [from_dlpack(t, assumed_align=16) for t in (x, y)]


def compiled_for(x: torch.Tensor, y: torch.Tensor, stream: cuda.CUstream, arch: str | None = None):
    """The kernel for these tensors, as `softmax` compiles it (their layouts only: no memory is read),
    for `arch` (default: x's GPU's, e.g. sm_90a)."""
    if arch is None:
        major, minor = torch.cuda.get_device_capability(x.device)
        arch = f"sm_{major}{minor}" + ("a" if major >= 9 else "")  # the arch-specific target exists from sm_90
    return cute.compile(softmax_rows, *operands(x, y), stream, options=f"--gpu-arch={arch}")


_ON_DEVICE: dict[tuple[tuple[int, ...], int | None], object] = {}


def softmax(x: torch.Tensor) -> torch.Tensor:
    """softmax(x, dim=-1) for a contiguous 2-D bf16 x whose rows are 16-byte aligned (columns % 8 == 0).
    Compiled on first use of each shape."""
    if x.dtype != torch.bfloat16 or x.dim() != 2 or not x.is_contiguous() or x.shape[1] % VECTOR \
            or x.data_ptr() % 16:
        raise ValueError(f"cute_softmax: needs a contiguous, 16-byte aligned 2-D bf16 tensor with a multiple of "
                         f"{VECTOR} columns, got {x.dtype} {tuple(x.shape)}")
    if not x.is_cuda:
        raise ValueError(f"cute_softmax: runs on a CUDA GPU, got a tensor on {x.device}")
    y = torch.empty_like(x)
    if x.numel():
        stream = cuda.CUstream(torch.cuda.current_stream(x.device).cuda_stream)
        key = (tuple(x.shape), x.device.index)  # a kernel is loaded on one GPU
        if key not in _ON_DEVICE:
            _ON_DEVICE[key] = compiled_for(x, y, stream)
        _ON_DEVICE[key](*operands(x, y), stream)
    return y

"""MLA decode's Triton tilings and splits at FlashMLA's memory-bound shapes, kernel alone: the
default plan against a grid around it (`backend="triton"`: on a Hopper GPU mla_decode's own
default is the CUDA kernel, scripts/mla_backend_ab.py).

    PYTHONPATH=src python scripts/mla_decode_sweep.py      (PARTS=mla-sweep in gpu_check.sh)

The grid: BLOCK_N x warps x stages x splits, the splits named by the programs an SM they give
(as many splits as bring the grid to that many), each plan checked against the default's output
first, then timed after an L2 flush (median of 20). bf16, page 64, random pages, every request
at s_k tokens. Prints us, GB/s of the cache read once and TFLOP/s. On the H200 this sweep
found the plan's two changes (benchmarks/results/nvidia-h200/mla-decode-sweep.txt): 4 warps
at 16 and 32 rows, and split counts that fill whole waves of resident programs. "default" is
mla_decode's default call: the device schedule (every request is full here, so it picks the
host plan's splits), on the host plan's tiles.
"""

import kforge  # noqa: F401  (before triton)

import itertools

import torch

from device_timing import checked_variants, median_ms
from kforge.kernels.mla.decode import mla_decode, plan_mla_decode

PAGE, D, D_V = 64, 576, 512
SHAPES = [(128, 8192, 16, 1), (128, 4096, 16, 1), (32, 8192, 16, 1), (128, 8192, 16, 2), (128, 8192, 128, 1)]
# (batch, s_k, h_q, s_q)


def split_for(batch: int, rows: int, s_k: int, block_m: int, block_n: int, per_sm: int, sms: int) -> int:
    """The split size that brings the grid to ~per_sm programs an SM (plan_mla_decode's rule)."""
    programs = batch * -(-rows // block_m)
    splits = min(-(-per_sm * sms // programs), -(-s_k // 256))
    split = -(-s_k // splits)
    return -(-split // block_n) * block_n


def variants(batch: int, s_k: int, rows: int, sms: int):
    """(name, config): the default, then plans around it, the grid's size named in programs an SM."""
    yield "default", None
    block_m = min(64, max(16, 1 << (rows - 1).bit_length()))
    if block_m >= 64:  # 144 KB of shared memory, one program an SM; 64 x 64 spills (the module docstring)
        grid = itertools.product((32,), (8,), (2, 3), (1, 2, 3, 4))
    else:
        grid = itertools.product((16, 32, 64), (4, 8), (2, 3), (4, 6, 8, 12))
    for block_n, warps, stages, per_sm in grid:
        split = split_for(batch, rows, s_k, block_m, block_n, per_sm, sms)
        yield (f"M {block_m} N {block_n}, {warps} warps, {stages} stages, {per_sm}/SM ({-(-s_k // split)} splits)",
               {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": warps, "num_stages": stages,
                "split_size": split})


def main():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for batch, s_k, h_q, s_q in SHAPES:
        pages_each = s_k // PAGE
        cache = torch.randn(batch * pages_each, PAGE, 1, D, device="cuda", dtype=torch.bfloat16)
        table = torch.randperm(batch * pages_each, device="cuda", dtype=torch.int32).view(batch, pages_each)
        lens = torch.full((batch,), s_k, device="cuda", dtype=torch.int32)
        q = torch.randn(batch, s_q, h_q, D, device="cuda", dtype=torch.bfloat16)
        default = plan_mla_decode(batch, h_q * s_q, s_k, sms)
        nbytes = cache.numel() * cache.element_size()
        flops = 2 * batch * s_q * h_q * s_k * (D + D_V)
        print(f"b {batch}, s_k {s_k}, h_q {h_q}, s_q {s_q}: cache {nbytes / 1e9:.2f} GB; default: the host plan's "
              f"tiles M {default.block_m} N {default.block_n}, {default.num_warps} warps, {default.num_stages} stages, "
              f"and its {default.num_splits} splits, as the device schedule picks them for full requests")
        want, _ = mla_decode(q, cache, table, lens, validate=False, backend="triton")
        fns = checked_variants(variants(batch, s_k, h_q * s_q, sms), lambda c: mla_decode(
            q, cache, table, lens, validate=False, config=c, backend="triton")[0], want)
        times = median_ms(fns, 20)
        for name, ms in sorted(times.items(), key=lambda item: item[1]):
            print(f"  {name:<60} {ms * 1e3:8.1f} us {nbytes / ms / 1e6:7.0f} GB/s {flops / ms / 1e9:6.1f} TFLOP/s")
        del cache


if __name__ == "__main__":
    main()

"""MLA decode's tilings and splits at FlashMLA's benchmark shapes, kernel alone: which plan
brings the memory-bound shapes (16 heads, one query token) toward the copy rate?

    PYTHONPATH=src python scripts/mla_decode_sweep.py

Why: on the H200 `kforge bench mla` read 39-43% of copy at 16 heads and 146-163 TFLOP/s from 64
query rows on (docs/worklogs/deepseek.md), against targets of 80% and 500 TFLOP/s. At 16 rows
the plan's tile is 16 x 32 tokens on 8 warps, three splits a request at batch 128 (384
programs, ~3 an SM), each walking its split one tile after another: few bytes in flight an SM.
This times plans with more splits, fewer warps (more programs an SM), wider tiles and more
stages against the default, after an L2 flush (median of 20), each checked against the
default's output first. bf16, page 64, random pages, every request at s_k tokens. Prints us,
GB/s of the cache read once and TFLOP/s. Not yet run on a GPU (`PARTS=mla-sweep` writes
mla-decode-sweep.txt).
"""

import kforge  # noqa: F401  (before triton)

import itertools

import torch

from device_timing import checked_variants, median_ms
from kforge.kernels.mla.decode import mla_decode, plan_mla_decode

BATCH, PAGE, D, D_V = 128, 64, 576, 512
SHAPES = [(8192, 16, 1), (4096, 16, 1), (8192, 16, 2), (8192, 128, 1)]  # (s_k, h_q, s_q)


def variants(s_k: int, rows: int):
    """(name, config): the default, then plans around it."""
    yield "default", None
    block_m = min(64, max(16, 1 << (rows - 1).bit_length()))
    for block_n, warps, stages, splits in itertools.product((32, 64), (4, 8), (2, 3), (3, 6, 12)):
        if block_m >= 64 and block_n == 64:
            continue  # 255 registers and 216 KB at 64 x 64 (the module docstring): spills
        split = -(-s_k // splits)
        split = -(-split // block_n) * block_n
        yield (f"M {block_m} N {block_n}, {warps} warps, {stages} stages, {splits} splits",
               {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": warps, "num_stages": stages,
                "split_size": split})


def main():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for s_k, h_q, s_q in SHAPES:
        pages_each = s_k // PAGE
        cache = torch.randn(BATCH * pages_each, PAGE, 1, D, device="cuda", dtype=torch.bfloat16)
        table = torch.randperm(BATCH * pages_each, device="cuda", dtype=torch.int32).view(BATCH, pages_each)
        lens = torch.full((BATCH,), s_k, device="cuda", dtype=torch.int32)
        q = torch.randn(BATCH, s_q, h_q, D, device="cuda", dtype=torch.bfloat16)
        default = plan_mla_decode(BATCH, h_q * s_q, s_k, sms)
        nbytes = cache.numel() * cache.element_size()
        flops = 2 * BATCH * s_q * h_q * s_k * (D + D_V)
        print(f"b {BATCH}, s_k {s_k}, h_q {h_q}, s_q {s_q}: cache {nbytes / 1e9:.2f} GB; default plan M "
              f"{default.block_m} N {default.block_n}, {default.num_warps} warps, {default.num_stages} stages, "
              f"{default.num_splits} splits")
        want, _ = mla_decode(q, cache, table, lens, validate=False)
        fns = checked_variants(variants(s_k, h_q * s_q), lambda c: mla_decode(
            q, cache, table, lens, validate=False, config=c)[0], want)
        times = median_ms(fns, 20)
        for name, ms in sorted(times.items(), key=lambda item: item[1]):
            print(f"  {name:<46} {ms * 1e3:8.1f} us {nbytes / ms / 1e6:7.0f} GB/s {flops / ms / 1e9:6.1f} TFLOP/s")
        del cache


if __name__ == "__main__":
    main()

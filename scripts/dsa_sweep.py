"""DeepSeek Sparse Attention against dense MLA decode, by context length; and the FP8 latent cache
against the bf16 one.

    PYTHONPATH=src:scripts python scripts/dsa_sweep.py [dsa] [fp8]      (default: both)

dsa: for each context length s_k (every request of the batch that long), the dense decode
(`mla_decode` over all s_k tokens) against DSA's three steps, each timed alone and together:
the lightning indexer (`index_scores`, 64 FP8 index heads of 128, one scale a token), the top
2048 (`select_topk`), and sparse MLA over them (`sparse_mla_decode`). The crossover is the
shortest context where the three together beat the dense decode. Batch 32, one query token,
h_q 16 (DeepSeek-V3.2 over 8 GPUs) and 128 (one GPU).

fp8: `mla_decode_fp8` over the FP8 cache against `mla_decode` over the bf16 one it came from,
at FlashMLA's memory-bound shapes (batch 128, s_q 1, h_q 16 and 32), with the bytes each reads.

Each output is checked first (sparse MLA against its float64 reference on two requests; the FP8
decode against float64 of the cache it reads), then timed as the other sweeps time kernels: after
a reading L2 flush, interleaved, medians of CUDA event times (device_timing.median_ms).
"""

import kforge  # noqa: F401, I001  (before triton)
import math
import sys

import torch

from device_timing import median_ms
from kforge.kernels.mla.decode import (Fp8LatentCache, mla_decode, mla_decode_fp8, mla_decode_min_bytes,
                                       mla_decode_reference)
from kforge.kernels.mla.sparse import index_scores, select_topk, sparse_mla_decode, sparse_mla_decode_reference

ROUNDS = 20
PAGE, D, DV = 64, 576, 512
INDEX_HEADS, INDEX_DIM, TOPK = 64, 128, 2048
CONTEXTS = (4096, 8192, 16384, 32768, 65536, 131072)


def paged(batch: int, tokens: int, width: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pool (batch x pages, PAGE, width), block table (batch, pages) int32): each request's pages
    shuffled through the pool."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages = math.ceil(tokens / PAGE)
    table = torch.randperm(batch * pages, device="cuda", generator=g).int().view(batch, pages)  # first: one seed,
    pool = torch.randn(batch * pages, PAGE, width, device="cuda", generator=g).to(dtype)  # one table, any width
    return pool, table


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def dsa_at(s_k: int, h_q: int, batch: int) -> tuple[dict[str, float], float]:
    """({step: median ms}, sparse MLA's relative error on two requests) at one context length."""
    cache, table = paged(batch, s_k, D, torch.bfloat16, seed=s_k)
    keys, _ = paged(batch, s_k, INDEX_DIM, torch.bfloat16, seed=s_k)  # the same table: same seed
    keys = keys.to(torch.float8_e4m3fn)
    key_scale = torch.rand(keys.shape[:2], device="cuda") + 0.5
    seqlens = torch.full((batch,), s_k, dtype=torch.int32, device="cuda")
    q = (2 * torch.randn(batch, 1, h_q, D, device="cuda")).bfloat16()
    q_idx = torch.randn(batch, 1, INDEX_HEADS, INDEX_DIM, device="cuda").to(torch.float8_e4m3fn)
    weights = torch.randn(batch, 1, INDEX_HEADS, device="cuda") / INDEX_HEADS
    cache = cache.unsqueeze(2)

    def indexer() -> torch.Tensor:
        return index_scores(q_idx, weights, keys, key_scale, table, seqlens, validate=False)

    scores = indexer()
    indices = select_topk(scores, TOPK)
    out, _ = sparse_mla_decode(q, cache, table, seqlens, indices, validate=False)
    # the references convert only the rows they gather to float64
    ref, _ = sparse_mla_decode_reference(q[:2].double(), cache, table[:2], seqlens[:2], indices[:2])
    error = rel_err(out[:2], ref)
    assert error < 2e-2, f"sparse MLA at s_k {s_k}: relative error {error:.1e}"
    timed = median_ms({
        "dense": lambda: mla_decode(q, cache, table, seqlens, validate=False),
        "indexer": indexer,
        "top-k": lambda: select_topk(scores, TOPK),
        "sparse": lambda: sparse_mla_decode(q, cache, table, seqlens, indices, validate=False),
        "DSA": lambda: sparse_mla_decode(q, cache, table, seqlens, select_topk(indexer(), TOPK), validate=False),
    }, ROUNDS)
    return timed, error


def dsa(h_q: int, batch: int = 32) -> None:
    print(f"DSA vs dense MLA decode: batch {batch}, s_q 1, h_q {h_q}, top {TOPK}, "
          f"{INDEX_HEADS} FP8 index heads of {INDEX_DIM}")
    steps = ("dense", "indexer", "top-k", "sparse", "DSA")
    print("  " + f"{'s_k':>7} " + " ".join(f"{name:>9}" for name in steps) + f" {'DSA/dense':>9}")
    crossover = None
    for s_k in CONTEXTS:
        timed, error = dsa_at(s_k, h_q, batch)
        torch.cuda.empty_cache()
        ratio = timed["DSA"] / timed["dense"]
        if crossover is None and ratio < 1:
            crossover = s_k
        print(f"  {s_k:>7} " + " ".join(f"{timed[name] * 1e3:>7.1f}us" for name in steps)
              + f" {ratio:>9.2f}   (sparse rel err {error:.1e})")
    print(f"  crossover: {'none up to ' + str(CONTEXTS[-1]) if crossover is None else f's_k = {crossover}'}")


def fp8(h_q: int, batch: int = 128, s_k: int = 8192) -> None:
    cache, table = paged(batch, s_k, D, torch.bfloat16, seed=h_q)
    cache4 = cache.unsqueeze(2)
    seqlens = torch.full((batch,), s_k, dtype=torch.int32, device="cuda")
    q = (2 * torch.randn(batch, 1, h_q, D, device="cuda")).bfloat16()
    quantized = Fp8LatentCache.quantize(cache4)
    out, _ = mla_decode_fp8(q, quantized, table, seqlens, validate=False)
    read = quantized.dequantize(torch.bfloat16)
    ref, _ = mla_decode_reference(q[:2].double(), read, table[:2], seqlens[:2])
    error = rel_err(out[:2], ref)
    assert error < 2e-2, f"FP8 cache decode: relative error {error:.1e}"
    exact, _ = mla_decode_reference(q[:2].double(), cache4, table[:2], seqlens[:2])
    bf16_bytes = mla_decode_min_bytes([s_k] * batch, 1, h_q, torch.bfloat16)
    fp8_bytes = bf16_bytes - batch * s_k * (D * 2 - (DV + 4 * DV // 128 + (D - DV) * 2))  # 656 bytes a token
    timed = median_ms({"bf16 cache": lambda: mla_decode(q, cache4, table, seqlens, validate=False),
                       "FP8 cache": lambda: mla_decode_fp8(q, quantized, table, seqlens, validate=False)}, ROUNDS)
    print(f"FP8 latent cache vs bf16: batch {batch}, s_k {s_k}, s_q 1, h_q {h_q} "
          f"(FP8 against the bf16 cache's answer: rel err {rel_err(out[:2], exact):.1e})")
    for name, nbytes in (("bf16 cache", bf16_bytes), ("FP8 cache", fp8_bytes)):
        ms = timed[name]
        print(f"  {ms * 1e3:9.1f} us  {nbytes / ms / 1e6:7.0f} GB/s of {nbytes / 1e6:7.1f} MB  {name}")


def main() -> int:
    parts = sys.argv[1:] or ["dsa", "fp8"]
    if "dsa" in parts:
        for h_q in (16, 128):
            dsa(h_q)
    if "fp8" in parts:
        for h_q in (16, 32):
            fp8(h_q)
    return 0


if __name__ == "__main__":
    sys.exit(main())

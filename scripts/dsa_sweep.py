"""DeepSeek Sparse Attention against dense MLA decode, by context length; DSA prefill against dense
causal prefill, by prompt length; and the FP8 latent cache against the bf16 one.

    PYTHONPATH=src:scripts python scripts/dsa_sweep.py [dsa] [prefill] [fp8]      (default: all three)
    PYTHONPATH=src:scripts python scripts/dsa_sweep.py prefill --dry-run           (any machine)

dsa: for each context length s_k (every request of the batch that long), the dense decode
(`mla_decode` over all s_k tokens) against DSA's three steps, each timed alone and together:
the lightning indexer (`index_scores`, 64 FP8 index heads of 128, one scale a token), the top
2048 (`select_topk`), and sparse MLA over them (`sparse_mla_decode`). The crossover is the
shortest context where the three together beat the dense decode. Batch 32, one query token,
h_q 16 (DeepSeek-V3.2 over 8 GPUs) and 128 (one GPU).

prefill: for each prompt of s tokens (no cache; h_q 128, top 2048, 64 FP8 index heads of 128),
DSA's steps each timed alone and together: the prefill indexer (`index_scores_prefill`, causal),
the top 2048 of each row (`select_topk`) and sparse MLA prefill (`sparse_mla_prefill`); against
dense causal prefill as DeepSeek-V3 runs it: the latent up-projected to per-head keys (128 + the
shared 64 RoPE dims) and values (128, zero-padded to 192 so that SDPA may take its flash
kernel), then causal SDPA; "SDPA" is the attention alone, on keys and values made beforehand.
TFLOP/s count useful FLOPs only (the indexer's visible pairs, the valid selected tokens, SDPA's
causal pairs at 192 + 128 dims). `--dry-run`: the same inputs, checks and counts at small shapes
on the CPU (Triton's interpreter), nothing timed.

fp8: `mla_decode_fp8` over the FP8 cache against `mla_decode` over the bf16 one it came from,
at FlashMLA's memory-bound shapes (batch 128, s_q 1, h_q 16 and 32), with the bytes each reads.

Each output is checked first (sparse MLA against its float64 reference on two requests, or three
query tokens of a prompt; the prefill indexer's scores and the dense prefill against float64 on a
few query tokens; the FP8 decode against float64 of the cache it reads), then timed as the other
sweeps time kernels: after a reading L2 flush, interleaved, medians of CUDA event times
(device_timing.median_ms).
"""

import kforge  # noqa: F401, I001  (before triton)
import math
import sys

import torch
import torch.nn.functional as F

from device_timing import median_ms
from kforge.kernels.mla.decode import (Fp8LatentCache, mla_decode, mla_decode_flops, mla_decode_fp8,
                                       mla_decode_min_bytes, mla_decode_reference)
from kforge.kernels.mla.sparse import (FP8_INDEX_ERROR, index_scores, indexer_flops, select_topk, sparse_mla_decode,
                                       sparse_mla_decode_reference, sparse_mla_flops)
from kforge.kernels.mla.sparse_prefill import (index_scores_prefill, index_scores_prefill_reference,
                                               sparse_mla_prefill, sparse_mla_prefill_reference)

ROUNDS = 20
PAGE, D, DV = 64, 576, 512
INDEX_HEADS, INDEX_DIM, TOPK = 64, 128, 2048
CONTEXTS = (4096, 8192, 16384, 32768, 65536, 131072)
PROMPTS = (4096, 16384, 32768)  # s_q = s_kv; the score matrix alone is 4.3 GB at 32k
PREFILL_HEADS, PREFILL_ROUNDS = 128, 5
NOPE, ROPE = 128, D - DV  # DeepSeek-V3's unabsorbed head: 128 dims from the latent, the 64 RoPE dims


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


def prefill_at(s: int, h_q: int, device: str, index_heads: int = INDEX_HEADS, index_dim: int = INDEX_DIM,
               topk: int = TOPK) -> tuple[dict, dict[str, float], dict[str, int]]:
    """({step: callable}, {check: relative error}, {step: useful FLOPs}) for a prompt of s tokens
    and no cache, every output checked on a few query tokens against float64 first."""
    g = torch.Generator(device=device).manual_seed(s)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, generator=g)

    kv = randn(s, 1, D).bfloat16()
    latent, k_rope = kv[:, 0, :DV], kv[:, 0, DV:]
    w_uk, w_uv = (randn(2, h_q, NOPE, DV) / DV ** 0.5).bfloat16()  # per head: latent -> 128
    q_nope, q_rope = randn(s, h_q, NOPE).bfloat16(), randn(s, h_q, ROPE).bfloat16()
    q = torch.cat([torch.einsum("shn,hnc->shc", q_nope, w_uk), q_rope], -1)  # absorbed: (s, h_q, 576)
    scale = (NOPE + ROPE) ** -0.5
    q_idx = randn(s, index_heads, index_dim).to(torch.float8_e4m3fn)
    weights = randn(s, index_heads) / index_heads
    k_idx = randn(s, index_dim).to(torch.float8_e4m3fn)
    k_scale = torch.rand(s, device=device, generator=g) + 0.5

    def indexer() -> torch.Tensor:
        return index_scores_prefill(q_idx, weights, k_idx, k_scale)

    def keys_values() -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head keys (h_q, s, 192) and values (h_q, s, 192: 128 and zeros)."""
        k_nope = (latent @ w_uk.reshape(h_q * NOPE, DV).T).view(s, h_q, NOPE)
        values = (latent @ w_uv.reshape(h_q * NOPE, DV).T).view(s, h_q, NOPE)
        keys = torch.cat([k_nope, k_rope[:, None].expand(s, h_q, ROPE)], -1)
        return keys.transpose(0, 1), F.pad(values, (0, ROPE)).transpose(0, 1)

    queries = torch.cat([q_nope, q_rope], -1).transpose(0, 1)[None]  # (1, h_q, s, 192)

    def sdpa(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """(s, h_q, 128): causal attention of every head, its padding cut off."""
        out = F.scaled_dot_product_attention(queries, keys[None], values[None], is_causal=True, scale=scale)
        return out[0, :, :, :NOPE].transpose(0, 1)

    def dense() -> torch.Tensor:
        return sdpa(*keys_values())

    scores = indexer()
    indices = select_topk(scores, topk)[:, None]
    out, _ = sparse_mla_prefill(q, kv, indices, softmax_scale=scale)
    errors = {"indexer": 0.0}
    for first in (0, s // 2, s - 2):  # two query tokens at a time, at their place in the prompt
        rows = slice(first, first + 2)
        expected = index_scores_prefill_reference(q_idx[rows].float(), weights[rows], k_idx.float(), k_scale,
                                                  q_offset=first)
        shown = expected != float("-inf")
        assert torch.equal(scores[rows] != float("-inf"), shown), f"indexer at s {s}: wrong causal limits"
        error = ((scores[rows][shown].double() - expected[shown]).abs().max() / expected[shown].abs().max()).item()
        errors["indexer"] = max(errors["indexer"], error)
    sample = torch.tensor([0, s // 2, s - 1], device=device)
    ref, _ = sparse_mla_prefill_reference(q[sample], kv, indices[sample], softmax_scale=scale)
    errors["sparse"] = rel_err(out[sample], ref.double())
    # dense: float64 of the unabsorbed model (q_nope through W_UK, every visible token), then W_UV
    exact_q = torch.cat([torch.einsum("shn,hnc->shc", q_nope[sample].double(), w_uk.double()),
                         q_rope[sample].double()], -1)
    visible = torch.arange(s, device=device).expand(len(sample), s).clone()
    visible[visible > sample[:, None]] = -1  # the causal rule as an index list: -1 is skipped
    attended, _ = sparse_mla_prefill_reference(exact_q, kv.double(), visible[:, None].int(), softmax_scale=scale)
    errors["dense"] = rel_err(dense()[sample], torch.einsum("shc,hnc->shn", attended.double(), w_uv.double()))
    for name, error in errors.items():
        assert error < (FP8_INDEX_ERROR if name == "indexer" else 2e-2), f"{name} at s {s}: relative error {error:.1e}"

    keys, values = keys_values()
    steps = {
        "indexer": indexer,
        "top-k": lambda: select_topk(scores, topk),
        "sparse": lambda: sparse_mla_prefill(q, kv, indices, softmax_scale=scale),
        "DSA": lambda: sparse_mla_prefill(q, kv, select_topk(indexer(), topk)[:, None], softmax_scale=scale),
        "dense": dense,
        "SDPA": lambda: sdpa(keys, values),
    }
    flops = {"indexer": indexer_flops([s], s, index_heads, index_dim, causal=True),
             "sparse": sparse_mla_flops(indices.permute(1, 0, 2), torch.tensor([s], device=device), h_q),
             "SDPA": mla_decode_flops([s], s, h_q, NOPE + ROPE, NOPE, causal=True)}
    return steps, errors, flops


def prefill(h_q: int = PREFILL_HEADS, dry_run: bool = False) -> None:
    device = "cpu" if dry_run else "cuda"
    if dry_run:
        from kforge.runtime.interpreter import mend_interpreter

        mend_interpreter()  # the interpreter's bf16 dots and casts, as on the GPU
    # the dry run: V3.2's attention dims, smaller heads and index, prompts of a tile and a tail
    prompts, shape = ((96, 150), {"index_heads": 16, "index_dim": 32, "topk": 64}) if dry_run else (PROMPTS, {})
    h_q = 16 if dry_run else h_q
    topk = shape.get("topk", TOPK)
    print(f"DSA prefill vs dense causal prefill: s_q = s_kv, h_q {h_q}, top {topk}, "
          f"{shape.get('index_heads', INDEX_HEADS)} FP8 index heads of {shape.get('index_dim', INDEX_DIM)}"
          + (" (dry run on the CPU: checks only)" if dry_run else ""))
    names = ("indexer", "top-k", "sparse", "DSA", "dense", "SDPA")
    if not dry_run:
        print("  " + f"{'s':>6} " + " ".join(f"{name:>9}" for name in names) + f" {'DSA/dense':>9}   TFLOP/s: "
              "indexer (FP8), sparse, SDPA")
    for s in prompts:
        steps, errors, flops = prefill_at(s, h_q, device, **shape)
        checked = ", ".join(f"{name} {error:.1e}" for name, error in errors.items())
        if dry_run:
            counted = ", ".join(f"{name} {n / 1e9:.2f}" for name, n in flops.items())
            print(f"  s {s}: rel err {checked}; GFLOP {counted}")
            continue
        timed = median_ms(steps, PREFILL_ROUNDS)
        del steps
        torch.cuda.empty_cache()
        rates = " ".join(f"{flops[name] / timed[name] / 1e9:5.0f}" for name in ("indexer", "sparse", "SDPA"))
        print(f"  {s:>6} " + " ".join(f"{timed[name]:>7.2f}ms" for name in names)
              + f" {timed['DSA'] / timed['dense']:>9.2f}   {rates}   (rel err {checked})")


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
    # the bf16 cache on the same (Triton) kernels as the FP8 one, which the CUDA kernel does not take
    timed = median_ms({"bf16 cache": lambda: mla_decode(q, cache4, table, seqlens, validate=False,
                                                        backend="triton"),
                       "FP8 cache": lambda: mla_decode_fp8(q, quantized, table, seqlens, validate=False)}, ROUNDS)
    print(f"FP8 latent cache vs bf16: batch {batch}, s_k {s_k}, s_q 1, h_q {h_q} "
          f"(FP8 against the bf16 cache's answer: rel err {rel_err(out[:2], exact):.1e})")
    for name, nbytes in (("bf16 cache", bf16_bytes), ("FP8 cache", fp8_bytes)):
        ms = timed[name]
        print(f"  {ms * 1e3:9.1f} us  {nbytes / ms / 1e6:7.0f} GB/s of {nbytes / 1e6:7.1f} MB  {name}")


def main() -> int:
    dry_run = "--dry-run" in sys.argv
    parts = [arg for arg in sys.argv[1:] if arg != "--dry-run"] or ["dsa", "prefill", "fp8"]
    if dry_run and parts != ["prefill"]:
        print("--dry-run is for the prefill part alone: dsa_sweep.py prefill --dry-run")
        return 2
    if "dsa" in parts:
        for h_q in (16, 128):
            dsa(h_q)
    if "prefill" in parts:
        prefill(dry_run=dry_run)
    if "fp8" in parts:
        for h_q in (16, 32):
            fp8(h_q)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Decode attention at batch 64, context 4096, as `kforge bench model`'s batch part runs it: the
paged kernel's tilings against SDPA over a dense cache of the same bytes.

    PYTHONPATH=src python scripts/paged_decode_batch_sweep.py

Why: at batch 64 x 4k the llama3-8b step reads 34 GB of K and V against 15 GB of weights, and
ours runs at 78% of the step's floor where the compiled baseline (SDPA over its static cache)
runs at 90% (H200, bench-model.txt). One layer's call reads 1.07 GB of K and V (far past L2):
its floor at the copy rate is ~0.25 ms. Timed alone, after an L2 flush, the median of 30.
Each variant's output is checked against the default's first. Prints us a call and GB/s of K
and V; measured on the H200: benchmarks/results/nvidia-h200/paged-decode-batch-sweep.txt.
"""

import kforge  # noqa: F401  (before triton)

import torch
import torch.nn.functional as F

from device_timing import checked_variants, median_ms
from kforge.kernels.serving.paged_decode import paged_decode, plan_decode

BATCH, CONTEXT, KV_HEADS, Q_HEADS, HEAD_DIM, PAGE = 64, 4096, 8, 32, 128, 16
# (BLOCK_N, partition size, num_warps, num_stages); None: plan_decode's choice
VARIANTS = [None] + [(n, CONTEXT, w, s) for n in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4)] + [
    (64, 2048, 4, 3), (64, 1024, 4, 3), (128, 2048, 8, 3), (128, 1024, 8, 3)]


def main():
    pages_each = CONTEXT // PAGE
    pages = BATCH * pages_each
    k = torch.randn(pages, KV_HEADS, PAGE, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(pages, KV_HEADS, PAGE, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(BATCH, Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    table = torch.randperm(pages, device="cuda", dtype=torch.int32).view(BATCH, pages_each)
    lens = torch.full((BATCH,), CONTEXT, device="cuda", dtype=torch.int32)
    nbytes = 2 * k.numel() * k.element_size()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    default = plan_decode(BATCH, KV_HEADS, CONTEXT, HEAD_DIM, 2, sms)
    print(f"batch {BATCH}, context {CONTEXT}: K and V {nbytes / 1e9:.2f} GB; plan_decode's default: BLOCK_N "
          f"{default.block_n}, partitions of {default.partition_size}, {default.num_warps} warps, "
          f"{default.num_stages} stages")
    want = paged_decode(q, k, v, table, lens, validate=False)
    keys = ("BLOCK_N", "partition_size", "num_warps", "num_stages")
    named = [("default", None)] + [("BLOCK_N %d, partition %d, %d warps, %d stages" % variant, dict(zip(keys, variant)))
                                   for variant in VARIANTS[1:]]
    fns = checked_variants(named, lambda c: paged_decode(q, k, v, table, lens, validate=False, config=c), want)
    # the compiled baseline's attention: a dense (batch, kv heads, context, head dim) cache, a boolean mask
    dense_k = k[table.flatten().long()].view(BATCH, pages_each, KV_HEADS, PAGE, HEAD_DIM).permute(0, 2, 1, 3, 4) \
        .reshape(BATCH, KV_HEADS, CONTEXT, HEAD_DIM).contiguous()
    dense_v = v[table.flatten().long()].view(BATCH, pages_each, KV_HEADS, PAGE, HEAD_DIM).permute(0, 2, 1, 3, 4) \
        .reshape(BATCH, KV_HEADS, CONTEXT, HEAD_DIM).contiguous()
    mask = torch.ones(1, CONTEXT, dtype=torch.bool, device="cuda")
    sdpa = lambda m=mask: F.scaled_dot_product_attention(q[:, :, None], dense_k, dense_v, attn_mask=m,  # noqa: E731
                                                         enable_gqa=True)
    error = (sdpa()[:, :, 0].float() - want.float()).abs().max().item()
    print(f"  SDPA over the dense cache: max error against ours {error:.3g}")
    fns["SDPA dense, mask (the compiled baseline's call)"] = sdpa
    fns["SDPA dense, no mask"] = lambda: F.scaled_dot_product_attention(q[:, :, None], dense_k, dense_v,
                                                                        enable_gqa=True)
    times = median_ms(fns, 30)
    print("us a call, GB/s of K and V (median of 30, L2 flushed)")
    for name, ms in times.items():
        print(f"  {name:<52} {ms * 1e3:8.1f} {nbytes / ms / 1e6:8.0f}")


if __name__ == "__main__":
    main()

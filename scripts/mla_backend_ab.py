"""MLA decode's two backends at FlashMLA's shapes, kernel alone: the CUDA kernel for Hopper
(decode_hopper.py; "cuda" its default, splits from the device schedule, "cuda host" the host
plan's splits) against the Triton kernels (decode.py's default plan and device schedule).

    PYTHONPATH=src:scripts python scripts/mla_backend_ab.py [S_K ...]     (PARTS=mla-ab in gpu_check.sh)

Every request at s_k tokens in random pages of 64 (b = 128, h_q in 16, 32, 64, 128, s_q 1 and 2),
then a ragged batch (lengths uniform in [1, s_k]). Each shape: the CUDA output checked against
Triton's first (max |difference|), then both timed in interleaved rounds after an L2 flush (median
of 15). Prints us, the cache read once as GB/s and as % of the device's copy rate
(ceilings.json's copy_gbps when KFORGE_COPY_GBPS is unset), TFLOP/s, and the ratio."""

import kforge  # noqa: F401  (before triton)

import os
import sys

import torch

from device_timing import median_ms
from kforge.kernels.mla.decode import mla_decode, mla_decode_flops
from kforge.kernels.mla.decode_hopper import mla_decode_hopper, plan_splits

PAGE, D = 64, 576
COPY_GBPS = float(os.environ.get("KFORGE_COPY_GBPS", "4246"))  # H200, ceilings.json


def shape_rows(s_k: int):
    for h_q in (16, 32, 64, 128):
        for s_q in (1, 2):
            yield 128, s_k, h_q, s_q, False
    yield 128, s_k, 16, 1, True
    yield 128, s_k, 128, 1, True


def main():
    lengths_k = [int(a) for a in sys.argv[1:]] or [4096, 8192]
    print(f"{'shape':<34} {'backend':<9} {'us':>8} {'GB/s':>7} {'% copy':>7} {'TFLOP/s':>8} {'x triton':>8}  "
          "max |diff|")
    for s_k in lengths_k:
        for batch, s_k, h_q, s_q, ragged in shape_rows(s_k):
            pages_each = s_k // PAGE
            g = torch.Generator(device="cuda").manual_seed(s_k + h_q + s_q)
            cache = torch.randn(batch * pages_each, PAGE, 1, D, device="cuda", dtype=torch.bfloat16, generator=g)
            table = torch.randperm(batch * pages_each, device="cuda", dtype=torch.int32, generator=g)
            table = table.view(batch, pages_each)
            if ragged:
                lens = torch.randint(1, s_k + 1, (batch,), device="cuda", dtype=torch.int32, generator=g)
            else:
                lens = torch.full((batch,), s_k, device="cuda", dtype=torch.int32)
            q = torch.randn(batch, s_q, h_q, D, device="cuda", dtype=torch.bfloat16, generator=g)
            causal = s_q > 1
            calls = {backend: (lambda b=backend: mla_decode(q, cache, table, lens, causal=causal, validate=False,
                                                            backend=b))
                     for backend in ("triton", "cuda")}
            sms = torch.cuda.get_device_properties(0).multi_processor_count
            host_split, _ = plan_splits(batch, h_q * s_q, s_k, sms)
            calls["cuda host"] = lambda: mla_decode_hopper(q, cache, table, lens, causal=causal, validate=False,
                                                           split_size=host_split)
            want = calls["triton"]()
            diffs = {}
            for name in ("cuda", "cuda host"):
                got = calls[name]()
                diffs[name] = ((want[0].float() - got[0].float()).abs().max().item(),
                               (want[1] - got[1]).abs().max().item())
            times = median_ms(calls, 15)
            host = [int(n) for n in lens.tolist()]
            nbytes = sum(host) * D * 2
            flops = mla_decode_flops(host, s_q, h_q, causal=causal)
            label = f"b {batch} s_k {s_k} h_q {h_q} s_q {s_q}{' ragged' if ragged else ''}"
            for backend, ms in times.items():
                line = (f"{label:<34} {backend:<9} {ms * 1e3:8.1f} {nbytes / ms / 1e6:7.0f} "
                        f"{100 * nbytes / ms / 1e6 / COPY_GBPS:6.1f}% {flops / ms / 1e9:8.1f}")
                if backend != "triton":
                    line += f" {times['triton'] / ms:7.2f}x  {diffs[backend][0]:.2e} (lse {diffs[backend][1]:.1e})"
                print(line)
            del cache


if __name__ == "__main__":
    main()

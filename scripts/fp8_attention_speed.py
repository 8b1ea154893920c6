"""The FP8 attention forward's speed against the bf16 kernel and SDPA, on the GPU, same run.

    python scripts/fp8_attention_speed.py [--results FILE.jsonl] [--budget SECONDS]
    python scripts/fp8_attention_speed.py --sweep   # the kernel's tiles, warps and stages, full attention

B 8, H 16, N 4096, hd 128 (the attention family's target shape), full and causal, bf16
inputs. Methods, interleaved by kforge's timing engine (L2 flushed, fresh random inputs a
round, median device time): kforge's bf16 forward, the FP8 forward with its quantization
(smoothing K, per-token and per-channel scales: what a caller pays) and without it (the kernel
on operands quantized beforehand), SDPA flash and cuDNN. TFLOP/s count 4 B H N^2 d, half of it
causal. One JSON record per shape goes to --results.
"""

import argparse
import datetime
import json
import sys

import torch

from kforge.device import current_device, library_versions
from kforge.harness.timing import TimingConfig, time_interleaved
from kforge.kernels.attention import flash_fp8
from kforge.kernels.attention.flash_forward import flash_attention_forward

SHAPE = (8, 16, 4096, 128)


def methods(causal: bool) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    def sdpa(backend):
        def call(s):
            with sdpa_kernel(backend):
                return scaled_dot_product_attention(s[0], s[1], s[2], is_causal=causal)
        return call

    def kernel_only(s):  # the same launch flash_attention_fp8 makes, on operands quantized beforehand
        return flash_fp8.flash_attention_fp8(s[0], s[1], s[2], causal=causal, quantized=s[3])[0]

    return {"bf16 ours": lambda s: flash_attention_forward(s[0], s[1], s[2], causal=causal)[0],
            "fp8 ours": lambda s: flash_fp8.flash_attention_fp8(s[0], s[1], s[2], causal=causal)[0],
            "fp8 kernel only": kernel_only,
            "sdpa-flash": sdpa(SDPBackend.FLASH_ATTENTION), "sdpa-cudnn": sdpa(SDPBackend.CUDNN_ATTENTION)}


def sweep(device, make_set, budget: float) -> None:
    """The FP8 kernel alone (operands quantized beforehand) in each tile, warp and stage count
    that compiles, interleaved, full attention."""
    import itertools

    first = make_set(0)
    fns = {}
    for bm, bn, warps, stages in itertools.product((64, 128), (64, 128, 256), (4, 8), (2, 3, 4)):
        def call(s, bm=bm, bn=bn, warps=warps, stages=stages):
            return flash_fp8.flash_attention_fp8(s[0], s[1], s[2], quantized=s[3], blocks=(bm, bn), num_warps=warps,
                                                 num_stages=stages)[0]
        try:
            call(first)
        except Exception as exc:  # noqa: BLE001 - a tile that does not fit is reported and skipped
            print(f"BLOCK {bm}x{bn} warps {warps} stages {stages}: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}")
            continue
        fns[f"BLOCK {bm}x{bn} warps {warps} stages {stages}"] = call
    torch.cuda.synchronize()
    run = time_interleaved(fns, lambda i: make_set(i + 1), device, TimingConfig(budget_s=budget))
    b, h, n, d = SHAPE
    flops = flash_fp8.attention_fp8_flops(b, h, n, n, d, False)
    for name in sorted(fns, key=lambda name: run.profile[name].median_device_ms):
        ms = run.profile[name].median_device_ms
        print(f"{name:34} {ms:8.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=None)
    parser.add_argument("--budget", type=float, default=3.0)
    parser.add_argument("--sweep", action="store_true", help="time the kernel's configs instead")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("fp8_attention_speed: needs a CUDA GPU", file=sys.stderr)
        return 1
    device = current_device("cuda")
    b, h, n, d = SHAPE

    def make_set(i):
        g = torch.Generator(device="cuda").manual_seed(i)
        q, k, v = (torch.randn(b, h, n, d, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        return [q, k, v, flash_fp8.quantize_qkv(q, k, v)]

    print(f"FP8 attention forward on {device.name}: B {b}, H {h}, N {n}, hd {d}, bf16 inputs")
    if args.sweep:
        sweep(device, make_set, args.budget)
        return 0
    print(f"{'':8} {'method':16} {'ms':>8} {'TFLOP/s':>8} {'vs bf16 ours':>13}")
    for causal in (False, True):
        fns = methods(causal)
        first = make_set(0)
        for fn in fns.values():  # compile and autotune outside the timed rounds
            fn(first)
        run = time_interleaved(fns, lambda i: make_set(i + 1), device, TimingConfig(budget_s=args.budget))
        flops = flash_fp8.attention_fp8_flops(b, h, n, n, d, causal)
        ms = {name: run.profile[name].median_device_ms for name in fns}
        for name in fns:
            print(f"{'causal' if causal else 'full':8} {name:16} {ms[name]:8.3f} {flops / ms[name] / 1e9:8.0f} "
                  f"{ms['bf16 ours'] / ms[name]:12.3f}x")
        if args.results:
            record = {"bench": "attention-fp8-forward", "shape": {"B": b, "H": h, "N": n, "D": d, "causal": causal},
                      "device_ms": ms, "flops": flops, "rounds": run.rounds, "device": device.to_dict(),
                      "versions": library_versions(), "command": " ".join(["python", *sys.argv]),
                      "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
            with open(args.results, "a") as f:
                f.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

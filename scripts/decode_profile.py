"""Where one decode step of the Llama engine spends its time: every kernel of a graphed step, by position in the layer.

    python scripts/decode_profile.py [--model llama3-8b] [--weights bf16|w4a16|fp8] [--batch 1] [--prompt 512]
                                     [--unfused] [--quantize-head]

Builds the preset with random weights as `kforge bench model` does, prefills one prompt per
slot, warms the decode graph up, then (1) times 30 steps back to back with CUDA events and
(2) records 10 more under torch.profiler (CUPTI sees each kernel a graph replay launches).
A step's kernels repeat once per layer: the script finds that period and prints, for each
position in the layer, the kernel's name and its mean time over the layers and steps; then
the kernels before the first layer and after the last (embedding, final norm, LM head,
sampling). Last, the step's time against the sum of its kernels: what is left is the
gaps between kernels. The weight read by each projection and its floor at the measured copy
rate are printed beside, so the GEMVs' bandwidth can be read off the table. `--unfused` runs
every op of the step on its own (`kforge.models.llama.model.FUSED_DECODE = False`): the same
numbers in more launches, so two runs, one with it, give what the fusions buy. `--quantize-head`
puts the LM head in the weights' format too (quantize.py; its quality cost is in
tests/models/test_quantize.py).
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

import torch


def kernel_trace(step, steps: int) -> list[tuple[str, float, float]]:
    """(name, start us, duration us) of every CUDA kernel `steps` calls of `step` launch."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time > 0:
            kernels.append((event.name, event.time_range.start, event.device_time))
    return sorted(kernels, key=lambda k: k[1])


def layer_period(names: list[str], layers: int) -> tuple[int, int]:
    """(first, period): names[first + i * period + j] is the same for every layer i."""
    for period in range(1, len(names) // layers + 1):
        for first in range(0, len(names) - layers * period + 1):
            if all(names[first + i * period + j] == names[first + j]
                   for i in range(1, layers) for j in range(period)):
                return first, period
    raise RuntimeError(f"no kernel sequence repeats {layers} times in one step of {len(names)} kernels")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--weights", default="bf16", choices=("bf16", "w4a16", "fp8"))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--unfused", action="store_true", help="each op of the step on its own (no decode fusions)")
    parser.add_argument("--quantize-head", action="store_true", help="the LM head in the weights' format too")
    args = parser.parse_args()

    from kforge.models.llama import model as llama_model

    llama_model.FUSED_DECODE = not args.unfused

    from kforge.bench.model import copy_bandwidth, time_steps
    from kforge.device import current_device
    from kforge.models.engine import Engine
    from kforge.models.llama.checkpoint import random_model
    from kforge.models.llama.config import PRESETS
    from kforge.models.llama.quantize import weight_bytes
    from kforge.models.sampling import SamplingParams

    device = current_device()
    config = PRESETS[args.model]
    copy_gbps, copy_source = copy_bandwidth(device)
    model = random_model(config, seed=0, dtype=torch.bfloat16, device=device.torch_device, weights=args.weights,
                         quantize_head=args.quantize_head)
    timed, profiled, warmup = 30, 10, 8
    generated = 1 + warmup + timed + profiled + 2
    engine = Engine(model, max_slots=args.batch, max_context=args.prompt + generated,
                    max_step_tokens=args.prompt * args.batch)
    gen = torch.Generator().manual_seed(1)
    for _ in range(args.batch):
        prompt = torch.randint(0, config.vocab_size, (args.prompt,), generator=gen).tolist()
        engine.submit(prompt, SamplingParams(max_tokens=generated))
    with torch.no_grad():
        engine.step()  # every prompt in one step
        timing = time_steps(engine.step, steps=timed, warmup=warmup, cuda=True)
        kernels = kernel_trace(engine.step, profiled)

    per_step = len(kernels) // profiled
    names = [k[0] for k in kernels[:per_step]]
    first, period = layer_period(names, config.n_layers)
    by_position: dict[int, list[float]] = defaultdict(list)
    outside: dict[int, list[float]] = defaultdict(list)
    for s in range(profiled):
        step = kernels[s * per_step:(s + 1) * per_step]
        for i, (_, _, us) in enumerate(step):
            inside = first <= i < first + config.n_layers * period
            (by_position[(i - first) % period] if inside else outside[i]).append(us)

    step_ms = timing.median_ms
    kernel_ms = sum(us for _, _, us in kernels) / profiled / 1e3
    w_bytes = weight_bytes(model)
    fusions = ("unfused" if args.unfused else "fused") + (", head quantized" if args.quantize_head else "")
    print(f"# {args.model} {args.weights} ({fusions}), batch {args.batch}, prompt {args.prompt}; {device.name}, "
          f"torch {torch.__version__}; copy {copy_gbps:,.0f} GB/s ({copy_source})")
    print(f"# step {step_ms:.3f} ms (median of {timed}, {timing.clock}); {per_step} kernels a step, "
          f"{period} a layer x {config.n_layers} layers from kernel {first}")
    print(f"# weights {w_bytes / 1e9:.2f} GB: floor {w_bytes / copy_gbps / 1e6:.3f} ms "
          f"({100 * w_bytes / copy_gbps / 1e6 / step_ms:.1f}% of the step)")
    itemsize = {"bf16": 2.0, "w4a16": 0.5 + 2 / 128, "fp8": 1.0 + 4 / 128 ** 2}[args.weights]
    c = config
    projections = {"wqkv": (c.q_dim + 2 * c.kv_dim) * c.dim, "wo": c.dim * c.q_dim,
                   "w_gate_up": 2 * c.ffn_dim * c.dim, "w_down": c.dim * c.ffn_dim}
    print("# a layer's projections (read once a step), their floors at the copy rate: " + ", ".join(
        f"{k} {n * itemsize / 1e6:.1f} MB {n * itemsize / copy_gbps / 1e3:.1f} us" for k, n in projections.items()))
    head = model.head  # the model's dtype, unless --quantize-head
    head_bytes, head_format = head.nbytes, type(head).__name__ if args.quantize_head else str(head.dtype)
    print(f"# LM head ({head_format}) {head_bytes / 1e6:.0f} MB: {head_bytes / copy_gbps / 1e3:.1f} us")
    print(f"{'where':<10} {'us':>9} {'x/step':>7} {'% step':>7}  kernel")
    rows = [(f"pre {i}", statistics.mean(v), 1, names[i]) for i, v in sorted(outside.items()) if i < first]
    rows += [(f"layer {j}", statistics.mean(v), c.n_layers, names[first + j]) for j, v in sorted(by_position.items())]
    rows += [(f"post {i}", statistics.mean(v), 1, names[i]) for i, v in sorted(outside.items()) if i >= first]
    for where, us, times, name in rows:
        print(f"{where:<10} {us:>9.2f} {times:>7} {100 * us * times / 1e3 / step_ms:>6.1f}%  {name[:110]}")
    print(f"kernels {kernel_ms:.3f} ms of the {step_ms:.3f} ms step; between and around them "
          f"{step_ms - kernel_ms:.3f} ms ({100 * (step_ms - kernel_ms) / step_ms:.1f}%)")


if __name__ == "__main__":
    main()

"""The FP8 attention forward's error against float64, as docs/attention.md tabulates it.

    python scripts/fp8_attention_accuracy.py            # CPU: the Triton interpreter, fp16 inputs
    python scripts/fp8_attention_accuracy.py --device cuda --dtype bfloat16

B 1, H 2 (2 KV heads), N 128; q ~ N(0, 1) times 1 (a flat softmax) or 4 (a sharp one); K with
a per-channel offset (tests/kernels/test_flash_fp8.py's inputs). Prints, per head dim and
softmax, the relative L2 error of the FP8 forward (both products, and Q K^T alone) and of the
16-bit kernel, with the FP8 output's cosine similarity.
"""

import argparse
import sys
from pathlib import Path

import kforge  # noqa: F401  (before triton: the interpreter on a CPU)
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "kernels"))
from test_flash_fp8 import _inputs, _reference, _rel  # noqa: E402

from kforge.kernels.attention.flash_forward import flash_attention_forward  # noqa: E402
from kforge.kernels.attention.flash_fp8 import flash_attention_fp8  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    args = parser.parse_args()
    if args.device == "cpu":  # the interpreter's e4m3 casts rounded as no GPU does (kforge.runtime.interpreter)
        from kforge.runtime.interpreter import mend_interpreter

        mend_interpreter()
    dtype = getattr(torch, args.dtype)
    print("| head dim | softmax | FP8 Q K^T and P V | FP8 Q K^T only | the 16-bit kernel |")
    print("|---:|---|---:|---:|---:|")
    for dim in (64, 128):
        for peaked, softmax in ((1.0, "flat (q ~ N(0, 1))"), (4.0, "sharp (q x 4)")):
            q, k, v = _inputs((1, 2, 2, 128, 128, dim), peaked=peaked, seed=1, dtype=dtype, device=args.device)
            expected = _reference(q.cpu(), k.cpu(), v.cpu(), False)[0]
            fp8 = flash_attention_fp8(q, k, v)[0].cpu()
            qk_only = flash_attention_fp8(q, k, v, pv_fp8=False)[0].cpu()
            sixteen = flash_attention_forward(q, k, v)[0].cpu()
            cosine = torch.nn.functional.cosine_similarity(fp8.double().flatten(), expected.flatten(), dim=0)
            print(f"| {dim} | {softmax} | {_rel(fp8, expected):.3f} (cosine {float(cosine):.4f}) | "
                  f"{_rel(qk_only, expected):.3f} | {_rel(sixteen, expected):.5f} |")


if __name__ == "__main__":
    main()

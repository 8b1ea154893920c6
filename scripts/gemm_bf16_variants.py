"""Device time of the bf16 CUDA rungs' variants against cuBLAS, shape by shape (H100).

    PYTHONPATH=src python scripts/gemm_bf16_variants.py [ROUNDS] [SET]

Each variant is timed after a reading L2 flush, interleaved with cuBLAS every round,
medians of CUDA event times (no host time: this is the kernel alone). SET "split"
(default): rungs 4 and 5 with the TMA descriptors' L2 promotion off / 128 B / 256 B at
4096^3, and at the shapes with fewer 128 x 256 tiles than SMs rung 4 as it is against its
split-K variant. SET "epilogue": rung 4 against its epilogue variants (two slice buffers,
a whole-tile buffer at 3 stages) and rung 6 (ping-pong) at large squares and LLM shapes.
SET "shortk": rungs 4, 5, 6 and 128 x 128 tiles on the GEMMs of GPT-2 small and ViT-L
(K 768-4096, the LM head's N 50304), where the epilogue weighs most. SET "tiles": 128 x 256
(rungs 4, 5) against 256 x 128 (cuBLAS's tile at 4096^3), at squares and an LLM shape. SET "spread": rung 4 (its
epilogue overlaps the next tile's k-loop) against its epilogue after the k-loop, and against storing a slice every k-tile or every 4 instead of every 2. SET "llm":
rungs 4 and 5 on the M = 4096 Llama-3 8B and 70B projections of `kforge bench gemm`. SET
"narrow": rung 4 on 128 x 256 and 128 x 192 tiles and rung 6 at 512-2048 rows, where 128 x 256
tiles leave SMs idle (what cuBLAS chooses there: 192 x 128, by ncu).
"""

import sys

import kforge  # noqa: F401  (before triton)
import torch

from device_timing import median_ms
from kforge.kernels import gemm_bf16

SPLIT = gemm_bf16.SPLIT_K_VARIANT


EPILOGUE = [("rung 4 2 x 64-wide buffers", 4, {"EPI_COLS": 64, "EPI_BUFFERS": 2}),
            ("rung 4 3 stages 256-wide", 4, {"STAGES": 3, "EPI_COLS": 256}),
            ("rung 4 3 stages 2 x 128-wide", 4, {"STAGES": 3, "EPI_BUFFERS": 2}),
            ("rung 6", 6, {})]
SHORT_K = [("rung 5", 5, {}), ("rung 6", 6, {}), ("rung 6 EPI_COLS 128", 6, {"EPI_COLS": 128}),
           ("rung 4 128 x 128", 4, {"BN": 128, "STAGES": 6, "EPI_COLS": 64})]
STREAM_K = [("rung 5", 5, {}), ("rung 4 stream-K", 4, gemm_bf16.STREAM_K_VARIANT),
            ("rung 4 stream-K min 4", 4, dict(gemm_bf16.STREAM_K_VARIANT, STREAM_K_MIN=4)),
            ("rung 4 stream-K GROUP_M 16", 4, dict(gemm_bf16.STREAM_K_VARIANT, GROUP_M=16))]
TALL = gemm_bf16.TALL_TILE
TILES = [("rung 5", 5, {}), ("rung 4 256 x 128", 4, TALL), ("rung 5 256 x 128", 5, TALL),
         ("rung 4 256 x 128 GROUP_M 16", 4, dict(TALL, GROUP_M=16))]
LLM = [("rung 5", 5, {})]
NARROW = [("rung 6", 6, {}), ("rung 4 split-K auto", 4, SPLIT), ("rung 4 128 x 192", 4, gemm_bf16.NARROW_TILE)]
SPREAD = [("rung 5", 5, {}), ("rung 4 epilogue after the k-loop", 4, gemm_bf16.EPILOGUE_AFTER_KLOOP),
          ("rung 4 a slice every k-tile", 4, {"EPI_SPREAD": 1}), ("rung 4 a slice every 4 k-tiles", 4, {"EPI_SPREAD": 4})]


def variants(m, n, k, which="split"):
    if which in ("epilogue", "shortk", "tiles", "streamk", "spread", "llm", "narrow"):
        yield "rung 4", dict(step=4), 0
        for name, number, defines in {"epilogue": EPILOGUE, "shortk": SHORT_K, "tiles": TILES,
                                      "streamk": STREAM_K, "spread": SPREAD, "llm": LLM, "narrow": NARROW}[which]:
            yield name, dict(step=number, defines=defines), 0
        return
    if m == n == k == 4096:
        for promotion in (0, 128, 256):
            for number in (4, 5):
                yield f"rung {number} L2 promotion {promotion}", dict(step=number), promotion
        return
    yield "rung 4", dict(step=4), 0
    yield "rung 4 split-K auto", dict(step=4, defines=SPLIT), 0
    for splits in (2, 4, 8):
        yield f"rung 4 split-K {splits}", dict(step=4, defines=SPLIT, split_k=splits), 0


def time_shape(m, n, k, b_layout, rounds, which="split"):
    a = torch.randn(m, k, device="cuda").bfloat16()
    b = torch.randn(*((k, n) if b_layout == "kn" else (n, k)), device="cuda").bfloat16()
    bt = b if b_layout == "kn" else b.t()
    want = a.float() @ bt.float()
    fns = {"cuBLAS": lambda: torch.matmul(a, bt)}
    for name, kwargs, promotion in variants(m, n, k, which):
        gemm_bf16.TMA_L2_PROMOTION_BYTES = promotion
        gemm_bf16._PLANS.clear()
        got = gemm_bf16.gemm(a, b, b_layout=b_layout, **kwargs).float()  # the plan is made (and kept) here
        err = ((got - want).abs().max() / want.abs().max()).item()
        if not err < 1e-2:  # a wrong variant is reported and left out, not timed
            print(f"{name}: WRONG, max error {err:.3g} of the largest value")
            continue
        plan = next(iter(gemm_bf16._PLANS.values()))
        def call(plan=plan):
            c = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            plan(a, b, c)
            return c
        fns[f"{name} (x{plan.splits})"] = call
    gemm_bf16.TMA_L2_PROMOTION_BYTES = 0
    first = {name: fn() for name, fn in fns.items() if name != "cuBLAS"}
    times = median_ms(fns, rounds)
    for name, result in first.items():  # after hundreds of calls: still right, and bit for bit the same
        again = fns[name]()
        err = ((again.float() - want).abs().max() / want.abs().max()).item()
        if not (err < 1e-2 and torch.equal(again, result)):
            print(f"{name}: WRONG after timing (max error {err:.3g}, same bits: {torch.equal(again, result)})")
    cublas = times["cuBLAS"]
    print(f"# {m} x {n} x {k} ({b_layout})")
    for name, ms in sorted(times.items(), key=lambda item: item[1]):
        print(f"{name:34s} {ms * 1e3:8.1f} us {2 * m * n * k / ms / 1e9:6.0f} TFLOP/s {cublas / ms:6.3f}x cuBLAS")


SHAPES = {
    "split": [(4096, 4096, 4096, "kn"), (1024, 1024, 1024, "kn"), (16, 4096, 4096, "nk"), (128, 4096, 14336, "nk"),
              (16, 8192, 28672, "nk"), (128, 10240, 8192, "nk"), (16, 6144, 4096, "nk")],
    "shortk": [(8192, 50304, 768, "nk"), (8192, 2304, 768, "nk"), (8192, 768, 768, "nk"), (8192, 768, 3072, "nk"),
               (12608, 3072, 1024, "nk"), (12608, 1024, 1024, "nk"), (12608, 1024, 4096, "nk")],
    "streamk": [(4096, 4096, 4096, "kn"), (4096, 4096, 4096, "nk"), (4096, 4096, 8192, "kn"), (8192, 8192, 8192, "kn"),
                (4096, 14336, 4096, "nk"), (4000, 4104, 4040, "kn"), (6144, 4096, 4096, "nk"), (2048, 8192, 4096, "nk")],
    "llm": [(4096, 6144, 4096, "nk"), (4096, 28672, 4096, "nk"), (4096, 4096, 14336, "nk"), (4096, 10240, 8192, "nk"),
            (4096, 8192, 8192, "nk"), (4096, 57344, 8192, "nk"), (4096, 8192, 28672, "nk"), (8192, 8192, 8192, "kn"),
            (4096, 4096, 4096, "kn")],
    "spread": [(4096, 4096, 4096, "kn"), (4096, 4096, 4096, "nk"), (8192, 8192, 8192, "kn"), (4096, 14336, 4096, "nk"),
              (2048, 8192, 4096, "nk"), (4096, 4096, 8192, "kn"), (4000, 4104, 4040, "kn"), (8192, 2304, 768, "nk"),
              (2048, 2048, 64, "kn"), (8192, 50304, 768, "nk"), (12608, 1024, 4096, "nk")],
    "narrow": [(512, 6144, 4096, "nk"), (1024, 6144, 4096, "nk"), (512, 4096, 4096, "nk"), (1024, 4096, 4096, "nk"),
               (512, 10240, 8192, "nk"), (1024, 14336, 4096, "nk"), (768, 4096, 4096, "nk"), (2048, 2048, 2048, "kn"),
               (8192, 768, 3072, "nk"), (8192, 768, 768, "nk"), (1536, 4096, 4096, "nk"), (3072, 1024, 4096, "nk"),
               (640, 3072, 768, "nk")],
    "tiles": [(4096, 4096, 4096, "kn"), (4096, 4096, 4096, "nk"), (8192, 8192, 8192, "kn"), (4096, 14336, 4096, "nk")],
    "epilogue": [(4096, 4096, 4096, "kn"), (4096, 4096, 4096, "nk"), (8192, 8192, 8192, "kn"), (2048, 2048, 2048, "kn"),
                 (4096, 14336, 4096, "nk"), (4096, 4096, 14336, "nk"), (16384, 4096, 4096, "nk")],
}

if __name__ == "__main__":
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 50
    which = sys.argv[2] if len(sys.argv) > 2 else "split"
    for shape in SHAPES[which]:
        time_shape(*shape, rounds, which)

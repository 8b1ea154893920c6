"""Device time of a linear layer with its bias and activation, y = act(x W^T + b) [+ r], on
the shapes of the Level 3 blocks (H100):

    eager          F.linear (cuBLAS, bias in its epilogue), then the activation or the residual
                   add as a second pass
    linear only    F.linear alone: the GEMM's own floor, for scale
    rung 4 / 6     kforge's CUDA GEMMs with the bias and activation in their epilogue
    triton         kforge.kernels.fused.gemm_epilogue (persistent TMA Triton GEMM, same epilogue)

Reading L2 flush before each call, every contender once per round in turn, medians of CUDA
event times (no host time: the kernels alone).

    PYTHONPATH=src python scripts/fused_linear_bench.py [ROUNDS]
"""

import sys

import kforge  # noqa: F401  (before triton)
import torch
import torch.nn.functional as F

from device_timing import median_ms
from kforge.kernels import gemm_bf16
from kforge.kernels.fused.gemm_epilogue import gemm_epilogue

EAGER_ACT = {"gelu": F.gelu, "gelu_tanh": lambda y: F.gelu(y, approximate="tanh"), "silu": F.silu,
             "none": lambda y: y}
# (rows, N, K, activation, residual, where)
SHAPES = [(16384, 4096, 1024, "gelu", False, "MLP stack layer 1"),
          (16384, 4096, 4096, "gelu", False, "MLP stack layers 2-3"),
          (16384, 1024, 4096, "none", False, "MLP stack layer 4"), (12608, 4096, 1024, "gelu", False, "ViT-L fc1"),
          (12608, 1024, 1024, "none", True, "ViT-L out proj"), (12608, 1024, 4096, "none", True, "ViT-L fc2"),
          (8192, 3072, 768, "gelu_tanh", False, "GPT-2 c_fc"), (8192, 2304, 768, "none", False, "GPT-2 c_attn"),
          (8192, 768, 768, "none", True, "GPT-2 c_proj"), (8192, 768, 3072, "none", True, "GPT-2 mlp proj")]


def time_shape(rows, n, k, activation, with_residual, where, rounds):
    x = torch.randn(rows, k, device="cuda").bfloat16()
    w = (torch.randn(n, k, device="cuda") / k**0.5).bfloat16()
    b = torch.randn(n, device="cuda").bfloat16()
    r = torch.randn(rows, n, device="cuda").bfloat16() if with_residual else None
    want = gemm_bf16.epilogue_reference(x.double() @ w.double().t(), b, activation, r)
    fns = {
        "eager": lambda: EAGER_ACT[activation](F.linear(x, w, b)) + (r if with_residual else 0),
        "linear only": lambda: F.linear(x, w, b),
        "rung 4": lambda: gemm_bf16.gemm(x, w, 4, b_layout="nk", bias=b, activation=activation, residual=r),
        "rung 6": lambda: gemm_bf16.gemm(x, w, 6, b_layout="nk", bias=b, activation=activation, residual=r),
        "triton": lambda: gemm_epilogue(x, w, bias=b, activation=activation, residual=r),
    }
    if not with_residual:  # eager's "+ 0" would be one more pass
        fns["eager"] = lambda: EAGER_ACT[activation](F.linear(x, w, b))
    for name, fn in fns.items():
        if name == "linear only":
            continue
        err = ((fn().double() - want).abs() / (1 + want.abs())).max().item()
        assert err < 2e-2, (name, err)
    times = median_ms(fns, rounds)
    eager = times["eager"]
    print(f"# {where}: {rows} x {n} x {k}, bias + {activation}{' + residual' if with_residual else ''}")
    for name, ms in sorted(times.items(), key=lambda item: item[1]):
        print(f"{name:14s} {ms * 1e3:8.1f} us {2 * rows * n * k / ms / 1e9:6.0f} TFLOP/s {eager / ms:6.3f}x eager")


if __name__ == "__main__":
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    for shape in SHAPES:
        time_shape(*shape, rounds)

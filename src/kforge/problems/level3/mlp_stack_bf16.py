"""A stack of LAYERS Linear layers with GELU between them, bf16, as nn.Sequential runs it:

    x (ROWS, IN) -> Linear(IN, HIDDEN) -> GELU -> Linear(HIDDEN, HIDDEN) -> GELU -> ...
                 -> Linear(HIDDEN, OUT)

A transformer-width token MLP stacked deeper (or a recommender's top MLP): 16384 rows,
1024 -> 4096 -> 4096 -> 4096 -> 1024, biases everywhere, GELU exact (erf). Weights normal
with std sqrt(2 / fan_in) (He's init: GELU halves the variance it is given) and biases
0.1 N(0, 1), so activations stay about unit-scale through the stack.

Work: 2 * 16384 * 41.9M weights = 1.37 TFLOP, ~1.7 ms at ~790 TFLOP/s. Eager runs each
Linear as one cuBLAS GEMM with the bias fused, then GELU as a separate pass over the
(16384, 4096) activation, 2 x 134 MB, three times: ~0.27 ms at ~3 TB/s, the part a GEMM
with GELU in its epilogue does not pay. Minimum bytes: the weights (84 MB), x read and the
output written (2 x 34 MB). Memory: ~0.6 GB.
"""

import torch
from torch import nn

ROWS = 16384
IN, HIDDEN, OUT, LAYERS = 1024, 4096, 1024, 4

tags = ["level3", "bf16", "mlp", "gemm"]
compute_dtype = "bf16"
tiny_sizes = {"ROWS": 13, "IN": 64, "HIDDEN": 128, "OUT": 64}
# Each layer's output ~N(0, 1); eager rounds the GEMM output before GELU, a fused epilogue
# after it, and the difference compounds through four layers' sums: sigma ~ 0.0046 of
# (1 + |out|), max 0.025 over 1.3e5 elements (CPU, 256 rows, widths 256-1024); the full
# size checks 8e7: tails near 0.035.
tolerance = {"atol": 4e-2, "rtol": 4e-2}


def _widths() -> list[int]:
    return [IN] + [HIDDEN] * (LAYERS - 1) + [OUT]


def _weights() -> int:
    widths = _widths()
    return sum(a * b for a, b in zip(widths, widths[1:]))


def flops(inputs):
    return 2 * inputs[0].shape[0] * _weights()


def bytes_moved(inputs):
    rows = inputs[0].shape[0]
    return 2 * (_weights() + sum(_widths()[1:]) + rows * (IN + OUT))


class Model(nn.Module):
    def __init__(self, in_features: int, hidden: int, out_features: int, layers: int):
        super().__init__()
        widths = [in_features] + [hidden] * (layers - 1) + [out_features]
        stack = []
        for i in range(layers):
            linear = nn.Linear(widths[i], widths[i + 1], dtype=torch.bfloat16)
            with torch.no_grad():
                linear.weight.normal_(std=(2 / widths[i]) ** 0.5)
                linear.bias.copy_(0.1 * torch.randn(widths[i + 1]))
            stack.append(linear)
            if i < layers - 1:
                stack.append(nn.GELU())
        self.net = nn.Sequential(*stack)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def get_inputs():
    return [torch.randn(ROWS, IN).to(torch.bfloat16)]


def get_init_inputs():
    return [IN, HIDDEN, OUT, LAYERS]

"""A ViT-L/16 encoder block, bf16, as torchvision's EncoderBlock writes it: pre-LayerNorm,
nn.MultiheadAttention (non-causal, biased in/out projections), a GELU MLP, two residuals.

    h   = x + MHA(LN1(x))                         16 heads of 64, need_weights=False
    out = h + fc2(gelu(fc1(LN2(h))))              GELU exact (erf), MLP 4096

x is (BATCH, TOKENS, HIDDEN) = 64 images of 196 patches + the class token, hidden 1024.
Weights normal with std 1/sqrt(fan_in), biases 0.1 N(0, 1), LayerNorm weights 1 + 0.1 N(0, 1)
and biases 0.1 N(0, 1) (a trained model's are not 1 and 0; neither should a test's be).

Work: 2 * tokens * 12.6M weights = 0.32 TFLOP in the projections (12608 tokens), attention
4 B H N^2 d = 0.01 TFLOP; at K = 1024 the GEMMs are short, so the elementwise traffic
around them weighs: eager's GELU pass (2 x 103 MB), two residual adds, the two LayerNorms,
and nn.MultiheadAttention's transposes of q, k, v and the output (copies in the seq-first
layout it works in). ~0.6 ms in all at ~790 TFLOP/s and ~3 TB/s. Minimum bytes: weights
(25 MB), x read and out written (2 x 26 MB). Memory: ~0.5 GB.
"""

import torch
import torch.nn.functional as F
from torch import nn

BATCH, TOKENS = 64, 197
HIDDEN, HEADS, MLP = 1024, 16, 4096
EPS = 1e-6

tags = ["level3", "bf16", "vit", "attention", "gemm", "norm"]
compute_dtype = "bf16"
tiny_sizes = {"BATCH": 2, "TOKENS": 13, "HIDDEN": 64, "HEADS": 4, "MLP": 128}
# out ~ N(0, 1.3); eager rounds after each projection and GELU, a fused solution once per
# epilogue (and attention's probabilities in bf16): sigma ~ 0.0024 of (1 + |out|) between
# them, max 0.017 over 2e5 elements (CPU, 394 tokens, hidden 256); the full size checks 6e7.
tolerance = {"atol": 3e-2, "rtol": 3e-2}


def _weights() -> int:
    return 4 * HIDDEN * HIDDEN + 2 * HIDDEN * MLP


def flops(inputs):
    batch, tokens, _ = inputs[0].shape
    return 2 * batch * tokens * _weights() + 4 * batch * HEADS * tokens * tokens * (HIDDEN // HEADS)


def bytes_moved(inputs):
    x = inputs[0]
    return 2 * (_weights() + 9 * HIDDEN + MLP) + 2 * x.numel() * x.element_size()


def init_like_trained(module: nn.Module) -> None:
    """Matrices normal with std 1/sqrt(fan_in); norm weights 1 + 0.1 N(0, 1); biases 0.1 N(0, 1)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 2:
                p.normal_(std=p.shape[1] ** -0.5)
            elif name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape))
            else:
                p.copy_(0.1 * torch.randn(p.shape))


class Model(nn.Module):
    def __init__(self, hidden: int, heads: int, mlp: int, eps: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden, eps=eps, dtype=torch.bfloat16)
        self.attn = nn.MultiheadAttention(hidden, heads, batch_first=True, dtype=torch.bfloat16)
        self.norm2 = nn.LayerNorm(hidden, eps=eps, dtype=torch.bfloat16)
        self.fc1 = nn.Linear(hidden, mlp, dtype=torch.bfloat16)
        self.fc2 = nn.Linear(mlp, hidden, dtype=torch.bfloat16)
        init_like_trained(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        attn, _ = self.attn(h, h, h, need_weights=False)
        x = x + attn
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


def get_inputs():
    return [torch.randn(BATCH, TOKENS, HIDDEN).to(torch.bfloat16)]


def get_init_inputs():
    return [HIDDEN, HEADS, MLP, EPS]

"""A small GPT, bf16, as nanoGPT writes it: token and position embeddings, LAYERS GPT-2
blocks (pre-LayerNorm, causal SDPA over 12 heads of 64, a tanh-GELU MLP of 4x width,
biases everywhere, two residuals), the final LayerNorm, and the LM head tied to the token
embedding; logits for every position out.

    x = wte[idx] + wpe[0 .. SEQ-1]
    per block:  x = x + c_proj(SDPA_causal(split(c_attn(LN1(x)))));  x = x + proj(gelu_tanh(fc(LN2(x))))
    logits = LN_f(x) wte^T                                          (BATCH, SEQ, VOCAB)

GPT-2 small's widths (768, 12 heads, context 1024) with 4 of its 12 layers and nanoGPT's
vocabulary of 50304 (GPT-2's 50257 padded to a multiple of 64), 8 sequences of 1024.
Weights as GPT-2 initializes them (normal, std 0.02; the residual projections 0.02 /
sqrt(2 LAYERS)), biases 0.02 N(0, 1), LayerNorm weights 1 + 0.1 N(0, 1) and biases
0.1 N(0, 1), so every term of the block is exercised.

Work: the LM head is 2 * 8192 * 768 * 50304 = 0.63 TFLOP, the blocks 24 * 8192 * 768^2 =
0.12 TFLOP each, causal attention 0.013 each: ~1.15 TFLOP, ~1.5 ms at ~790 TFLOP/s.
The GEMMs inside the blocks are short (K = 768 or 3072), so eager's elementwise passes
around them weigh ~0.2 ms more: tanh-GELU, two residual adds, two LayerNorms, SDPA's
output transposed back by a copy (cuBLAS fuses the biases). Minimum bytes:
the weights (~106 MB), the token ids, the logits written (824 MB: the output is the
largest tensor). Memory: ~1.5 GB.
"""

import torch
import torch.nn.functional as F
from torch import nn

BATCH, SEQ = 8, 1024
VOCAB, LAYERS, HIDDEN, HEADS = 50304, 4, 768, 12

tags = ["level3", "bf16", "gpt", "attention", "gemm", "norm", "lm-head"]
compute_dtype = "bf16"
tiny_sizes = {"BATCH": 2, "SEQ": 11, "VOCAB": 97, "LAYERS": 2, "HIDDEN": 64, "HEADS": 4}
# The logits are ~N(0, 0.3); eager and a fused solution round in different places and
# differ by sigma ~ 0.0017 of (1 + |logit|), max 0.008 over 2.6e5 elements (CPU, 128
# tokens, hidden 256, 2 layers); the full size checks 2e9 over five trials, and on the H100
# (2026-11-21) one trial had 2e-7 of them past 2e-2 (max 0.027, a logit of 0.016 read as
# 0.037): the same tails as the other blocks, so the same 3e-2.
tolerance = {"atol": 3e-2, "rtol": 3e-2}


def flops(inputs):
    batch, seq = inputs[0].shape
    tokens = batch * seq
    causal_attention = 2 * batch * seq * seq * HIDDEN  # half of 4 B H T^2 d, H d = HIDDEN
    return LAYERS * (24 * tokens * HIDDEN * HIDDEN + causal_attention) + 2 * tokens * HIDDEN * VOCAB


def bytes_moved(inputs):
    idx = inputs[0]
    weights = (VOCAB + SEQ) * HIDDEN + LAYERS * (12 * HIDDEN * HIDDEN + 13 * HIDDEN) + 2 * HIDDEN
    return 2 * weights + idx.numel() * (idx.element_size() + 2 * VOCAB)


def _linear(in_features: int, out_features: int, std: float) -> nn.Linear:
    layer = nn.Linear(in_features, out_features, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.normal_(std=std)
        layer.bias.copy_(0.02 * torch.randn(out_features))
    return layer


def _layer_norm(hidden: int) -> nn.LayerNorm:
    norm = nn.LayerNorm(hidden, dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(hidden))
        norm.bias.copy_(0.1 * torch.randn(hidden))
    return norm


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, layers: int):
        super().__init__()
        self.heads = heads
        self.ln_1 = _layer_norm(hidden)
        self.c_attn = _linear(hidden, 3 * hidden, 0.02)
        self.c_proj = _linear(hidden, hidden, 0.02 / (2 * layers) ** 0.5)
        self.ln_2 = _layer_norm(hidden)
        self.c_fc = _linear(hidden, 4 * hidden, 0.02)
        self.mlp_proj = _linear(4 * hidden, hidden, 0.02 / (2 * layers) ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(hidden, dim=2)
        q, k, v = (t.view(batch, seq, self.heads, hidden // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(batch, seq, hidden))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class Model(nn.Module):
    def __init__(self, vocab: int, max_seq: int, layers: int, hidden: int, heads: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden, dtype=torch.bfloat16)
        self.wpe = nn.Embedding(max_seq, hidden, dtype=torch.bfloat16)
        with torch.no_grad():
            self.wte.weight.normal_(std=0.02)
            self.wpe.weight.normal_(std=0.02)
        self.blocks = nn.ModuleList(Block(hidden, heads, layers) for _ in range(layers))
        self.ln_f = _layer_norm(hidden)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)  # the LM head, tied to the token embedding


def get_inputs():
    return [torch.randint(0, VOCAB, (BATCH, SEQ))]


def get_init_inputs():
    return [VOCAB, SEQ, LAYERS, HIDDEN, HEADS]

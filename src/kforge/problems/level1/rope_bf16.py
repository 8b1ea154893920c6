"""Rotary position embedding applied in place to q and k in bf16, from each token's position
and a cached cos/sin table (fp32, one row per position). HALF_SPLIT=1 pairs dim i with
i + D/2 (GPT-NeoX, Hugging Face Llama); 0 pairs 2i with 2i + 1 (GPT-J, Meta's Llama).
The reference is the eager Hugging Face way: gather the rows, rotate in fp32, copy back.

Memory-bound: q and k read and written once each, plus one table row per token. At
TOKENS = 16384, Llama-3-8B's 32 query and 8 KV heads of 128: 336 MB of q/k traffic.
"""

import torch
from torch import nn

TOKENS, Q_HEADS, KV_HEADS, HEAD_DIM = 16384, 32, 8, 128
MAX_POSITION, BASE = 8192, 500000.0  # Llama-3's rope theta
HALF_SPLIT = 1

tags = ["serving", "level1", "bf16", "rope"]
tiny_sizes = {"TOKENS": 37, "Q_HEADS": 4, "KV_HEADS": 2, "HEAD_DIM": 32, "MAX_POSITION": 64}
# Rotations keep |x| ~ N(0, 1): one bf16 step near 1 is 2^-7; fp32 angles of large
# positions differ from float64 ones by ~1e-4 rad.
tolerance = {"atol": 2e-2, "rtol": 2e-2}


def cos_sin_table(device=None):
    inv_freq = BASE ** (-torch.arange(0, HEAD_DIM, 2, dtype=torch.float64, device=device) / HEAD_DIM)
    angles = torch.arange(MAX_POSITION, dtype=torch.float64, device=device)[:, None] * inv_freq
    return torch.cat((angles.cos(), angles.sin()), dim=1).float()


def bytes_moved(inputs):
    q, k, positions = inputs
    qk = (q.numel() + k.numel()) * q.element_size()
    return 2 * qk + positions.numel() * (positions.element_size() + HEAD_DIM * 4)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("cos_sin", cos_sin_table())

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        cos, sin = self.cos_sin[positions].chunk(2, dim=-1)  # (tokens, HEAD_DIM / 2) each
        cos, sin = cos[:, None, :], sin[:, None, :]
        for x in (q, k):
            if HALF_SPLIT:
                x1, x2 = x.float().chunk(2, dim=-1)
                x.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))
            else:
                pairs = x.float().unflatten(-1, (-1, 2))
                x1, x2 = pairs[..., 0], pairs[..., 1]
                x.copy_(torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2))
        return q, k


def get_inputs():
    q = torch.randn(TOKENS, Q_HEADS, HEAD_DIM).to(torch.bfloat16)
    k = torch.randn(TOKENS, KV_HEADS, HEAD_DIM).to(torch.bfloat16)
    return [q, k, torch.randint(0, MAX_POSITION, (TOKENS,))]


def get_init_inputs():
    return []

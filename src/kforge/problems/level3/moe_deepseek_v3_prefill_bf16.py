"""A DeepSeek-V3 mixture-of-experts layer at prefill, bf16, as Hugging Face's DeepseekV3MoE runs it
in eager PyTorch: a sigmoid router with a selection bias and a group limit picks TOP_K of EXPERTS
SwiGLU experts per token, a Python loop visits each expert with its tokens, and one shared
expert sees every token.

    logits = x Wg^T in fp32;  s = sigmoid(logits), evaluated in float64 and rounded to fp32
    k = s + bias;  group score = sum of a group's two largest k;  keep TOPK_GROUP of N_GROUP groups
    ids = top-TOP_K of k within the kept groups;  w = s[ids] / sum(s[ids]) * SCALING
    y = sum_j w_j FFN_{ids_j}(x) (fp32 sum, rounded to bf16) + FFN_shared(x)

The sigmoid is evaluated in float64 so that the affinities, and with them the chosen experts,
are the same bits on every implementation (fp32 sigmoids differ by an ulp between libraries
and flip near-ties; kernels/moe/gating.py); experts masked out by the group limit rank at -inf.

Sizes: DeepSeek-V3's (hidden 7168, expert width 2048, 256 routed experts, top-8 in 4 of 8
groups, routed scaling 2.5, one shared expert), TOKENS = 8192 (a prefill chunk; the decode file
takes 64). Weights normal with std 1/sqrt(fan_in); the bias N(0, 0.05^2), enough to move choices.

Work: 6 * TOKENS * 9 * 7168 * 2048 = 6.5 TFLOP in the experts plus the router's 30 GFLOP: ~10
ms at ~650 TFLOP/s; every expert receives ~256 rows, so all 22.6 GB of expert weights are read:
~7.5 ms at 3 TB/s. Eager runs 257 iterations of gathers, three GEMMs of ~256 rows, a host sync
(torch.where) and an index_add_. Memory: 22.6 GB of weights per copy of the layer (the reference
and a solution hold one each), ~1 GB of activations.
"""

import torch
import torch.nn.functional as F
from torch import nn

TOKENS = 8192
HIDDEN, INTER, EXPERTS, TOP_K, N_GROUP, TOPK_GROUP, SHARED = 7168, 2048, 256, 8, 8, 4, 1
SCALING = 2.5

tags = ["level3", "bf16", "moe", "gemm", "deepseek", "prefill"]
compute_dtype = "bf16"
tiny_sizes = {"TOKENS": 37, "HIDDEN": 64, "INTER": 32, "EXPERTS": 16, "TOP_K": 4, "N_GROUP": 4, "TOPK_GROUP": 2}
# y ~ N(0, ~2): eager rounds every projection, silu, product and expert output to bf16 and adds
# the shared expert in bf16, a fused solution rounds h and the down projection once each: about
# one bf16 step of |y| apart. The routing must match exactly (one token sent elsewhere is off by
# its whole output).
tolerance = {"atol": 4e-2, "rtol": 3e-2}


def flops(inputs):
    tokens = inputs[0].numel() // HIDDEN
    return 2 * tokens * HIDDEN * EXPERTS + 6 * tokens * (TOP_K + SHARED) * HIDDEN * INTER


def bytes_moved(inputs):
    x = inputs[0]
    weights = (EXPERTS + SHARED) * 3 * HIDDEN * INTER + EXPERTS * HIDDEN
    return 2 * weights + 4 * EXPERTS + 2 * x.numel() * x.element_size()


def _linear(in_features: int, out_features: int) -> nn.Linear:
    layer = nn.Linear(in_features, out_features, bias=False, dtype=torch.bfloat16)
    nn.init.normal_(layer.weight, std=in_features**-0.5)
    return layer


class Expert(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = _linear(hidden, inter), _linear(hidden, inter), \
            _linear(inter, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Model(nn.Module):
    def __init__(self, hidden: int, inter: int, experts: int, top_k: int, n_group: int, topk_group: int,
                 shared: int, scaling: float):
        super().__init__()
        self.top_k, self.n_group, self.topk_group, self.scaling = top_k, n_group, topk_group, scaling
        self.gate = _linear(hidden, experts)
        self.register_buffer("e_score_correction_bias", torch.randn(experts) * 0.05)
        self.experts = nn.ModuleList(Expert(hidden, inter) for _ in range(experts))
        self.shared_experts = Expert(hidden, inter * shared)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.gate.weight.float())
        scores = (1.0 / (1.0 + torch.exp(-logits.double()))).float()
        choice = scores + self.e_score_correction_bias
        tokens, experts = choice.shape
        group_scores = choice.view(tokens, self.n_group, -1).topk(2, dim=-1).values.sum(-1)
        groups = group_scores.topk(self.topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        expert_mask = group_mask.repeat_interleave(experts // self.n_group, dim=1)
        ids = choice.masked_fill(~expert_mask, float("-inf")).topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        return ids, weights / weights.sum(-1, keepdim=True) * self.scaling

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.view(-1, shape[-1])
        ids, weights = self.route(x)
        routed = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        expert_mask = F.one_hot(ids, num_classes=len(self.experts)).permute(2, 0, 1)  # (experts, tokens, top_k)
        for index, expert in enumerate(self.experts):
            token, slot = torch.where(expert_mask[index])
            if token.numel():
                routed.index_add_(0, token, expert(x[token]) * weights[token, slot, None])
        return (routed.to(x.dtype) + self.shared_experts(x)).view(shape)


def get_inputs():
    return [torch.randn(TOKENS, HIDDEN).to(torch.bfloat16)]


def get_init_inputs():
    return [HIDDEN, INTER, EXPERTS, TOP_K, N_GROUP, TOPK_GROUP, SHARED, SCALING]

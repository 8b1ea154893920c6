"""A Mixtral-8x7B mixture-of-experts feed-forward layer, bf16, as Hugging Face's
MixtralSparseMoeBlock runs it in eager PyTorch: a router picks TOP_K of EXPERTS SwiGLU
experts per token, and a Python loop visits each expert with the tokens routed to it.

    logits = x Wg^T;  p = softmax(logits) in fp32;  (w, e) = top-2 of p;  w = w / sum(w), in bf16
    for expert i: rows routed to i -> W2_i (silu(W1_i x) * (W3_i x)) * w  -> index_add_ into y

x is (BATCH, SEQ, HIDDEN) = a 2048-token prefill chunk (4 x 512); HIDDEN 4096, expert MLP
14336, 8 experts, top 2 (Mixtral-8x7B's widths, full size). Weights normal with std
1/sqrt(fan_in), so activations stay unit-scale and the router's logits are ~N(0, 1).

Work: 6 * tokens * TOP_K * HIDDEN * MLP = 1.44 TFLOP in the experts (the router's 0.07
GFLOP aside), over 2.8 GB of expert weights: ~1.8 ms at ~790 TFLOP/s, and every weight
read once is ~0.95 ms at ~3 TB/s, so the experts are compute-bound if their GEMMs are
large, which in the loop they are not: ~512 rows an expert, three cuBLAS calls each with
a partial last wave, plus eager's silu, product, weighting, gathers and index_add_, and a
host sync per expert (torch.where). Minimum bytes: the expert and router weights read
once, x read and y written. Memory: 2.8 GB of weights, ~0.3 GB of activations.
"""

import torch
import torch.nn.functional as F
from torch import nn

BATCH, SEQ = 4, 512
HIDDEN, MLP, EXPERTS, TOP_K = 4096, 14336, 8, 2

tags = ["level3", "bf16", "moe", "gemm", "mixtral"]
compute_dtype = "bf16"
tiny_sizes = {"BATCH": 2, "SEQ": 11, "HIDDEN": 64, "MLP": 128, "EXPERTS": 4}
# y ~ N(0, 0.5); eager rounds each expert's projections, silu, product and weighted output
# to bf16 and accumulates the top-2 in bf16, a fused solution fewer times: sigma ~ 0.0018
# of (1 + |y|) between them, max 0.012 over 1e5 elements (CPU, 200 tokens, hidden 256, 8
# experts); the full size checks 4e7. The routing itself must match exactly (a solution
# computes it as eager does): one token sent elsewhere would be off by its whole size.
tolerance = {"atol": 3e-2, "rtol": 3e-2}


def flops(inputs):
    tokens = inputs[0].numel() // HIDDEN
    return 2 * tokens * HIDDEN * EXPERTS + 6 * tokens * TOP_K * HIDDEN * MLP


def bytes_moved(inputs):
    x = inputs[0]
    return 2 * (EXPERTS * 3 * HIDDEN * MLP + EXPERTS * HIDDEN) + 2 * x.numel() * x.element_size()


def _linear(in_features: int, out_features: int) -> nn.Linear:
    layer = nn.Linear(in_features, out_features, bias=False, dtype=torch.bfloat16)
    nn.init.normal_(layer.weight, std=in_features**-0.5)
    return layer


class Expert(nn.Module):
    def __init__(self, hidden: int, mlp: int):
        super().__init__()
        self.w1, self.w2, self.w3 = _linear(hidden, mlp), _linear(mlp, hidden), _linear(hidden, mlp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Model(nn.Module):
    def __init__(self, hidden: int, mlp: int, experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.gate = _linear(hidden, experts)
        self.experts = nn.ModuleList(Expert(hidden, mlp) for _ in range(experts))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = hidden_states.shape
        x = hidden_states.view(-1, hidden)
        routing_weights = F.softmax(self.gate(x), dim=1, dtype=torch.float)
        routing_weights, selected = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(x.dtype)

        out = torch.zeros_like(x)
        expert_mask = F.one_hot(selected, num_classes=len(self.experts)).permute(2, 1, 0)  # (experts, top_k, tokens)
        for index, expert in enumerate(self.experts):
            slot, token = torch.where(expert_mask[index])
            y = expert(x[token]) * routing_weights[token, slot, None]
            out.index_add_(0, token, y.to(x.dtype))
        return out.view(batch, seq, hidden)


def get_inputs():
    return [torch.randn(BATCH, SEQ, HIDDEN).to(torch.bfloat16)]


def get_init_inputs():
    return [HIDDEN, MLP, EXPERTS, TOP_K]

"""DeepSeek-V3's mixture-of-experts layer in bf16 against the best PyTorch composition of it: torch
routing, a sort by expert, torch._grouped_mm for the routed experts' two projections, an index_add
combine, the shared expert as two dense GEMMs. TOKENS = 64 is decode (a batch of 64 sequences),
8192 a prefill chunk.

For token x_t (hidden H), E routed experts of width I and one shared expert (SwiGLU MLPs):

    logits = x Wg^T in fp32;  s = sigmoid(logits), evaluated in float64 and rounded to fp32
    k = s + bias;  group score = sum of a group's two largest k;  keep TOPK_GROUP of N_GROUP groups
    ids = top-TOP_K of k within the kept groups;  w = s[ids] / sum(s[ids]) * SCALING
    y_t = sum_j w_tj FFN_{ids_tj}(x_t) + FFN_shared(x_t),  FFN_e(v) = W2_e (silu(W_gate_e v) * (W_up_e v))

The routing is problems/level3/moe_deepseek_v3_prefill_bf16.py's (so the ids are the ones kforge's
router computes, bit for bit, but for exact fp32 ties). The composition runs in five stages, the
functions below, which `kforge bench moe` also times one by one: `route`; `dispatch` (a stable
argsort of the expert ids, counts by scatter_add, their cumsum as _grouped_mm's offsets, a gather of
each assignment's token: no host sync anywhere); `gate_up` (a grouped GEMM over the 2I rows of
[W_gate; W_up] per expert, silu * up; the shared expert's as one dense GEMM); `down` (the grouped GEMM
and the shared expert's dense one); `combine` (the weighted rows index_add-ed into fp32 per token,
rounded to bf16, plus the shared expert's output).

Inputs: x (T, H) bf16, the router's weight (E, H) bf16 and selection bias (E,) fp32. The experts are
the Model's: w13 (E + 1, 2I, H) as [W_gate_e; W_up_e], w2 (E + 1, H, I), the shared expert last, as
`kernels/moe/deepseek.moe_layer` takes them; 22.6 GB at DeepSeek-V3's sizes, one copy for the
reference and one for the candidate (45 GB on the GPU). Weights normal with std 1/sqrt(fan_in).

FLOPs: 2 T E H in the router, 6 T (TOP_K + 1) H I in the experts (6.5 TFLOP at 8192 tokens, 51
GFLOP at 64). Minimum bytes: the weights of the experts these inputs route to, counted on them
(at 64 tokens ~222 of 256 routed experts and the shared one, ~19.6 GB: memory-bound, ~6.5 ms at 3
TB/s; at 8192 all 257), the router's weight, x and y.
"""

import torch
import torch.nn.functional as F
from torch import nn

TOKENS = 8192
HIDDEN, INTER, EXPERTS, TOP_K, N_GROUP, TOPK_GROUP, SHARED = 7168, 2048, 256, 8, 8, 4, 1
SCALING = 2.5

tags = ["moe", "deepseek", "bf16", "bench"]
compute_dtype = "bf16"
# as_drawn: exposing draws would spread the fp32 bias over 2^-4..2^4, and the routing with it: the
# roofline counts the experts the last gate-1 draw reaches, which must be a draw like the timed ones
precision = "as_drawn"
tiny_sizes = {"TOKENS": 37, "HIDDEN": 64, "INTER": 32, "EXPERTS": 16, "TOP_K": 4, "N_GROUP": 4, "TOPK_GROUP": 2}
# as the Level 3 problem's: y ~ N(0, ~2), the composition rounds each projection and the routed sum
# to bf16, kforge's layer rounds h and the down projection once each and sums in fp32
tolerance = {"atol": 4e-2, "rtol": 3e-2}


def flops(inputs):
    tokens = inputs[0].shape[0]
    return 2 * tokens * HIDDEN * EXPERTS + 6 * tokens * (TOP_K + SHARED) * HIDDEN * INTER


def bytes_moved(inputs):
    x, gate_weight, bias = inputs
    ids, _ = route(x, gate_weight, bias)
    reached = int(torch.unique(ids).numel()) + SHARED
    return (2 * reached * 3 * HIDDEN * INTER + gate_weight.numel() * gate_weight.element_size() + 4 * bias.numel()
            + 2 * x.numel() * x.element_size())


def route(x, gate_weight, bias):
    """(ids (T, TOP_K) int64, weights (T, TOP_K) fp32): the sigmoid router with selection bias and
    group limit, as the Level 3 problem routes."""
    logits = F.linear(x.float(), gate_weight.float())
    scores = (1.0 / (1.0 + torch.exp(-logits.double()))).float()
    choice = scores + bias
    tokens, experts = choice.shape
    group_scores = choice.view(tokens, N_GROUP, -1).topk(2, dim=-1).values.sum(-1)
    groups = group_scores.topk(TOPK_GROUP, dim=-1).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
    expert_mask = group_mask.repeat_interleave(experts // N_GROUP, dim=1)
    ids = choice.masked_fill(~expert_mask, float("-inf")).topk(TOP_K, dim=-1).indices
    weights = scores.gather(1, ids)
    return ids, weights / weights.sum(-1, keepdim=True) * SCALING


def dispatch(x, ids, weights):
    """(xs (T * TOP_K, H): each assignment's token in expert order, offs (E,) int32 the end of each
    expert's rows, token (T * TOP_K,) the token of each row, w (T * TOP_K,) its weight)."""
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    token = order // ids.shape[1]
    counts = torch.zeros(EXPERTS, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    offs = counts.cumsum(0).to(torch.int32)
    return x.index_select(0, token), offs, token, weights.flatten()[order]


def gate_up(x, xs, offs, w13):
    """(h (T * TOP_K, I) of the routed experts, hs (T, I) of the shared one): silu(gate) * up."""
    gu = torch._grouped_mm(xs, w13[:EXPERTS].transpose(1, 2), offs=offs, out_dtype=torch.bfloat16)
    h = F.silu(gu[:, :INTER]) * gu[:, INTER:]
    shared = [x @ w13[EXPERTS + s].t() for s in range(SHARED)]
    return h, [F.silu(su[:, :INTER]) * su[:, INTER:] for su in shared]


def down(h, hs, offs, w2):
    """(the routed rows' outputs (T * TOP_K, H), the shared expert's (T, H))."""
    out = torch._grouped_mm(h, w2[:EXPERTS].transpose(1, 2), offs=offs, out_dtype=torch.bfloat16)
    shared = hs[0] @ w2[EXPERTS].t()
    for s in range(1, SHARED):
        shared = shared + hs[s] @ w2[EXPERTS + s].t()
    return out, shared


def combine(x, out, shared, token, w):
    """y (T, H) bf16: each token's rows weighted and summed in fp32, rounded, plus the shared expert."""
    routed = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    routed.index_add_(0, token, out.float() * w[:, None])
    return routed.to(x.dtype) + shared


class Model(nn.Module):
    def __init__(self, w13, w2, top_k, n_group, topk_group, shared, scaling):
        super().__init__()
        # the routing's constants are this file's (route, dispatch read them); the arguments are
        # for the candidate, which has no other way to learn them at a size override
        if (top_k, n_group, topk_group, shared, scaling) != (TOP_K, N_GROUP, TOPK_GROUP, SHARED, SCALING):
            raise ValueError("the router's constants are this file's: build Model from get_init_inputs()")
        self.register_buffer("w13", w13)
        self.register_buffer("w2", w2)

    def forward(self, x, gate_weight, bias):
        ids, weights = route(x, gate_weight, bias)
        xs, offs, token, w = dispatch(x, ids, weights)
        h, hs = gate_up(x, xs, offs, self.w13)
        out, shared = down(h, hs, offs, self.w2)
        return combine(x, out, shared, token, w)


def get_inputs():
    x = torch.randn(TOKENS, HIDDEN, dtype=torch.bfloat16)
    gate_weight = torch.randn(EXPERTS, HIDDEN, dtype=torch.bfloat16).mul_(HIDDEN**-0.5)
    return [x, gate_weight, torch.randn(EXPERTS) * 0.05]


def get_init_inputs():
    w13 = torch.randn(EXPERTS + SHARED, 2 * INTER, HIDDEN, dtype=torch.bfloat16).mul_(HIDDEN**-0.5)
    w2 = torch.randn(EXPERTS + SHARED, HIDDEN, INTER, dtype=torch.bfloat16).mul_(INTER**-0.5)
    return [w13, w2, TOP_K, N_GROUP, TOPK_GROUP, SHARED, SCALING]

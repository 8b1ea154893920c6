"""MoE gating: which top_k experts each token goes to, and with what weights.

Two routers, each a plain PyTorch reference (the spec) and one fused Triton kernel (one
token a program) that gives the same expert ids bit for bit and the weights to fp32
rounding.

Softmax (Mixtral): p = softmax(logits) in fp32; the experts are the top_k of p; their
weights are their p, divided by the sum of the k chosen (`renormalize`, Mixtral) or not
(`norm_topk_prob` false), times `routed_scaling_factor` (1 by default). Softmax is strictly
increasing in the logit, so the ranking by p is the ranking by logit: both sides select on
the fp32 logits, where exp's rounding can neither merge two experts into a tie nor split one.

Sigmoid with group-limited routing (DeepSeek-V3, arXiv 2412.19437, section 2.1.2):
- s_e = sigmoid(logit_e), the affinity of each expert;
- a per-expert bias b_e (`e_score_correction_bias`, adjusted during training to balance
  the load) is added for selection only: the selection key is k_e = s_e + b_e;
- with n_group > 1, the E experts form n_group groups of E / n_group consecutive ids; a
  group's score is the sum of its two largest keys; the topk_group best groups are kept
  (the paper's node-limited routing: 8 groups, a token on at most 4, each scored by its
  top_k / 4 = 2 best);
- the top_k keys among the kept groups' experts are chosen;
- weights: the chosen experts' unbiased s_e divided by their sum (`renormalize`), times
  routed_scaling_factor (2.5 in DeepSeek-V3).
s_e is evaluated in float64 and rounded once to fp32. Float64 exps (libdevice's on the GPU,
numpy's under the interpreter, PyTorch's) differ by an ulp at most, which the rounding to
fp32 erases unless the value lies within ~2^-29 relative of an fp32 rounding midpoint: the
kernel and the reference agree bit for bit, where three fp32 exps would each round their
own way and flip near-ties. The key and the group scores are then single fp32 adds,
identical everywhere.

Ties: experts (and groups) rank by key, largest first; among equal keys the lowest id wins.
torch.topk promises no order among equals, so the reference ranks with stable sorts.
The weights of the chosen experts are summed left to right in rank order and divided with
round-to-nearest on both sides, so they usually match to the bit; the tests allow fp32
rounding (the softmax's exp and sum differ by an ulp between implementations).

Shared experts (DeepSeek-V3 has one): always on, weight 1. `append_shared_experts` adds them
as the last ids of the routing (E, E + 1, ...), so one dispatch and one grouped GEMM run
them beside the routed ones, their weights stacked after the routed experts'.

Kernel limits: E <= 512 (the expert tile lives in registers), top_k <= 16 (unrolled).
Cost: one read of the logits (E values a token) and k + topk_group reductions over the
tile; tiny next to the expert GEMMs. Not measured on a GPU yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_EXPERTS = 512
MAX_TOP_K = 16
SCORINGS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class Gating:
    """How a router picks experts (see the module docstring); DeepSeek-V3 is
    Gating("sigmoid", 8, n_group=8, topk_group=4, routed_scaling_factor=2.5) with its bias."""

    scoring: str
    top_k: int
    n_group: int = 1
    topk_group: int = 1
    renormalize: bool = True
    routed_scaling_factor: float = 1.0

    @property
    def grouped(self) -> bool:
        return self.n_group > 1 and self.topk_group < self.n_group


def check_gating(logits: torch.Tensor, gate: Gating, bias: torch.Tensor | None = None) -> None:
    """Raise ValueError on a router these logits cannot take."""
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be floating point (tokens, experts); got {tuple(logits.shape)} {logits.dtype}")
    experts = logits.shape[1]
    if gate.scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {', '.join(SCORINGS)}; got {gate.scoring!r}")
    if not 1 <= gate.top_k <= experts:
        raise ValueError(f"top_k must be in [1, experts={experts}], got {gate.top_k}")
    if gate.n_group < 1 or experts % gate.n_group:
        raise ValueError(f"n_group ({gate.n_group}) must divide the experts ({experts})")
    if gate.n_group > 1:
        if gate.scoring != "sigmoid":
            raise ValueError("group-limited routing is DeepSeek-V3's: it takes sigmoid scoring")
        group_size = experts // gate.n_group
        if group_size < 2:
            raise ValueError(f"a group's score sums its two best experts: groups need >= 2 experts, got {group_size}")
        if not 1 <= gate.topk_group <= gate.n_group or gate.topk_group * group_size < gate.top_k:
            raise ValueError(f"topk_group must be in [1, n_group={gate.n_group}] and keep >= top_k experts; got "
                             f"{gate.topk_group} groups of {group_size} for top_k {gate.top_k}")
    if bias is not None:
        if gate.scoring != "sigmoid":
            raise ValueError("the selection bias (e_score_correction_bias) goes with sigmoid scoring")
        if bias.shape != (experts,) or not bias.is_floating_point() or bias.device != logits.device:
            raise ValueError(f"bias must be floating point ({experts},) on {logits.device}; got {tuple(bias.shape)} "
                             f"{bias.dtype} on {bias.device}")


# --- the reference: the spec ---------------------------------------------------------------------

def sigmoid_scores(logits: torch.Tensor) -> torch.Tensor:
    """fp32 sigmoid of the fp32 logits, evaluated in float64 and rounded once."""
    x = logits.float().double()
    return (1.0 / (1.0 + torch.exp(-x))).float()


def rank(keys: torch.Tensor, eligible: torch.Tensor | None = None) -> torch.Tensor:
    """Indices along the last dim, eligible first, each part by key largest first, equal
    keys lowest index first (two stable sorts: the second keeps the first's order)."""
    order = torch.sort(keys, dim=-1, descending=True, stable=True).indices
    if eligible is None:
        return order
    first = torch.sort(eligible.gather(-1, order).int(), dim=-1, descending=True, stable=True).indices
    return order.gather(-1, first)


def sum_in_order(w: torch.Tensor) -> torch.Tensor:
    """w[..., 0] + w[..., 1] + ... left to right, as the kernel adds them (keepdim)."""
    total = w[..., :1]
    for j in range(1, w.shape[-1]):
        total = total + w[..., j:j + 1]
    return total


def gating_reference(logits: torch.Tensor, gate: Gating,
                     bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids int32, topk_weights fp32), both (tokens, top_k), in rank order."""
    check_gating(logits, gate, bias)
    tokens, experts = logits.shape
    x = logits.float()
    if gate.scoring == "softmax":
        scores, keys = torch.softmax(x, dim=-1), x
    else:
        scores = sigmoid_scores(logits)
        keys = scores + bias.float() if bias is not None else scores
    eligible = None
    if gate.grouped:
        grouped = keys.view(tokens, gate.n_group, -1)
        best_two = grouped.gather(-1, rank(grouped)[..., :2])
        group_scores = best_two[..., 0] + best_two[..., 1]
        kept = torch.zeros(tokens, gate.n_group, dtype=torch.bool, device=logits.device)
        kept.scatter_(1, rank(group_scores)[:, :gate.topk_group], True)
        eligible = kept.repeat_interleave(experts // gate.n_group, dim=1)
    ids = rank(keys, eligible)[:, :gate.top_k]
    weights = scores.gather(1, ids)
    if gate.renormalize:
        weights = weights / sum_in_order(weights)
    return ids.int(), weights * gate.routed_scaling_factor


def append_shared_experts(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_routed: int,
                          num_shared: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing with every token also sent to the shared experts num_routed ..
    num_routed + num_shared - 1 at weight 1: (tokens, top_k + num_shared) each."""
    if num_shared < 0 or num_routed < 1:
        raise ValueError(f"num_routed must be >= 1 and num_shared >= 0; got {num_routed} and {num_shared}")
    tokens = topk_ids.shape[0]
    shared = torch.arange(num_routed, num_routed + num_shared, dtype=topk_ids.dtype, device=topk_ids.device)
    ids = torch.cat((topk_ids, shared.expand(tokens, num_shared)), dim=1)
    ones = torch.ones(tokens, num_shared, dtype=topk_weights.dtype, device=topk_weights.device)
    return ids, torch.cat((topk_weights, ones), dim=1)


# --- the kernel ----------------------------------------------------------------------------------

@triton.jit
def _pick(keys, eligible, index, NONE: tl.constexpr):
    """The eligible index with the largest key, the lowest index among equals."""
    candidates = tl.where(eligible, keys, float("-inf"))
    best = tl.max(candidates)
    return tl.min(tl.where(eligible & (candidates == best), index, NONE))


@triton.jit
def gating_kernel(logits_ptr, bias_ptr, ids_ptr, weights_ptr, stride_t, GROUP_SIZE, scale,
                  N_GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, TOP_K: tl.constexpr,
                  BLOCK_K: tl.constexpr, TOPK_GROUP: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
                  GROUPED: tl.constexpr, RENORMALIZE: tl.constexpr):
    # The token's experts as a (group, member) tile: expert = g * GROUP_SIZE + member (one
    # group of all E when not grouped), so a group's best two are a reduction along axis 1.
    t = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BLOCK_G)[:, None]
    member = tl.arange(0, BLOCK_S)[None, :]
    valid = (g < N_GROUP) & (member < GROUP_SIZE)
    expert = g * GROUP_SIZE + member
    x = tl.load(logits_ptr + t * stride_t + expert, mask=valid, other=0.0).to(tl.float32)
    if SIGMOID:
        scores = (1.0 / (1.0 + tl.exp(-x.to(tl.float64)))).to(tl.float32)
        keys = scores
        if HAS_BIAS:
            keys = scores + tl.load(bias_ptr + expert, mask=valid, other=0.0).to(tl.float32)
    else:
        shifted = tl.where(valid, x - tl.max(tl.where(valid, x, float("-inf"))), float("-inf"))
        e = tl.exp(shifted)
        scores = tl.math.div_rn(e, tl.sum(e))
        keys = x
    eligible = valid
    if GROUPED:
        masked = tl.where(valid, keys, float("-inf"))
        first = tl.max(masked, axis=1)
        first_at = tl.min(tl.where(masked == first[:, None], member, BLOCK_S), axis=1)
        second = tl.max(tl.where(member == first_at[:, None], float("-inf"), masked), axis=1)
        group_scores = first + second
        group = tl.arange(0, BLOCK_G)
        kept = group < 0
        for _ in tl.static_range(TOPK_GROUP):
            kept = kept | (group == _pick(group_scores, (group < N_GROUP) & ~kept, group, BLOCK_G))
        eligible = valid & kept[:, None]
    slot = tl.arange(0, BLOCK_K)
    chosen = tl.zeros([BLOCK_K], dtype=tl.float32)
    total = 0.0
    for j in tl.static_range(TOP_K):
        best = _pick(keys, eligible, expert, BLOCK_G * BLOCK_S)
        eligible = eligible & (expert != best)
        score = tl.max(tl.where(expert == best, scores, float("-inf")))
        tl.store(ids_ptr + t * TOP_K + j, best)
        chosen = tl.where(slot == j, score, chosen)
        total += score
    if RENORMALIZE:
        chosen = tl.math.div_rn(chosen, tl.zeros([BLOCK_K], dtype=tl.float32) + total)
    tl.store(weights_ptr + t * TOP_K + slot, chosen * scale, mask=slot < TOP_K)


def kernel_limitation(logits: torch.Tensor, gate: Gating) -> str | None:
    """Why the kernel cannot take these (checked) logits, or None."""
    if logits.shape[1] > MAX_EXPERTS:
        return f"more than {MAX_EXPERTS} experts"
    if gate.top_k > MAX_TOP_K:
        return f"top_k over {MAX_TOP_K}"
    return None


def gating_forward(logits: torch.Tensor, gate: Gating,
                   bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton router: (topk_ids int32, topk_weights fp32), (tokens, top_k), as
    `gating_reference` gives them."""
    check_gating(logits, gate, bias)
    limitation = kernel_limitation(logits, gate)
    if limitation:
        raise ValueError(f"the gating kernel takes no {limitation}")
    tokens, experts = logits.shape
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    ids = torch.empty(tokens, gate.top_k, dtype=torch.int32, device=logits.device)
    weights = torch.empty(tokens, gate.top_k, dtype=torch.float32, device=logits.device)
    if tokens == 0:
        return ids, weights
    n_group = gate.n_group if gate.grouped else 1
    group_size = experts // n_group
    # no FMA contraction: every product and sum rounds as the reference's does
    gating_kernel[(tokens,)](
        logits, bias.contiguous() if bias is not None else logits, ids, weights, logits.stride(0), group_size,
        float(gate.routed_scaling_factor), N_GROUP=n_group, BLOCK_G=triton.next_power_of_2(n_group),
        BLOCK_S=triton.next_power_of_2(group_size), TOP_K=gate.top_k,
        BLOCK_K=triton.next_power_of_2(gate.top_k), TOPK_GROUP=gate.topk_group if gate.grouped else 1,
        SIGMOID=gate.scoring == "sigmoid", HAS_BIAS=bias is not None, GROUPED=gate.grouped,
        RENORMALIZE=gate.renormalize, num_warps=1 if experts <= 256 else 2, enable_fp_fusion=False)
    return ids, weights

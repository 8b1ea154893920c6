"""MoE gating: the reference against hand-worked routings (softmax, renormalized or not;
DeepSeek-V3's sigmoid with the selection bias, the group limit and the scaling factor;
ties to the lowest id), the Triton router under the interpreter against the reference (ids
bit for bit, weights to fp32 rounding) on random, tied, masked and half-precision logits,
shared experts, refusals, and the custom op (opcheck, the CPU fallback). On a GPU:
DeepSeek-V3's router (E 256, top-8, 8 groups, top-4 groups, 4096 tokens) and a softmax one."""

from __future__ import annotations

import math

import pytest
import torch

from kforge.kernels.moe.gating import Gating, append_shared_experts, gating_forward, gating_reference
from kforge.ops.moe import moe_gate

DEEPSEEK_V3 = Gating("sigmoid", 8, n_group=8, topk_group=4, routed_scaling_factor=2.5)
WEIGHT_TOLERANCE = {"rtol": 1e-6, "atol": 1e-7}  # an ulp or two of fp32 (the softmax's exp and sum)


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _logits(tokens, experts, seed=0, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, experts, generator=g).to(dtype=dtype, device=device)


def _bias(experts, seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return (0.1 * torch.randn(experts, generator=g)).to(device)


# --- the reference: hand-worked routings ----------------------------------------------------------

# Eight experts in four groups of two. Expert 0 has the best score, but its partner's is
# poor: group 0 sums to sigmoid(3) + sigmoid(-3) = 1.0, under groups 1 (2 sigmoid(1) = 1.46)
# and 2 (2 sigmoid(0.5) = 1.24); group 3 sums to 0.76. Experts 2 and 3 tie exactly.
HAND_LOGITS = torch.tensor([[3.0, -3.0, 1.0, 1.0, 0.5, 0.5, -0.5, -0.5]])


def test_group_limit_keeps_the_best_groups_and_ties_go_to_the_lowest_id():
    ids, weights = gating_reference(HAND_LOGITS, Gating("sigmoid", 2, n_group=4, topk_group=2,
                                                        routed_scaling_factor=2.5))
    assert ids.tolist() == [[2, 3]]  # groups 1 and 2 kept: expert 0 is out; 2 and 3 tie, 2 first
    assert weights.tolist() == [[1.25, 1.25]]  # equal scores, normalized, times 2.5
    ids, _ = gating_reference(HAND_LOGITS, Gating("sigmoid", 2))  # without the group limit expert 0 leads
    assert ids.tolist() == [[0, 2]]


def test_the_bias_moves_the_selection_and_not_the_weights():
    bias = torch.zeros(8)
    bias[5] = 0.3  # expert 5's key 0.92: group 2 now sums to 1.54 and leads, expert 5 first
    ids, weights = gating_reference(HAND_LOGITS, Gating("sigmoid", 2, n_group=4, topk_group=2,
                                                        routed_scaling_factor=2.5), bias)
    assert ids.tolist() == [[5, 2]]
    s5, s2 = _sigmoid(0.5), _sigmoid(1.0)  # the unbiased scores
    assert weights[0].tolist() == pytest.approx([2.5 * s5 / (s5 + s2), 2.5 * s2 / (s5 + s2)], rel=1e-6)


def test_a_group_of_one_leader_loses_to_two_good_experts():
    # top-1 group: group 0 has the best expert (3.0) but 1.0 in all; group 1 has 2 x sigmoid(1)
    ids, _ = gating_reference(HAND_LOGITS, Gating("sigmoid", 1, n_group=4, topk_group=1))
    assert ids.tolist() == [[2]]


def test_softmax_takes_the_top_k_and_renormalizes_or_not():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [1.0, 1.0, 1.0, 0.0]])  # row 2: a three-way tie
    ids, weights = gating_reference(logits, Gating("softmax", 2))
    assert ids.tolist() == [[1, 2], [0, 1]]
    e = math.exp(1.0)
    assert weights[0].tolist() == pytest.approx([e / (e + 1), 1 / (e + 1)], rel=1e-6)
    assert weights[1].tolist() == [0.5, 0.5]
    ids, weights = gating_reference(logits, Gating("softmax", 2, renormalize=False))
    p = torch.softmax(logits, -1)
    assert torch.equal(weights, p.gather(1, ids.long()))


def test_the_reference_ranks_like_topk_on_distinct_scores():
    logits = _logits(64, 16)
    ids, weights = gating_reference(logits, Gating("softmax", 4, renormalize=False))
    top = torch.topk(torch.softmax(logits, -1), 4)
    assert torch.equal(ids.long(), top.indices) and torch.equal(weights, top.values)
    bias = _bias(16)
    ids, _ = gating_reference(logits, Gating("sigmoid", 4), bias)
    assert torch.equal(ids.long(), torch.topk(torch.sigmoid(logits.double()).float() + bias, 4).indices)


def test_masked_experts_are_picked_last_lowest_id_first():
    logits = torch.tensor([[float("-inf"), 0.5, float("-inf"), 0.1, float("-inf")]])
    ids, weights = gating_reference(logits, Gating("softmax", 3))
    assert ids.tolist() == [[1, 3, 0]] and weights[0, 2] == 0


# --- the kernel against the reference -------------------------------------------------------------

KERNEL_CASES = {
    "softmax top-2 of 8": (Gating("softmax", 2), 8, False),
    "softmax top-3 of 6, not renormalized, scaled": (Gating("softmax", 3, renormalize=False,
                                                             routed_scaling_factor=1.5), 6, False),
    "sigmoid top-4 of 16, 4 groups keep 2, bias, 2.5": (Gating("sigmoid", 4, n_group=4, topk_group=2,
                                                               routed_scaling_factor=2.5), 16, True),
    "sigmoid top-3 of 12, 3 groups of 4 keep 2, bias": (Gating("sigmoid", 3, n_group=3, topk_group=2), 12, True),
    "sigmoid top-1 of 5, no groups": (Gating("sigmoid", 1), 5, False),
    "sigmoid top-8 of 64, 8 groups keep 4 (DeepSeek-V3's shape, smaller)": (DEEPSEEK_V3, 64, True),
}


def _assert_same_routing(got, want):
    assert got[0].dtype == torch.int32 and got[1].dtype == torch.float32
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], **WEIGHT_TOLERANCE)


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_kernel_matches_the_reference(case):
    gate, experts, biased = KERNEL_CASES[case]
    logits, bias = _logits(10, experts), _bias(experts) if biased else None
    _assert_same_routing(gating_forward(logits, gate, bias), gating_reference(logits, gate, bias))


@pytest.mark.parametrize("gate", [Gating("softmax", 3), Gating("sigmoid", 4, n_group=4, topk_group=2)],
                         ids=["softmax", "sigmoid grouped"])
def test_kernel_breaks_ties_as_the_reference_does(gate):
    # logits from {-1, 0, 1}: every token has tied experts and tied groups
    g = torch.Generator().manual_seed(3)
    logits = torch.randint(-1, 2, (12, 16), generator=g).float()
    bias = torch.zeros(16) if gate.scoring == "sigmoid" else None
    _assert_same_routing(gating_forward(logits, gate, bias), gating_reference(logits, gate, bias))


def test_kernel_on_half_precision_strided_and_masked_logits():
    top2 = Gating("softmax", 2)
    for dtype in (torch.float16, torch.bfloat16):
        logits = _logits(6, 10, dtype=dtype)
        _assert_same_routing(gating_forward(logits, top2), gating_reference(logits, top2))
    wide = _logits(6, 20)
    strided = wide[:, ::2]  # a column stride of 2
    gate = Gating("sigmoid", 2, n_group=2, topk_group=1)
    _assert_same_routing(gating_forward(strided, gate), gating_reference(strided, gate))
    masked = _logits(4, 6)
    masked[:, ::2] = float("-inf")
    _assert_same_routing(gating_forward(masked, Gating("softmax", 4)), gating_reference(masked, Gating("softmax", 4)))


def test_kernel_takes_no_tokens():
    ids, weights = gating_forward(torch.empty(0, 8), Gating("softmax", 2))
    assert ids.shape == weights.shape == (0, 2)


# --- shared experts, refusals, the op -------------------------------------------------------------

def test_shared_experts_follow_the_routed_ones_at_weight_one():
    ids, weights = gating_reference(_logits(3, 8), Gating("softmax", 2))
    all_ids, all_weights = append_shared_experts(ids, weights, 8, 2)
    assert all_ids.shape == (3, 4) and all_ids.dtype == ids.dtype
    assert torch.equal(all_ids[:, :2], ids) and all_ids[:, 2:].tolist() == [[8, 9]] * 3
    assert torch.equal(all_weights[:, :2], weights) and (all_weights[:, 2:] == 1).all()


@pytest.mark.parametrize("logits, gate, bias, message", [
    (torch.zeros(4), Gating("softmax", 1), None, "tokens, experts"),
    (torch.zeros(2, 4), Gating("softmax", 5), None, "top_k"),
    (torch.zeros(2, 4), Gating("tanh", 1), None, "scoring"),
    (torch.zeros(2, 6), Gating("sigmoid", 2, n_group=4, topk_group=2), None, "must divide"),
    (torch.zeros(2, 8), Gating("softmax", 2, n_group=4, topk_group=2), None, "sigmoid"),
    (torch.zeros(2, 4), Gating("sigmoid", 1, n_group=4, topk_group=2), None, ">= 2 experts"),
    (torch.zeros(2, 8), Gating("sigmoid", 5, n_group=4, topk_group=2), None, "keep >= top_k"),
    (torch.zeros(2, 8), Gating("softmax", 2), torch.zeros(8), "sigmoid scoring"),
    (torch.zeros(2, 8), Gating("sigmoid", 2), torch.zeros(7), "bias must be"),
])
def test_refusals(logits, gate, bias, message):
    for route in (gating_reference, gating_forward):
        with pytest.raises(ValueError, match=message):
            route(logits, gate, bias)


def test_the_op_passes_opcheck_and_runs_the_reference_on_the_cpu():
    logits, bias = _logits(5, 16), _bias(16)
    got = moe_gate(logits, 4, scoring="sigmoid", bias=bias, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    want = gating_reference(logits, Gating("sigmoid", 4, 4, 2, routed_scaling_factor=2.5), bias)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    torch.library.opcheck(torch.ops.kforge.moe_gate.default, (logits, bias, "sigmoid", 4, 4, 2, True, 2.5))
    torch.library.opcheck(torch.ops.kforge.moe_gate.default, (logits, None, "softmax", 3, 1, 1, False, 1.0))
    with pytest.raises(ValueError, match="top_k"):
        moe_gate(logits, 17)


# --- on the GPU -------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_deepseek_v3_router_on_the_gpu():
    logits, bias = _logits(4096, 256, device="cuda"), _bias(256, device="cuda")
    for gate in (DEEPSEEK_V3, Gating("sigmoid", 8)):
        _assert_same_routing(gating_forward(logits, gate, bias), gating_reference(logits, gate, bias))
    got = moe_gate(logits.bfloat16(), 8, scoring="sigmoid", bias=bias, n_group=8, topk_group=4,
                   routed_scaling_factor=2.5)
    _assert_same_routing(got, gating_reference(logits.bfloat16(), DEEPSEEK_V3, bias))


@pytest.mark.gpu
def test_softmax_router_on_the_gpu():
    logits = _logits(4096, 64, device="cuda")
    for gate in (Gating("softmax", 6), Gating("softmax", 6, renormalize=False)):
        _assert_same_routing(gating_forward(logits, gate), gating_reference(logits, gate))
    g = torch.Generator().manual_seed(4)
    tied = torch.randint(-1, 2, (4096, 256), generator=g).float().cuda()
    _assert_same_routing(gating_forward(tied, DEEPSEEK_V3, torch.zeros(256, device="cuda")),
                         gating_reference(tied, DEEPSEEK_V3, torch.zeros(256, device="cuda")))

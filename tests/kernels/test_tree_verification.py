"""Tree verification (greedy, target-only, with draft probabilities): the Triton kernel under the
interpreter against the float64 reference token for token on random trees (a star, a chain, a
deep and wide tree, a root alone; vocabularies with a tail; fp32 and bf16 rows); cases by hand
(the greedy path, duplicate siblings, a draft equal to the target); the distribution: the first
emitted token follows the root's target row and the token after an accepted node follows that
node's row (chi-square), while a rule that forgets the residual fails the same test; bad
inputs; the sm_90 build of each mode."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kforge.kernels.speculative.draws import philox_uniforms
from kforge.kernels.speculative.tree import tree_verify, tree_verify_reference

# root 0 -> 1, 2, 3; node 1 -> 4, 5; node 4 -> 6
FIRST_CHILD = [1, 4, -1, -1, 6, -1, -1]
NEXT_SIBLING = [-1, 2, 3, -1, 5, -1, -1]
PARENT = [-1, 0, 0, 0, 1, 1, 4]
TREES = {
    "deep and wide": (FIRST_CHILD, NEXT_SIBLING),
    "star": ([1, -1, -1, -1, -1], [-1, 2, 3, 4, -1]),
    "chain": ([1, 2, 3, 4, -1], [-1, -1, -1, -1, -1]),
    "root alone": ([-1], [-1]),
}


def _tree(name: str, batch: int):
    first, sibling = (torch.tensor(x, dtype=torch.int32).expand(batch, -1).contiguous() for x in TREES[name])
    return first, sibling


def _random_inputs(name, batch, vocab, dtype=torch.float32, seed=0, peaked=2.0):
    g = torch.Generator().manual_seed(seed)
    first, sibling = _tree(name, batch)
    nodes = first.shape[1]
    p = torch.softmax(peaked * torch.randn(batch, nodes, vocab, generator=g), -1).to(dtype)
    q = torch.softmax(peaked * torch.randn(batch, nodes, vocab, generator=g), -1).to(dtype)
    tokens = torch.randint(vocab, (batch, nodes), generator=g, dtype=torch.int32)
    if nodes > 2:
        tokens[::2, 2] = tokens[::2, 1]  # every other request: node 2 repeats node 1's token
    return tokens, first, sibling, p, q, torch.rand(batch, nodes, generator=g)


def _run(function, tokens, first, sibling, p, q, u, mode):
    return function(tokens, first, sibling, p, None if mode == "greedy" else u,
                    draft_probs=q if mode == "draft" else None, mode=mode)


@pytest.mark.parametrize("mode", ["greedy", "target_only", "draft"])
@pytest.mark.parametrize("tree", list(TREES))
@pytest.mark.parametrize("vocab, dtype", [(37, torch.float32), (16, torch.bfloat16)])
def test_kernel_matches_reference_token_for_token(mode, tree, vocab, dtype):
    inputs = _random_inputs(tree, 48, vocab, dtype, seed=vocab)
    kernel = _run(lambda *a, **k: tree_verify(*a, **k, block_v=16), *inputs, mode)
    expected = _run(tree_verify_reference, *inputs, mode)
    for name, got, want in zip(("out_ids", "out_nodes", "emitted"), kernel, expected):
        assert torch.equal(got, want), (name, got[:4], want[:4])
    out_ids, out_nodes, emitted = kernel
    rows = torch.arange(48)
    assert (out_ids[rows, emitted.long()] >= 0).all(), "every request emits a final token"
    assert (out_nodes[rows, emitted.long()] == -1).all()
    positions = torch.arange(out_ids.shape[1])
    assert (out_ids[positions > emitted[:, None]] == -1).all(), "-1 after the final token"


def test_greedy_follows_the_argmax_path():
    first, sibling = _tree("deep and wide", 1)
    p = torch.full((1, 7, 6), 0.1)
    p[0, 0, 3], p[0, 1, 4], p[0, 4, 0], p[0, 6, 5] = 0.5, 0.5, 0.5, 0.5  # root wants 3, node 1 wants 4...
    tokens = torch.tensor([[0, 3, 3, 1, 4, 2, 0]], dtype=torch.int32)  # node 1 (first of the two 3s), 4, then 6
    out_ids, out_nodes, emitted = tree_verify(tokens, first, sibling, p, mode="greedy")
    assert out_ids.tolist() == [[3, 4, 0, 5, -1, -1, -1]] and out_nodes.tolist() == [[1, 4, 6, -1, -1, -1, -1]]
    assert emitted.tolist() == [3]  # the leaf's argmax is the final token


def test_target_only_never_accepts_a_duplicate_of_a_rejected_sibling():
    first, sibling = _tree("star", 1)
    p = torch.tensor([[[0.5, 0.5, 0.0], *[[1 / 3] * 3] * 4]])
    tokens = torch.tensor([[0, 1, 1, 1, 0]], dtype=torch.int32)
    # u = 0.6 rejects the first 1 (0.6 * 1 >= 0.5); its copies have no mass left; then token 0
    # has the whole residual (0.5 of 0.5): accepted whatever its draw
    u = torch.tensor([[0.9, 0.6, 0.0, 0.0, 0.99]])
    out_ids, out_nodes, emitted = tree_verify(tokens, first, sibling, p, u, mode="target_only")
    assert out_nodes[0, 0] == 4 and out_ids[0, 0] == 0 and emitted.tolist() == [1]


def test_a_draft_equal_to_the_target_is_always_accepted():
    tokens, first, sibling, p, _, u = _random_inputs("chain", 32, 11, seed=3)
    tokens[:, 1:] = torch.stack([torch.multinomial(p[b, :-1], 1)[:, 0] for b in range(32)]).int()  # drafted from p
    _, _, emitted = tree_verify(tokens, first, sibling, p, u, draft_probs=p, mode="draft")
    assert (emitted == 4).all()


# --- the distribution -----------------------------------------------------------------------------

def _chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    counts, probs = counts.double(), probs.double()
    if counts[probs == 0].sum() > 0:
        return 0.0
    support = probs > 0
    expected = counts.sum() * probs[support] / probs[support].sum()
    statistic = ((counts[support] - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((int(support.sum()) - 1) / 2, dtype=torch.float64),
                                         statistic / 2))


P_ROWS = torch.softmax(torch.tensor([[2.0, 1.5, 0.2, -1.0, 0.5, 0.0]]).repeat(7, 1)
                       + torch.arange(7.0)[:, None] * torch.tensor([0.3, -0.4, 0.5, 0.2, -0.6, 0.1]), -1)
Q_ROWS = torch.softmax(torch.tensor([[0.0, 2.0, 1.0, 0.5, -0.5, 1.5]]).repeat(7, 1), -1)


def _population(n, mode, seed):
    """n copies of one tree; in the draft mode each node's token drawn from its parent's q row."""
    g = torch.Generator().manual_seed(seed)
    first, sibling = _tree("deep and wide", n)
    p, q = P_ROWS.expand(n, -1, -1).contiguous(), Q_ROWS.expand(n, -1, -1).contiguous()
    if mode == "draft":
        tokens = torch.stack([torch.zeros(n, dtype=torch.long)]
                             + [torch.multinomial(Q_ROWS[PARENT[i]], n, replacement=True, generator=g)
                                for i in range(1, 7)], 1).int()
    else:
        tokens = torch.tensor([[0, 1, 0, 1, 2, 2, 5]], dtype=torch.int32).expand(n, -1).contiguous()
    return tokens, first, sibling, p, q, torch.rand(n, 7, generator=g)


def _pvalues(out_ids, out_nodes):
    found = {"first token": _chi_square_pvalue(torch.bincount(out_ids[:, 0].long(), minlength=6), P_ROWS[0])}
    for node in (1, 4):  # after an accepted node, the next token follows that node's row
        after = out_ids[:, 1][out_nodes[:, 0] == node] if node == 1 else out_ids[:, 2][out_nodes[:, 1] == node]
        found[f"after node {node}"] = _chi_square_pvalue(torch.bincount(after.long(), minlength=6), P_ROWS[node])
    return found


def _forgetful(tokens, first, sibling, p, q, u, mode):
    """A wrong rule: each child tested against p itself, the final token drawn from p: the
    residual is never updated."""
    out_ids = torch.full_like(tokens, -1)
    out_nodes = torch.full_like(tokens, -1)
    for b in range(len(tokens)):
        cur, n = 0, 0
        while True:
            child, moved = int(first[b, cur]), False
            while child >= 0:
                x = int(tokens[b, child])
                ratio = float(p[b, cur, x]) / (float(q[b, cur, x]) if mode == "draft" else 1.0)
                if float(u[b, child]) < ratio:
                    out_ids[b, n], out_nodes[b, n], n, cur, moved = x, child, n + 1, child, True
                    break
                child = int(sibling[b, child])
            if not moved:
                out_ids[b, n] = int(torch.multinomial(p[b, cur].float(), 1, generator=torch.Generator().manual_seed(b)))
                break
    return out_ids, out_nodes


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["target_only", "draft"])
def test_reference_emits_the_target_distribution_and_a_forgetful_rule_does_not(mode):
    population = _population(20_000, mode, seed=5)
    out_ids, out_nodes, _ = _run(tree_verify_reference, *population, mode)
    for name, pvalue in _pvalues(out_ids, out_nodes).items():
        assert pvalue > 1e-4, f"{mode}, {name}: p = {pvalue:.2e}"
    wrong = _pvalues(*_forgetful(*population, mode))
    assert wrong["first token"] < 1e-9, wrong


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["target_only", "draft"])
def test_kernel_emits_the_target_distribution(mode):
    population = _population(800, mode, seed=6)  # ~20 s under the interpreter; the rule is checked at 20k above
    out_ids, out_nodes, _ = _run(lambda *a, **k: tree_verify(*a, **k, block_v=16), *population, mode)
    pvalue = _chi_square_pvalue(torch.bincount(out_ids[:, 0].long(), minlength=6), P_ROWS[0])
    assert pvalue > 1e-4, f"first token: p = {pvalue:.2e}"


@pytest.mark.parametrize("mode", ["target_only", "draft"])
def test_seeded_kernel_matches_the_reference_on_the_same_philox_draws(mode):
    # the draws made in the kernel from (seed, offset) are philox_uniforms's, counter by counter
    tokens, first, sibling, p, q, _ = _random_inputs("deep and wide", 12, 37, seed=8)
    seed, offset = 2**40 + 17, 2**32 - 40  # a 64-bit key; counters that cross 2^32 inside the batch
    got = tree_verify(tokens, first, sibling, p, draft_probs=q if mode == "draft" else None, mode=mode, seed=seed,
                      offset=offset, block_v=16)
    expected = _run(tree_verify_reference, tokens, first, sibling, p, q, philox_uniforms(seed, offset, (12, 7)), mode)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    other = tree_verify(tokens, first, sibling, p, draft_probs=q if mode == "draft" else None, mode=mode, seed=seed,
                        offset=offset + 12 * 7, block_v=16)
    assert not torch.equal(other[0], got[0]), "the next step's counters draw afresh"
    in_memory = tree_verify(tokens, first, sibling, p, draft_probs=q if mode == "draft" else None, mode=mode,
                            seed=torch.tensor([seed, offset]), block_v=16)  # read as the kernel runs
    for a, b in zip(in_memory, got):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_seeded_kernel_emits_the_target_distribution():
    population = _population(800, "draft", seed=6)
    tokens, first, sibling, p, q, _ = population
    out_ids, _, _ = tree_verify(tokens, first, sibling, p, draft_probs=q, mode="draft", seed=31, block_v=16)
    pvalue = _chi_square_pvalue(torch.bincount(out_ids[:, 0].long(), minlength=6), P_ROWS[0])
    assert pvalue > 1e-4, f"first token: p = {pvalue:.2e}"


# --- bad inputs ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("change, message", [
    (lambda i: {**i, "mode": "beam"}, "mode must be one of"),
    (lambda i: {**i, "uniforms": None}, "need uniforms float32 .* or a seed"),
    (lambda i: {**i, "seed": 3}, "as uniforms or as a seed"),
    (lambda i: {**i, "uniforms": None, "seed": -1}, r"seed must be an integer in \[0, 2\^63\)"),
    (lambda i: {**i, "mode": "draft", "draft_probs": None}, "needs draft_probs"),
    (lambda i: {**i, "first_child": i["first_child"].long()}, "first_child must be int32"),
    (lambda i: {**i, "first_child": torch.where(i["first_child"] == 4, 0, i["first_child"])},
     r"first_child\[0, 1\] = 0: a link must be -1 or a later node"),
    (lambda i: {**i, "tokens": i["tokens"] + 40}, r"tokens must lie in \[0, 37\)"),
    (lambda i: {**i, "target_probs": i["target_probs"].double()}, "float32, float16 or bfloat16"),
])
def test_bad_inputs_are_refused(change, message):
    tokens, first, sibling, p, q, u = _random_inputs("deep and wide", 2, 37)
    inputs = dict(tokens=tokens, first_child=first, next_sibling=sibling, target_probs=p, uniforms=u,
                  draft_probs=q, mode="target_only")
    inputs = change(inputs)
    with pytest.raises(ValueError, match=message):
        tree_verify(inputs.pop("tokens"), inputs.pop("first_child"), inputs.pop("next_sibling"),
                    inputs.pop("target_probs"), inputs.pop("uniforms"), **inputs)


# --- the sm_90 build ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_every_mode_compiles_for_the_h100_without_spills():
    sys.path.insert(0, str(Path(__file__).parent))
    from triton_sm90 import compile_sm90, spec

    types = {"tokens_ptr": "*i32", "first_child_ptr": "*i32", "next_sibling_ptr": "*i32", "target_ptr": "*fp32",
             "draft_ptr": "*fp32", "uniforms_ptr": "*fp32", "out_ids_ptr": "*i32", "out_nodes_ptr": "*i32",
             "emitted_ptr": "*i32", **{name: "i32" for name in ("stride_nb", "stride_tb", "stride_tn", "stride_db",
                                                                 "stride_dn", "stride_ub", "stride_ob", "N", "V")},
             "seed": "i64", "offset": "i64", "seed_ptr": "*i64"}
    found = compile_sm90([spec(f"mode {mode}{' seeded' if seeded else ''}{' from a tensor' if in_memory else ''}",
                               "kforge.kernels.speculative.tree", "tree_verify_kernel", types,
                               {"MODE": mode, "BLOCK_N": 64, "BLOCK_V": 1024, "SEEDED": seeded,
                                "SEED_IN_MEMORY": in_memory}, num_warps=4, num_stages=1)
                          for mode, seeded, in_memory in ((0, False, False), (1, False, False), (2, False, False),
                                                          (1, True, False), (2, True, False), (2, True, True))])
    assert len(found) == 6
    for label, used in found.items():
        assert used["spills"] == 0 and used["local"] == 0, (label, used)



@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["greedy", "target_only", "draft"])
def test_gpu_kernel_matches_reference_at_a_real_vocabulary(mode):
    tokens, first, sibling, p, q, u = _random_inputs("deep and wide", 64, 128_256, seed=9, peaked=4.0)
    kernel = _run(tree_verify, *(t.cuda() for t in (tokens, first, sibling, p, q, u)), mode)
    expected = _run(tree_verify_reference, tokens, first, sibling, p, q, u, mode)
    mismatched = int((kernel[0].cpu() != expected[0]).any(1).sum())
    assert mismatched <= 1, f"{mismatched} of 64 requests differ (fp32 sums against float64 near a boundary)"


# --- the op ---------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_op_on_the_cpu_is_the_reference_and_draws_reproducibly():
    from kforge.ops import tree_verify as tree_verify_op

    tokens, first, sibling, p, q, _ = _random_inputs("deep and wide", 16, 23, seed=4)
    first_draw = tree_verify_op(tokens, first, sibling, p, draft_probs=q, mode="draft",
                                generator=torch.Generator().manual_seed(1))
    again = tree_verify_op(tokens, first, sibling, p, draft_probs=q, mode="draft",
                           generator=torch.Generator().manual_seed(1))
    u = torch.rand(16, 7, generator=torch.Generator().manual_seed(1))
    expected = tree_verify_reference(tokens, first, sibling, p, u, draft_probs=q, mode="draft")
    for got, same, want in zip(first_draw, again, expected):
        assert torch.equal(got, same) and torch.equal(got, want)
    greedy = tree_verify_op(tokens, first, sibling, p, mode="greedy")
    assert torch.equal(greedy[0], tree_verify_reference(tokens, first, sibling, p, mode="greedy")[0])
    torch.library.opcheck(torch.ops.kforge.tree_verify.default,
                          (tokens, first, sibling, p, u, q, "draft", None, None, 0, True))
    seeded = tree_verify_op(tokens, first, sibling, p, draft_probs=q, mode="draft", seed=8, offset=5)
    on_philox = tree_verify_reference(tokens, first, sibling, p, philox_uniforms(8, 5, (16, 7)), draft_probs=q,
                                      mode="draft")
    for got, want in zip(seeded, on_philox):
        assert torch.equal(got, want)

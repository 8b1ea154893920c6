"""Chain speculative sampling: the Triton kernel under the interpreter against the float64
reference token for token on the same uniform draws (ragged vocabularies over several
tiles, fp32/fp16/bf16 probabilities, int32/int64 ids, outputs pre-filled with garbage); the
edge cases by hand (a drafted token the draft gave probability 0, every draft accepted, the
first rejected, a residual with no mass, u at 0 and just below 1, no drafts); the theorem:
emitted tokens at every position are distributed as the target's probabilities and the
number emitted as the acceptance rates say, by chi-square tests that the two wrong rules
(always accept; resample from the target instead of the residual) fail; the op's checks.
On a GPU: the compiled kernel against the reference at vocabularies of 32k and 128k, and the
theorem over a million draws, and the same with the draws made in the kernel from a seed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kforge.kernels.speculative import chain as chain_module
from kforge.kernels.speculative.chain import chain_speculative_sampling as chain_kernel
from kforge.kernels.speculative.draws import philox_uniforms
from kforge.kernels.speculative.reference import chain_speculative_sampling_reference as reference
from kforge.kernels.speculative.reference import final_distribution
from kforge.ops.speculative import chain_speculative_sampling


def _peaked(shape, generator, power=3.0, dtype=torch.float32, zeros=0.0):
    """Rows of probabilities, far from uniform, a share `zeros` of entries exactly 0."""
    x = torch.rand(shape, generator=generator, dtype=torch.float64) ** power
    if zeros:
        x = torch.where(torch.rand(shape, generator=generator, dtype=torch.float64) < zeros, 0.0, x)
        x[..., 0] += 1e-3  # no empty row
    return (x / x.sum(-1, keepdim=True)).to(dtype)


def _case(batch, k, vocab, *, seed=0, dtype=torch.float32, ids_dtype=torch.int64, mix=0.5, zeros=0.0):
    """Drafts drawn from q; the target is p = mix * q + (1 - mix) * other, so some drafts pass and
    some fail."""
    g = torch.Generator().manual_seed(seed)
    q = _peaked((batch, k, vocab), g, zeros=zeros).double()
    other = _peaked((batch, k + 1, vocab), g, zeros=zeros).double()
    p = other.clone()
    p[:, :k] = mix * q + (1 - mix) * other[:, :k]
    q, p = q.to(dtype), p.to(dtype)
    ids = torch.multinomial(q.float().reshape(-1, vocab) + 1e-30, 1, generator=g).reshape(batch, k).to(ids_dtype) \
        if k else torch.zeros(batch, 0, dtype=ids_dtype)
    u = torch.rand(batch, k + 1, generator=g)
    return q, ids, p, u


@pytest.fixture
def garbage_outputs(monkeypatch):
    """The kernel's outputs start as -777: a slot it forgets to write shows."""
    empty = torch.empty
    monkeypatch.setattr(chain_module.torch, "empty",
                        lambda *args, **kwargs: empty(*args, **kwargs).fill_(-777))


def _assert_same(got, expected):
    names = ("output ids", "accepted", "emitted")
    for name, a, b in zip(names, got, expected):
        assert a.dtype == torch.int32 and a.shape == b.shape, name
        assert torch.equal(a.cpu(), b.cpu()), f"{name} differ in rows {(a.cpu() != b.cpu()).nonzero()[:8].tolist()}"


# --- kernel == reference on the same draws ----------------------------------------------------

@pytest.mark.parametrize("batch, k, vocab, block_v, dtype, ids_dtype", [
    (24, 1, 7, 16, torch.float32, torch.int64),      # one tile with a tail
    (24, 4, 100, 16, torch.float32, torch.int32),    # 7 tiles, the last of 4
    (16, 5, 33, 32, torch.float16, torch.int64),
    (16, 3, 64, 16, torch.bfloat16, torch.int32),    # vocab a multiple of the tile
])
def test_kernel_matches_reference_token_for_token(batch, k, vocab, block_v, dtype, ids_dtype, garbage_outputs):
    q, ids, p, u = _case(batch, k, vocab, seed=vocab, dtype=dtype, ids_dtype=ids_dtype, zeros=0.2)
    got = chain_kernel(q, ids, p, u, block_v=block_v)
    expected = reference(q, ids, p, u)
    _assert_same(got, expected)
    emitted = expected[2]
    assert (emitted == 0).any() and (emitted == k).any()  # both ends of the walk were exercised
    if k > 1:
        assert ((emitted > 0) & (emitted < k)).any()
        assert (expected[1] > emitted).any()  # an acceptance counted past the first rejection


@pytest.mark.parametrize("seed, offset", [(0, 0), (2**40 + 17, 2**32 - 50)])  # counters across 2^32
def test_seeded_kernel_matches_reference_on_the_same_philox_draws(seed, offset, garbage_outputs):
    q, ids, p, _ = _case(24, 4, 100, seed=6, zeros=0.2)
    got = chain_kernel(q, ids, p, seed=seed, offset=offset, block_v=16)
    _assert_same(got, reference(q, ids, p, philox_uniforms(seed, offset, (24, 5))))
    with pytest.raises(ValueError, match="not both and not neither"):
        chain_kernel(q, ids, p, block_v=16)


def test_a_seed_tensor_draws_what_its_integers_draw(garbage_outputs):
    """(seed, offset) in device memory, read as the kernel runs: the same tokens as the integers."""
    q, ids, p, _ = _case(24, 4, 100, seed=6, zeros=0.2)
    seed, offset = 2**40 + 17, 2**32 - 50
    _assert_same(chain_kernel(q, ids, p, seed=torch.tensor([seed, offset]), block_v=16),
                 chain_kernel(q, ids, p, seed=seed, offset=offset, block_v=16))
    _assert_same(chain_speculative_sampling(q, ids, p, seed=torch.tensor([seed, offset])),
                 chain_speculative_sampling(q, ids, p, seed=seed, offset=offset))
    for bad, message in [(torch.tensor([1, 2], dtype=torch.int32), "int64 of shape"),
                         (torch.tensor([1, 2, 3]), "int64 of shape")]:
        with pytest.raises(ValueError, match=message):
            chain_kernel(q, ids, p, seed=bad, block_v=16)
    with pytest.raises(ValueError, match="the offset is its second entry"):
        chain_kernel(q, ids, p, seed=torch.tensor([1, 2]), offset=5, block_v=16)
    with pytest.raises(ValueError, match=r"offset must be an integer in \[0, 2\^63\)"):
        chain_speculative_sampling(q, ids, p, seed=torch.tensor([1, -2]))  # the CPU path reads the tensor back


def test_kernel_matches_reference_with_no_drafts():
    q, ids, p, u = _case(8, 0, 20, seed=3)
    got = chain_kernel(q, ids, p, u, block_v=16)
    _assert_same(got, reference(q, ids, p, u))
    assert (got[0][:, 0] >= 0).all() and (got[2] == 0).all()


# --- the edge cases, by hand ------------------------------------------------------------------

def _both(q, ids, p, u):
    """Kernel and reference on one case; asserts they agree and returns the reference's result."""
    expected = reference(q, ids, p, u)
    _assert_same(chain_kernel(q, ids, p, u, block_v=16), expected)
    return [t.tolist() for t in expected]


def _rows(row):
    """One row of weights normalised to probabilities, float32 (V,)."""
    t = torch.tensor(row, dtype=torch.float64)
    return (t / t.sum()).float()


def test_a_draft_the_draft_model_gave_probability_zero_is_accepted_if_the_target_allows_it():
    # q_0(2) = 0 yet 2 was drafted: p/q is infinite, accepted even at u just below 1
    q = _rows([1, 1, 0, 1, 1])[None, None]
    p = torch.stack([_rows([1, 1, 1, 1, 1]), _rows([0, 0, 0, 0, 1])])[None]
    out, accepted, emitted = _both(q, torch.tensor([[2]]), p, torch.tensor([[1 - 2**-24, 0.5]]))
    assert out == [[2, 4]] and accepted == [1] and emitted == [1]  # the bonus from p_1, all on token 4


def test_a_draft_neither_model_allows_is_rejected_and_a_residual_with_no_mass_falls_back_to_the_target():
    # q_0 = p_0 and both give the drafted token 0: rejected (0 < 0 is false) though the
    # residual max(0, p - q) is 0 everywhere; the final token comes from p_0 itself
    row = _rows([0, 1, 3, 0, 4])
    q = row[None, None]
    p = torch.stack([row, _rows([1, 1, 1, 1, 1])])[None]
    for u_final, token in ((0.0, 1), (0.2, 2), (0.6, 4), (1 - 2**-24, 4)):
        out, accepted, emitted = _both(q, torch.tensor([[3]]), p, torch.tensor([[0.0, u_final]]))
        assert out == [[token, -1]] and accepted == [0] and emitted == [0], u_final


def test_all_drafts_accepted_gives_the_bonus_token():
    g = torch.Generator().manual_seed(5)
    q = _peaked((2, 3, 10), g)
    p = torch.cat([q, _rows([0, 0, 0, 0, 0, 0, 0, 1, 0, 0]).expand(2, 1, 10)], 1)  # p_j = q_j: always accepted
    ids = torch.tensor([[1, 5, 9], [0, 0, 2]])
    out, accepted, emitted = _both(q, ids, p, torch.tensor([[0.99, 0.5, 0.999, 0.3], [0.0, 0.7, 0.1, 0.9]]))
    assert out == [[1, 5, 9, 7], [0, 0, 2, 7]] and accepted == [3, 3] and emitted == [3, 3]


def test_first_draft_rejected_samples_the_residual_and_counts_later_acceptances():
    # p_0(x_0) = 0 rejects draft 0; the residual max(0, p_0 - q_0) lives on tokens 3 and 4 only,
    # in the ratio 1 : 5; drafts 1 and 2 would pass on their own (p = q), so accepted = 2
    q0 = _rows([2, 2, 0, 1, 0])  # (0.4, 0.4, 0, 0.2, 0)
    p0 = _rows([0, 2, 0, 3, 5])  # (0, 0.2, 0, 0.3, 0.5)
    residual = (p0.double() - q0.double()).clamp(min=0)
    assert residual[:3].sum() == 0 and residual[3] > 0 and residual[4] > 0
    split = float(residual[3] / residual.sum())
    rest = _rows([1, 1, 1, 1, 1])
    q = torch.stack([q0, rest, rest])[None]
    p = torch.stack([p0, rest, rest, rest])[None]
    for u_final, token in ((0.0, 3), (split * 0.99, 3), (split * 1.01, 4), (1 - 2**-24, 4)):
        out, accepted, emitted = _both(q, torch.tensor([[0, 1, 2]]), p, torch.tensor([[0.0, 0.5, 0.5, u_final]]))
        assert out == [[token, -1, -1, -1]] and accepted == [2] and emitted == [0], u_final


def test_a_rejection_in_the_middle_keeps_the_accepted_prefix():
    rest = _rows([1, 1, 1, 1])
    q = torch.stack([rest, _rows([1, 0, 0, 0]), rest])[None]
    p = torch.stack([rest, _rows([0, 0, 1, 0]), rest, rest])[None]  # draft 1 (token 0) has p = 0
    out, accepted, emitted = _both(q, torch.tensor([[3, 0, 1]]), p, torch.tensor([[0.9, 0.1, 0.9, 0.4]]))
    assert out == [[3, 2, -1, -1]] and accepted == [2] and emitted == [1]


# --- the theorem: emitted tokens follow the target --------------------------------------------

P_ROWS = [[0.30, 0.25, 0.20, 0.15, 0.10, 0.00],  # the target never emits token 5
          [0.05, 0.05, 0.10, 0.20, 0.25, 0.35],
          [0.40, 0.10, 0.10, 0.10, 0.10, 0.20],
          [0.10, 0.30, 0.10, 0.30, 0.10, 0.10]]  # the bonus row
Q_ROWS = [[0.10, 0.10, 0.30, 0.10, 0.10, 0.30],  # drafts token 5 30% of the time: always rejected
          [0.30, 0.20, 0.20, 0.10, 0.10, 0.10],
          [0.40, 0.10, 0.10, 0.10, 0.10, 0.20]]  # = the target: always accepted


def _population(n, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.tensor(Q_ROWS, dtype=torch.float32)
    p = torch.tensor(P_ROWS, dtype=torch.float32)
    ids = torch.stack([torch.multinomial(q[j], n, replacement=True, generator=g) for j in range(len(Q_ROWS))], 1)
    return q.expand(n, -1, -1), ids, p.expand(n, -1, -1), torch.rand(n, len(P_ROWS), generator=g)


def _chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P(chi-square >= observed) for counts against probs; 0 if a token of probability 0 appears."""
    counts, probs = counts.double(), probs.double()
    if counts[probs == 0].sum() > 0:
        return 0.0
    support = probs > 0
    expected = counts.sum() * probs[support]
    statistic = ((counts[support] - expected) ** 2 / expected).sum()
    dof = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic / 2))


def _pvalues(out: torch.Tensor, emitted: torch.Tensor) -> dict[str, float]:
    """One p-value per position (the tokens of the rows that reach it, against p at that
    position) and one for the number of drafts emitted (against the acceptance rates)."""
    p = torch.tensor(P_ROWS, dtype=torch.float64)
    q = torch.tensor(Q_ROWS, dtype=torch.float64)
    k, vocab = q.shape
    found = {}
    for i in range(k + 1):
        tokens = out[:, i][out[:, i] >= 0].long()
        found[f"position {i}"] = _chi_square_pvalue(torch.bincount(tokens, minlength=vocab), p[i])
    alpha = torch.minimum(p[:k], q).sum(1)  # P(draft j accepted) = sum_x min(p_j, q_j)
    reach = torch.cat([torch.ones(1, dtype=torch.float64), alpha.cumprod(0)])
    expected_n = reach * torch.cat([1 - alpha, torch.ones(1, dtype=torch.float64)])
    found["emitted"] = _chi_square_pvalue(torch.bincount(emitted.long(), minlength=k + 1), expected_n)
    return found


def _always_accept(q, ids, p, u):
    k = ids.shape[1]
    bonus = torch.multinomial(p[:, k].float(), 1, generator=torch.Generator().manual_seed(9))
    return torch.cat([ids, bonus], 1), torch.full((ids.shape[0],), k)


def _resample_from_target(q, ids, p, u):
    """The right acceptance test, but the final token drawn from p rather than the residual."""
    out, _, emitted = reference(q, ids, p, u)
    rows = torch.arange(len(ids))
    final = torch.multinomial(p[rows, emitted.long()].float(), 1, generator=torch.Generator().manual_seed(9))[:, 0]
    out = out.clone()
    out[rows, emitted.long()] = final.int()
    return out, emitted


@pytest.mark.slow
def test_reference_emits_the_target_distribution_and_wrong_rules_fail_the_same_test():
    population = _population(200_000, seed=11)
    out, accepted, emitted = reference(*population)
    for name, pvalue in _pvalues(out, emitted).items():
        assert pvalue > 1e-4, f"{name}: p = {pvalue:.2e}"
    alpha = torch.minimum(torch.tensor(P_ROWS[:3]), torch.tensor(Q_ROWS)).sum(1).double()
    spread = float((alpha * (1 - alpha)).sum().sqrt()) / 200_000 ** 0.5
    assert abs(accepted.double().mean() - alpha.sum()) < 5 * spread  # each draft judged on its own
    for wrong in (_always_accept, _resample_from_target):
        pvalues = _pvalues(*wrong(*population))
        assert min(pvalues.values()) < 1e-12, (wrong.__name__, pvalues)


@pytest.mark.slow
def test_kernel_emits_the_target_distribution():
    # ~10 s under the interpreter; the kernel equals the reference on the same draws
    # (above), so this checks the kernel's rule on its own at a smaller count
    population = _population(600, seed=12)
    out, _, emitted = chain_kernel(*population, block_v=16)
    for name, pvalue in _pvalues(out, emitted).items():
        assert pvalue > 1e-4, f"{name}: p = {pvalue:.2e}"
    for wrong in (_always_accept, _resample_from_target):
        assert min(_pvalues(*wrong(*population)).values()) < 1e-4, wrong.__name__


@pytest.mark.slow
def test_seeded_kernel_emits_the_target_distribution():
    # the same population with the draws made in the kernel: one seed, 600 requests' counters
    q, ids, p, _ = _population(600, seed=12)
    out, _, emitted = chain_kernel(q, ids, p, seed=2026, block_v=16)
    for name, pvalue in _pvalues(out, emitted).items():
        assert pvalue > 1e-4, f"{name}: p = {pvalue:.2e}"


# --- the op ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_op_draws_from_the_generator_reproducibly_and_matches_given_uniforms():
    q, ids, p, _ = _case(32, 4, 50, seed=21)
    first = chain_speculative_sampling(q, ids, p, generator=torch.Generator().manual_seed(1))
    again = chain_speculative_sampling(q, ids, p, generator=torch.Generator().manual_seed(1))
    uniforms = torch.rand(32, 5, generator=torch.Generator().manual_seed(1))
    _assert_same(first, again)
    _assert_same(first, chain_speculative_sampling(q, ids, p, uniforms))
    torch.library.opcheck(torch.ops.kforge.chain_speculative_sampling.default,
                          (q, ids, p, uniforms, None, None, 0, True))
    state = torch.tensor([7, 3])
    torch.library.opcheck(torch.ops.kforge.chain_speculative_sampling.default, (q, ids, p, None, None, state, 0, True))


def test_op_with_a_seed_draws_philox_counters_the_reference_can_share():
    q, ids, p, _ = _case(32, 4, 50, seed=21)
    seeded = chain_speculative_sampling(q, ids, p, seed=5, offset=3)
    _assert_same(seeded, chain_speculative_sampling(q, ids, p, philox_uniforms(5, 3, (32, 5))))
    assert not torch.equal(seeded[0], chain_speculative_sampling(q, ids, p, seed=5, offset=3 + 32 * 5)[0])
    with pytest.raises(ValueError, match="as uniforms or as a seed"):
        chain_speculative_sampling(q, ids, p, philox_uniforms(5, 3, (32, 5)), seed=5)
    with pytest.raises(ValueError, match=r"offset must be an integer in \[0, 2\^63\)"):
        chain_speculative_sampling(q, ids, p, seed=5, offset=-1)


@pytest.mark.parametrize("change, message", [
    (lambda q, ids, p, u: (q[0], ids, p, u), "draft_probs must be"),
    (lambda q, ids, p, u: (q, ids, p[:, :-1], u), "target_probs must be"),
    (lambda q, ids, p, u: (q, ids[:, :-1], p, u), "draft_token_ids must be"),
    (lambda q, ids, p, u: (q.double(), ids, p, u), "float32, float16 or bfloat16"),
    (lambda q, ids, p, u: (q, ids.float(), p, u), "int32 or int64"),
    (lambda q, ids, p, u: (q, ids, p, u[:, :-1]), "uniforms must be"),
    (lambda q, ids, p, u: (q, ids, p, u.double()), "uniforms must be"),
    (lambda q, ids, p, u: (q, ids + 50, p, u), r"must lie in \[0, 50\)"),
    (lambda q, ids, p, u: (q, ids - 50, p, u), r"must lie in \[0, 50\)"),
    (lambda q, ids, p, u: (q.transpose(0, 1).contiguous().transpose(0, 1)[..., ::2], ids, p, u), "must be"),
    (lambda q, ids, p, u: (q, ids, p.transpose(1, 2).contiguous().transpose(1, 2), u), "contiguous last"),
])
def test_op_refuses_bad_inputs(change, message):
    q, ids, p, u = _case(4, 3, 50, seed=2)
    with pytest.raises(ValueError, match=message):
        chain_speculative_sampling(*change(q, ids, p, u))


@pytest.mark.slow
def test_the_kernel_compiles_for_the_h100_without_spills_with_either_draws():
    sys.path.insert(0, str(Path(__file__).parent))
    from triton_sm90 import compile_sm90, spec

    types = {**{name: "*fp32" for name in ("draft_probs_ptr", "target_probs_ptr", "uniforms_ptr")},
             **{name: "*i32" for name in ("draft_ids_ptr", "out_ptr", "accepted_ptr", "emitted_ptr")},
             **{name: "i32" for name in ("stride_db", "stride_dk", "stride_ib", "stride_tb", "stride_tk", "stride_ub",
                                         "stride_ob", "K", "V")},
             "seed": "i64", "offset": "i64", "seed_ptr": "*i64"}
    found = compile_sm90([spec(f"seeded {seeded}, seed tensor {in_memory}", "kforge.kernels.speculative.chain",
                               "chain_speculative_sampling_kernel", types,
                               {"BLOCK_K": 8, "BLOCK_V": 1024, "SEEDED": seeded, "SEED_IN_MEMORY": in_memory},
                               num_warps=4, num_stages=1)
                          for seeded, in_memory in ((False, False), (True, False), (True, True))])
    assert len(found) == 3
    for label, used in found.items():
        assert used["spills"] == 0 and used["local"] == 0, (label, used)


# --- on the GPU -------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [32000, 128256])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_gpu_kernel_matches_reference(vocab, k):
    # The acceptance walk must agree exactly. The final token is found by an fp32 running sum
    # on the GPU and a float64 one in the reference: over 128k tokens the two can differ where
    # u * sum falls within rounding of a boundary, so a differing final token must sit at the
    # threshold in float64 (within 1e-5 of the sum), and such rows must be rare.
    q, ids, p, u = (t.cuda() for t in _case(128, k, vocab, seed=k, mix=0.8))
    out, accepted, emitted = chain_speculative_sampling(q, ids, p, u)
    expected = reference(q, ids, p, u)
    assert torch.equal(accepted, expected[1]) and torch.equal(emitted, expected[2])
    rows = torch.arange(128, device="cuda")
    final = emitted.long()
    drafts_and_padding = torch.arange(k + 1, device="cuda") != final[:, None]
    assert torch.equal(out[drafts_and_padding], expected[0][drafts_and_padding])
    token, expected_token = out[rows, final].long(), expected[0][rows, final].long()
    differ = (token != expected_token).nonzero()[:, 0]
    assert len(differ) <= 2, f"{len(differ)} of 128 final tokens differ"
    dist = final_distribution(q, p, emitted)[differ]
    total = dist.sum(1)
    threshold = u[differ, k].double() * total
    upto = dist.cumsum(1).gather(1, token[differ, None])[:, 0]
    before = upto - dist.gather(1, token[differ, None])[:, 0]
    assert (dist.gather(1, token[differ, None])[:, 0] > 0).all()
    assert ((before <= threshold + 1e-5 * total) & (upto >= threshold - 1e-5 * total)).all()


@pytest.mark.gpu
def test_gpu_kernel_emits_the_target_distribution():
    out, _, emitted = chain_speculative_sampling(*(t.cuda() for t in _population(1_000_000, seed=13)))
    for name, pvalue in _pvalues(out.cpu(), emitted.cpu()).items():
        assert pvalue > 1e-4, f"{name}: p = {pvalue:.2e}"


@pytest.mark.gpu
def test_gpu_a_captured_graph_draws_fresh_counters_as_its_seed_tensor_advances():
    q, ids, p, _ = (t.cuda() for t in _case(64, 4, 1000, seed=9))
    state = torch.tensor([11, 0], device="cuda")
    chain_speculative_sampling(q, ids, p, seed=state, validate=False)  # builds the kernel outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain_speculative_sampling(q, ids, p, seed=state, validate=False)
    for step in range(3):
        state[1] = step * 64 * 5
        graph.replay()
        want = chain_speculative_sampling(q.cpu(), ids.cpu(), p.cpu(), seed=11, offset=step * 64 * 5)
        _assert_same(tuple(t.cpu() for t in out), want)


@pytest.mark.gpu
def test_gpu_seeded_kernel_is_the_reference_on_philox_draws_and_emits_the_target_distribution():
    q, ids, p, _ = (t.cuda() for t in _population(1_000_000, seed=14))
    out, accepted, emitted = chain_speculative_sampling(q, ids, p, seed=77, offset=2**32 - 1000)
    expected = reference(q[:4096], ids[:4096], p[:4096], philox_uniforms(77, 2**32 - 1000, (4096, 4), "cuda"))
    _assert_same((out[:4096], accepted[:4096], emitted[:4096]), expected)  # a 6-token vocabulary: no rounding ties
    for name, pvalue in _pvalues(out.cpu(), emitted.cpu()).items():
        assert pvalue > 1e-4, f"{name}: p = {pvalue:.2e}"

"""The DeepSeek-V3-shaped model (kforge.models.deepseek) on the CPU, tiny config: the latent cache
against full forwards from scratch, absorbed MLA decode against the unabsorbed form in float64,
speculative generation with the MTP draft against plain generation, and the refusals.

On a CPU every kforge op runs its PyTorch reference (MLA decode in float64), so these run the
model's real code path; the GPU tests at the end run it on the Triton kernels."""

import math
from dataclasses import replace

import pytest
import torch

from kforge.errors import ModelError
from kforge.models.deepseek import MtpDrafter, generate, preset, random_model
from kforge.models.deepseek.generate import verify
from kforge.models.sampling import SamplingParams, sample

TINY = preset("tiny")


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def model():
    return random_model(TINY, seed=0)


class TargetAsDrafter:
    """A test double: drafts with the target model itself, on a cache of its own, so the draft's
    distribution is the target's (up to rounding) and every draft should be accepted."""

    def __init__(self, model, max_context=256):
        self.model, self.cache, self.seen = model, model.new_cache(1, max_context), 0

    def propose(self, tokens, hidden, k, choose):
        model, device = self.model, self.model.embed.device
        if self.seen == 0:
            h = model.prefill(torch.tensor(tokens, device=device), self.cache)
        else:  # the committed tokens it has not fed yet; its draft rows are dropped
            self.cache.truncate(0, self.seen)
            h = model.decode(torch.tensor([tokens[self.seen:]], device=device), self.cache)
        self.seen = len(tokens)
        logits = model.logits(h[:, -1])
        drafts, rows = [], []
        for i in range(k):
            drafts.append(choose(logits))
            rows.append(logits)
            if i + 1 < k:
                logits = model.logits(model.decode(torch.tensor([[drafts[-1]]], device=device), self.cache)[:, -1])
        return drafts, torch.cat(rows)


class WrongSecondDraft(TargetAsDrafter):
    """The target's own drafts with the second one replaced: each round accepts exactly one."""

    def propose(self, tokens, hidden, k, choose):
        drafts, logits = super().propose(tokens, hidden, k, choose)
        drafts[1] = (drafts[1] + 1) % self.model.config.vocab_size
        return drafts, logits


class CheckedMtpDrafter(MtpDrafter):
    """The MTP drafter, each proposal compared with the same drafts computed from scratch (a fresh
    target prefill of the committed tokens and a fresh MTP prefill): its rolled-back cache must hold
    what the committed sequence gives."""

    max_error = 0.0

    def propose(self, tokens, hidden, k, choose):
        drafts, logits = super().propose(tokens, hidden, k, choose)
        full_hidden = self.model.prefill(torch.tensor(tokens[:-1]), self.model.new_cache(1, len(tokens)))
        replay = iter(drafts)
        _, fresh = MtpDrafter(self.model, len(tokens) + k).propose(tokens, full_hidden, k, lambda _: next(replay))
        self.max_error = max(self.max_error, float((logits - fresh).abs().max()))
        return drafts, logits


def full_logits(model, tokens):
    """Every position's logits of a prefill from scratch on a fresh cache: (T, vocab)."""
    return model.logits(model.prefill(torch.tensor(tokens), model.new_cache(1, len(tokens)))[0])


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P(chi-square >= observed) for counts against probs, the tokens expected fewer than 5 times
    lumped into one bin; 0 if a token of probability 0 appears."""
    counts, probs = counts.double(), probs.double()
    if counts[probs == 0].sum() > 0:
        return 0.0
    expected = counts.sum() * probs
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    expected = torch.cat([expected[big], expected[~big].sum()[None]])
    statistic = ((observed - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((len(observed) - 1) / 2, dtype=torch.float64), statistic / 2))


# --- the configuration ----------------------------------------------------------------------------

def test_the_v3_preset_has_deepseek_v3s_published_sizes():
    c = preset("deepseek-v3-shapes")
    assert c.latent_dim == 576 and c.kv_lora_rank == 512
    assert c.softmax_scale == pytest.approx(192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2), "YaRN's mscale, squared"
    assert abs(c.parameter_count() - 671e9) < 0.001 * 671e9  # the report's 671B
    # with the MTP module (its own copy of the embedding and head, as the checkpoint stores it): 685B
    with_mtp = c.parameter_count() + c.parameter_count(mtp=True) + 2 * c.vocab_size * c.dim
    assert abs(with_mtp - 685e9) < 0.005 * 685e9
    with pytest.raises(ModelError, match="instantiate small configs only"):
        random_model(c)


@pytest.mark.parametrize("change, message", [
    ({"kv_lora_rank": 24}, "kv_lora_rank must be a power of two >= 16"),
    ({"qk_rope_head_dim": 8}, "qk_rope_head_dim must be a power of two >= 16"),
    ({"n_heads": 0}, "n_heads must be a positive integer"),
    ({"q_lora_rank": -1}, "q_lora_rank must be a non-negative integer"),
    ({"dim": 100}, "dim must be a multiple of 8"),
    ({"n_group": 3}, "n_group \\(3\\) must divide n_routed_experts \\(8\\)"),
    ({"top_k": 6}, "top_k \\(6\\) experts must fit in topk_group \\(2\\)"),
    ({"n_dense_layers": 4}, "n_dense_layers \\(4\\) exceeds"),
    ({"routed_scaling_factor": 0.0}, "must be > 0"),
])
def test_bad_config_values_are_refused_in_one_line(change, message):
    with pytest.raises(ModelError, match=message):
        replace(TINY, **change)


def test_bad_requests_are_refused_in_one_line(model):
    with pytest.raises(ModelError, match="page_size 24 is not one"):
        model.new_cache(1, 64, page_size=24)
    with pytest.raises(ModelError, match="longer than the model's 512 positions"):
        generate(model, [1] * 500, SamplingParams(max_tokens=20))
    with pytest.raises(ModelError, match="non-empty list of token ids in \\[0, 512\\)"):
        generate(model, [1, 512], SamplingParams(max_tokens=2))
    with pytest.raises(ModelError, match="draft_k must be >= 0"):
        generate(model, [1], SamplingParams(max_tokens=2), draft_k=-1)
    with pytest.raises(ModelError, match="temperature only"):
        generate(model, [1], SamplingParams(max_tokens=2, temperature=1.0, top_k=5), draft_k=2)
    cache = model.new_cache(1, 8)
    model.prefill(torch.arange(6), cache)
    with pytest.raises(ModelError, match="row 0: 9 tokens exceed the cache's max_context of 8"):
        model.decode(torch.zeros(1, 3, dtype=torch.long), cache)
    with pytest.raises(ModelError, match="cannot truncate row 0 of 6 tokens to 7"):
        cache.truncate(0, 7)


# --- the cache and MLA ------------------------------------------------------------------------------

def test_prefill_then_decode_equals_a_full_forward_from_scratch(model):
    """Two rows of different lengths (pages interleaved in one pool), decode steps of 1 and 3
    tokens (absorbed MLA through the op, causal over the 3): every logit row equals the
    unabsorbed prefill of the whole sequence on a fresh cache."""
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, TINY.vocab_size, (24,), generator=g).tolist() for _ in range(2)]
    starts = [13, 4]  # the prompt lengths: ragged rows
    cache = model.new_cache(2, 40)
    got = [[model.logits(model.prefill(torch.tensor(s[:n]), cache, row=b)[0])] for b, (s, n) in
           enumerate(zip(seqs, starts))]
    for step in (1, 3, 1, 2):
        tokens = torch.tensor([s[cache.lengths[b]:cache.lengths[b] + step] for b, s in enumerate(seqs)])
        logits = model.logits(model.decode(tokens, cache))
        for b in range(2):
            got[b].append(logits[b])
    for b, (s, n) in enumerate(zip(seqs, starts)):
        length = n + 7
        want = full_logits(model, s[:length])
        assert cache.lengths[b] == length
        torch.testing.assert_close(torch.cat(got[b]), want, atol=2e-5, rtol=1e-4)


def test_a_truncated_cache_forgets_the_rejected_tokens(model):
    """Three wrong tokens appended, then truncated away: the right ones fed after them see only
    the kept prefix (what a rejected draft's rows must become)."""
    seq = list(range(40, 60))
    cache = model.new_cache(1, 32)
    model.prefill(torch.tensor(seq[:10]), cache)
    model.decode(torch.tensor([[seq[10], 7, 8, 9]]), cache)  # one right token, three wrong
    cache.truncate(0, 11)
    logits = model.logits(model.decode(torch.tensor([seq[11:14]]), cache)[0])
    torch.testing.assert_close(logits, full_logits(model, seq[:14])[11:], atol=2e-5, rtol=1e-4)


def test_absorbed_decode_equals_unabsorbed_attention_in_float64():
    """The tiny config's attention (every FFN dense: kforge's grouped GEMMs stop at fp32) in
    float64: decode steps through the absorbed form (the MLA op's float64 definition over the
    paged latents) equal the unabsorbed prefill of the whole sequence, main model and MTP block."""
    model = random_model(replace(TINY, n_dense_layers=TINY.n_layers + 1), seed=3, dtype=torch.float64)
    seq = torch.randint(0, TINY.vocab_size, (20,), generator=torch.Generator().manual_seed(2))
    full = model.prefill(seq, model.new_cache(1, 20))
    cache = model.new_cache(1, 20)
    steps = [model.prefill(seq[:9], cache)] + [model.decode(seq[None, i:i + n], cache) for i, n in ((9, 1), (10, 4),
                                                                                                      (14, 6))]
    assert (torch.cat(steps, 1) - full).abs().max() < 1e-12 * full.abs().max()

    hidden, next_tokens = full[:, :-1], seq[1:]
    mtp_full = model.mtp_prefill(hidden, next_tokens, model.new_cache(1, 19, mtp=True))
    mtp_cache = model.new_cache(1, 19, mtp=True)
    mtp_steps = [model.mtp_prefill(hidden[:, :5], next_tokens[:5], mtp_cache),
                 model.mtp_decode(hidden[:, 5:8], next_tokens[None, 5:8], mtp_cache),
                 model.mtp_decode(hidden[:, 8:], next_tokens[None, 8:], mtp_cache)]
    assert (torch.cat(mtp_steps, 1) - mtp_full).abs().max() < 1e-12 * mtp_full.abs().max()


# --- speculative generation ------------------------------------------------------------------------

PROMPT = [5, 77, 301, 12, 9, 440, 23, 100]


@pytest.fixture(scope="module")
def plain_greedy(model):
    return generate(model, PROMPT, SamplingParams(max_tokens=25))


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_greedy_with_the_mtp_draft_emits_plain_greedys_tokens(model, plain_greedy, k):
    spec = generate(model, PROMPT, SamplingParams(max_tokens=25), draft_k=k)
    assert spec.tokens == plain_greedy.tokens
    assert spec.drafted == k * spec.target_steps and 0 <= spec.accepted <= spec.drafted
    assert len(spec.tokens) - 1 == spec.target_steps + spec.accepted  # each step: its accepted drafts and one more


def test_a_draft_equal_to_the_target_is_accepted_every_time(model, plain_greedy):
    spec = generate(model, PROMPT, SamplingParams(max_tokens=25), draft_k=3, drafter=TargetAsDrafter(model))
    assert spec.tokens == plain_greedy.tokens
    assert spec.acceptance_rate == 1.0 and spec.tokens_per_step == 4.0  # 24 tokens in 6 steps of K + 1
    sampled = generate(model, PROMPT, SamplingParams(max_tokens=25, temperature=0.8, seed=5), draft_k=3,
                       drafter=TargetAsDrafter(model))
    assert sampled.acceptance_rate == 1.0 and sampled.tokens_per_step == 4.0  # q = p: min(1, p/q) = 1


def test_rejected_drafts_leave_the_target_on_plain_greedys_path(model, plain_greedy):
    """Every round accepts one draft and rejects the next: the target's cache drops the
    rejected rows each time."""
    spec = generate(model, PROMPT, SamplingParams(max_tokens=25), draft_k=3, drafter=WrongSecondDraft(model))
    assert spec.tokens == plain_greedy.tokens
    assert spec.acceptance_rate == pytest.approx(1 / 3) and spec.tokens_per_step == 2.0


def test_the_mtp_drafters_rolled_back_cache_equals_a_fresh_one(model):
    """Sampling (about 3 in 4 drafts accepted on these nearly flat distributions), so rounds roll
    the MTP cache back over accepted and rejected drafts alike."""
    drafter = CheckedMtpDrafter(model, 64)
    spec = generate(model, PROMPT, SamplingParams(max_tokens=16, temperature=0.8, seed=0), draft_k=3, drafter=drafter)
    assert 0 < spec.accepted < spec.drafted  # both kinds of rounds happened
    assert drafter.max_error < 1e-4


def test_seeded_speculative_sampling_reproduces(model):
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=11)
    first, again = (generate(model, PROMPT, params, draft_k=2) for _ in range(2))
    assert first.tokens == again.tokens and first.accepted == again.accepted
    other = generate(model, PROMPT, replace(params, seed=12), draft_k=2)
    assert other.tokens != first.tokens
    plain = [generate(model, PROMPT, params).tokens for _ in range(2)]
    assert plain[0] == plain[1]


def test_the_first_speculative_token_follows_the_targets_distribution(model):
    """The MTP block's draft distribution q and the target's p after the prompt, at a temperature
    that makes both peaked: 3000 rounds of draw-from-q-then-verify emit a first token distributed
    as p (chi-square), while the drafts themselves, distributed as q, fail the same test."""
    temperature, draws = 0.05, 3000
    cache = model.new_cache(1, 16)
    hidden = model.prefill(torch.tensor(PROMPT), cache)
    tokens = PROMPT + [int(model.logits(hidden[:, -1]).argmax())]
    _, draft_logits = MtpDrafter(model, 16).propose(tokens, hidden, 1, lambda logits: 0)
    target_logits = model.logits(model.decode(torch.tensor([[tokens[-1], 0]]), cache)[0])
    # only p_0 and q_1 shape the first token; p_1 (the bonus's row) is kept from the decode above
    params, g = SamplingParams(temperature=temperature), torch.Generator().manual_seed(0)
    drafts = [int(sample(draft_logits, [params], [g])[0]) for _ in range(draws)]
    first = [verify([d], draft_logits, target_logits, temperature, g)[0] for d in drafts]
    p = torch.softmax(target_logits[0] / temperature, -1)
    counts = torch.bincount(torch.tensor(first), minlength=TINY.vocab_size)
    assert chi_square_pvalue(counts, p) > 1e-4
    assert chi_square_pvalue(torch.bincount(torch.tensor(drafts), minlength=TINY.vocab_size), p) < 1e-9


# --- on the GPU: the Triton MLA decode and MoE kernels ---------------------------------------------

@pytest.mark.gpu
def test_gpu_prefill_then_decode_matches_the_cpu_model():
    """fp32 on the GPU (MLA decode and the MoE kernels under Triton) against the CPU's references."""
    cpu, gpu = random_model(TINY, seed=0), random_model(TINY, seed=0, device="cuda")
    seq = list(range(100, 130))
    want = full_logits(cpu, seq)
    cache = gpu.new_cache(1, 32)
    got = [gpu.logits(gpu.prefill(torch.tensor(seq[:20], device="cuda"), cache)[0])]
    for i, n in ((20, 1), (21, 4), (25, 5)):
        got.append(gpu.logits(gpu.decode(torch.tensor([seq[i:i + n]], device="cuda"), cache)[0]))
    torch.testing.assert_close(torch.cat(got).cpu(), want, atol=2e-3, rtol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_speculative_greedy_emits_plain_greedys_tokens(dtype):
    """The K + 1 rows of a verify step take other kernel tilings than one-row decodes; bf16 may
    flip a near-tie where fp32 should not."""
    gpu = random_model(TINY, seed=0, dtype=dtype, device="cuda")
    params = SamplingParams(max_tokens=32)
    plain = generate(gpu, PROMPT, params)
    for drafter in (None, TargetAsDrafter(gpu)):
        spec = generate(gpu, PROMPT, params, draft_k=3, drafter=drafter)
        assert spec.tokens == plain.tokens


"""Chain speculative sampling in PyTorch, float64: the rule the Triton kernel implements, with
the random draws passed in so that both can be compared token for token.

A draft model proposed K tokens x_0..x_{K-1} for a request, x_j drawn from its distribution
q_j = draft_probs[b, j]; the target model scored the same prefix and gives p_j =
target_probs[b, j] for j = 0..K (one more row: the distribution after all K drafts).
Walking j = 0, 1, ...:

- accept x_j when u_j * q_j(x_j) < p_j(x_j), u_j uniform on [0, 1): with probability
  min(1, p_j(x_j) / q_j(x_j));
- at the first rejection, j = n, emit one token drawn from the residual
  r(x) = max(0, p_n(x) - q_n(x)) / sum_y max(0, p_n(y) - q_n(y)) and stop;
- if all K are accepted (n = K), emit a bonus token drawn from p_K.

Each emitted token is then distributed exactly as p at its position (Leviathan et al. 2023,
Chen et al. 2023): P(x) = q(x) min(1, p(x)/q(x)) + P(reject) r(x) = min(q, p) + max(0, p - q)
= p(x), since P(reject) = sum_y max(0, p(y) - q(y)) is the residual's normaliser.

The draws: `uniforms` is (B, K + 1); u[:, j] for j < K decides draft j, u[:, K] draws the one
final token (residual or bonus, never both) by inverse CDF: the first token t with r(t) > 0
whose running sum r(0) + ... + r(t) exceeds u * sum(r). Where the residual has no mass
(p_n = q_n, so rejection had probability 0, reached only by a rounding of u * q < p) the
token is drawn from p_n itself; where rounding leaves the threshold at or above the whole
sum, the last token with r > 0 is taken; a row with no mass at all gives token 0.

Outputs, FlashInfer's contract: output ids (B, K + 1) int32, the n accepted drafts then the
final token then -1 padding; `accepted` (B,) int32, the number of drafts that pass the test
when each is judged on its own (a measure of how well the draft matches the target, counting
past the first rejection too); `emitted` (B,) int32, n, the drafts emitted (the output row
holds n + 1 tokens).
"""

from __future__ import annotations

import torch


def chain_speculative_sampling_reference(draft_probs: torch.Tensor, draft_token_ids: torch.Tensor,
                                         target_probs: torch.Tensor, uniforms: torch.Tensor
                                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output ids (B, K + 1), accepted (B,), emitted (B,)), all int32, from draft_probs (B, K, V),
    draft_token_ids (B, K), target_probs (B, K + 1, V) and uniforms (B, K + 1) in [0, 1).
    Vectorised over the batch; no checks (see `chain.check_chain_inputs`)."""
    batch, k, vocab = draft_probs.shape
    device = draft_probs.device
    q = draft_probs.double()
    p = target_probs.double()
    u = uniforms.double()
    ids = draft_token_ids.long()

    q_tok = q.gather(2, ids[..., None])[..., 0]  # (B, K): q_j(x_j)
    p_tok = p[:, :k].gather(2, ids[..., None])[..., 0]
    ok = u[:, :k] * q_tok < p_tok  # exact in float64: both factors come from float32 or narrower
    accepted = ok.sum(1)
    emitted = ok.long().cumprod(1).sum(1)  # the leading run of acceptances

    dist = final_distribution(draft_probs, target_probs, emitted)
    threshold = u[:, k] * dist.sum(1)
    positive = dist > 0
    hit = (dist.cumsum(1) > threshold[:, None]) & positive
    first_hit = hit.long().argmax(1)
    last_positive = torch.where(positive.any(1), vocab - 1 - positive.flip(1).long().argmax(1), 0)
    token = torch.where(hit.any(1), first_hit, last_positive)

    out = torch.full((batch, k + 1), -1, dtype=torch.long, device=device)
    positions = torch.arange(k + 1, device=device)
    drafts = torch.cat([ids, ids.new_zeros(batch, 1)], 1)
    out = torch.where(positions < emitted[:, None], drafts, out)
    out = torch.where(positions == emitted[:, None], token[:, None], out)
    return out.int(), accepted.int(), emitted.int()


def final_distribution(draft_probs: torch.Tensor, target_probs: torch.Tensor, emitted: torch.Tensor) -> torch.Tensor:
    """(B, V) float64, unnormalised: what each request's final token is drawn from, given the
    number of drafts it emitted: the residual max(0, p_n - q_n) after a rejection at n < K,
    p_n itself where that residual has no mass, p_K after K acceptances."""
    batch, k, _ = draft_probs.shape
    rows = torch.arange(batch, device=draft_probs.device)
    emitted = emitted.long()
    p_final = target_probs[rows, emitted].double()
    if k:
        q_final = torch.where((emitted < k)[:, None], draft_probs[rows, emitted.clamp(max=k - 1)].double(), 0.0)
    else:
        q_final = torch.zeros_like(p_final)
    residual = (p_final - q_final).clamp(min=0)
    return torch.where((residual.sum(1) > 0)[:, None], residual, p_final)

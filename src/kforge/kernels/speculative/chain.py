"""Chain speculative sampling in Triton: one program per request verifies its K draft tokens
and draws the final token, following `reference.py`'s rule and draws exactly.

Work per request: the acceptance tests read 2K scalars (q_j(x_j), p_j(x_j)) and are one
vector op over K; the final token reads one row of p (and, after a rejection, of q) twice,
once to sum the residual and once to find where its running sum crosses u * sum. So a
request moves at most 4 V x 4 bytes (fp32 rows) and usually less, since the second pass
stops loading once the token is found; at B = 64, V = 128k that is at most 128 MB,
~40 us of HBM on an H100, and the usual case is half. No FLOPs worth counting: the kernel
is bytes and latency.

Why this shape:
- One program per request because the requests are independent and each is a short
  sequential walk; B = 1..256 programs. With a vocabulary of 128k and BLOCK_V = 1024 a
  program loops 128 blocks per pass; that is the latency a request pays, and the batch
  hides it only when B fills the SMs. (Splitting a row over programs would need a second
  launch for the prefix sum; not worth it at decode batch sizes.)
- The acceptance walk is vectorised: all K tests at once, the first rejection by a min over
  positions, so no early exit or serial loop over K is needed.
- Inverse CDF, not the exponential race: it needs one uniform per request (the race needs
  V), so the draws are a small (B, K + 1) tensor a PyTorch reference can share, and the
  kernel and the reference can agree token for token. The price is the second pass.
- The draws are given (`uniforms`) or made here from a seed (SEEDED: Philox counters,
  `draws.py`): K + 1 hashes a request, no tensor to fill and no launch before this one.
- The residual is never materialised: max(0, p - keep * q) is recomputed from the loaded
  rows in each pass (keep = 0 falls back to p where the residual has no mass).
- Sums in fp32 (the reference's are float64): the two can disagree only when u * sum lands
  within rounding of a boundary of the running sum, a probability around V x 1e-7 per
  request for the tests' small vocabularies.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kforge.kernels.speculative.draws import check_seed, draw, seed_in_memory

PROB_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BLOCK_V = 1024


@triton.jit
def chain_speculative_sampling_kernel(
        draft_probs_ptr, draft_ids_ptr, target_probs_ptr, uniforms_ptr, out_ptr, accepted_ptr, emitted_ptr,
        stride_db, stride_dk, stride_ib, stride_tb, stride_tk, stride_ub, stride_ob,
        K, V, seed, offset, seed_ptr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, SEEDED: tl.constexpr,
        SEED_IN_MEMORY: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    is_draft = offs_k < K
    ids = tl.load(draft_ids_ptr + row * stride_ib + offs_k, mask=is_draft, other=0).to(tl.int64)
    q_tok = tl.load(draft_probs_ptr + row * stride_db + offs_k * stride_dk + ids, mask=is_draft, other=0.0)
    p_tok = tl.load(target_probs_ptr + row * stride_tb + offs_k * stride_tk + ids, mask=is_draft, other=0.0)
    u_row = uniforms_ptr + row * stride_ub
    if SEED_IN_MEMORY:  # a seed tensor: (seed, offset) read as the kernel runs (a CUDA graph replays them)
        seed = tl.load(seed_ptr)
        offset = tl.load(seed_ptr + 1)
    first = offset + row * (K + 1)  # this request's first Philox counter (SEEDED)
    u = draw(u_row, seed, first, offs_k, is_draft, SEEDED)
    ok = (u * q_tok.to(tl.float32) < p_tok.to(tl.float32)) & is_draft
    accepted = tl.sum(ok.to(tl.int32), 0)
    emitted = tl.min(tl.where(is_draft & ~ok, offs_k, K), 0)  # the first rejection, or K

    p_row = target_probs_ptr + row * stride_tb + emitted.to(tl.int64) * stride_tk
    q_row = draft_probs_ptr + row * stride_db + emitted.to(tl.int64) * stride_dk
    has_draft = emitted < K  # rejected draft `emitted`: residual of p and q; else the bonus, from p
    offs_v = tl.arange(0, BLOCK_V)

    residual_sum = 0.0
    target_sum = 0.0
    for v0 in range(0, V, BLOCK_V):
        live = v0 + offs_v < V
        p = tl.load(p_row + v0 + offs_v, mask=live, other=0.0).to(tl.float32)
        q = tl.load(q_row + v0 + offs_v, mask=live & has_draft, other=0.0).to(tl.float32)
        residual_sum += tl.sum(tl.maximum(p - q, 0.0), 0)
        target_sum += tl.sum(p, 0)
    use_residual = residual_sum > 0.0
    keep = tl.where(use_residual, 1.0, 0.0)  # 0: the residual has no mass, draw from p itself
    threshold = draw(u_row, seed, first, K, True, SEEDED) * tl.where(use_residual, residual_sum, target_sum)

    running = 0.0
    token = V  # not found yet
    last_positive = -1
    for v0 in range(0, V, BLOCK_V):
        if token == V:  # blocks after the one holding the token are not read
            live = v0 + offs_v < V
            p = tl.load(p_row + v0 + offs_v, mask=live, other=0.0).to(tl.float32)
            q = tl.load(q_row + v0 + offs_v, mask=live & has_draft, other=0.0).to(tl.float32)
            r = tl.maximum(p - keep * q, 0.0)
            positive = (r > 0.0) & live
            crossed = (running + tl.cumsum(r, 0) > threshold) & positive
            token = tl.minimum(token, tl.min(tl.where(crossed, v0 + offs_v, V), 0))
            last_positive = tl.maximum(last_positive, tl.max(tl.where(positive, v0 + offs_v, -1), 0))
            running += tl.sum(r, 0)
    token = tl.where(token < V, token, tl.maximum(last_positive, 0))  # rounding left u * sum >= the sum

    offs_o = tl.arange(0, 2 * BLOCK_K)  # positions 0..K
    drafts = tl.load(draft_ids_ptr + row * stride_ib + offs_o, mask=offs_o < K, other=0)
    out = tl.where(offs_o < emitted, drafts, tl.where(offs_o == emitted, token, -1))
    tl.store(out_ptr + row * stride_ob + offs_o, out.to(tl.int32), mask=offs_o <= K)
    tl.store(accepted_ptr + row, accepted)
    tl.store(emitted_ptr + row, emitted)


def check_chain_inputs(draft_probs: torch.Tensor, draft_token_ids: torch.Tensor, target_probs: torch.Tensor,
                       uniforms: torch.Tensor | None) -> None:
    """Raise ValueError on shapes, dtypes, devices or strides the kernel cannot take (no device read)."""
    if draft_probs.dim() != 3:
        raise ValueError(f"draft_probs must be (batch, num_drafts, vocab), got {tuple(draft_probs.shape)}")
    batch, k, vocab = draft_probs.shape
    if vocab == 0:
        raise ValueError("the vocabulary is empty")
    if target_probs.shape != (batch, k + 1, vocab):
        raise ValueError(f"target_probs must be (batch, num_drafts + 1, vocab) = {(batch, k + 1, vocab)}, got "
                         f"{tuple(target_probs.shape)}")
    if draft_token_ids.shape != (batch, k):
        raise ValueError(f"draft_token_ids must be (batch, num_drafts) = {(batch, k)}, got "
                         f"{tuple(draft_token_ids.shape)}")
    if draft_probs.dtype not in PROB_DTYPES or target_probs.dtype not in PROB_DTYPES:
        raise ValueError(f"probabilities must be float32, float16 or bfloat16, got {draft_probs.dtype} and "
                         f"{target_probs.dtype}")
    if draft_token_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"draft_token_ids must be int32 or int64, got {draft_token_ids.dtype}")
    tensors = {"draft_probs": draft_probs, "draft_token_ids": draft_token_ids, "target_probs": target_probs}
    if uniforms is not None:
        if uniforms.shape != (batch, k + 1) or uniforms.dtype != torch.float32:
            raise ValueError(f"uniforms must be float32 (batch, num_drafts + 1) = {(batch, k + 1)}, got "
                             f"{uniforms.dtype} {tuple(uniforms.shape)}")
        tensors["uniforms"] = uniforms
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        where = ", ".join(f"{name} {t.device}" for name, t in tensors.items())
        raise ValueError(f"the inputs are on different devices: {where}")
    for name, t in tensors.items():
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dimension, got strides {t.stride()}")


def check_draws(uniforms: torch.Tensor | None, seed: int | torch.Tensor | None, offset: int) -> None:
    """Raise ValueError unless exactly one of `uniforms` and `seed` is given (and the seed is sane)."""
    if (uniforms is None) == (seed is None):
        raise ValueError("give the draws as uniforms or as a seed (and offset), not both and not neither")
    if seed is not None:
        check_seed(seed, offset)


def check_draft_ids(draft_token_ids: torch.Tensor, vocab: int) -> None:
    """Raise ValueError unless every draft id is a token of the vocabulary (one device read)."""
    if draft_token_ids.numel() == 0:
        return
    low, high = (int(x) for x in torch.stack([draft_token_ids.min(), draft_token_ids.max()]).tolist())
    if low < 0 or high >= vocab:
        raise ValueError(f"draft_token_ids must lie in [0, {vocab}), got values in [{low}, {high}]")


def chain_speculative_sampling(draft_probs: torch.Tensor, draft_token_ids: torch.Tensor, target_probs: torch.Tensor,
                               uniforms: torch.Tensor | None = None, *, seed: int | torch.Tensor | None = None,
                               offset: int = 0, validate: bool = True, block_v: int = BLOCK_V
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel: (output ids (B, K + 1), accepted (B,), emitted (B,)), all int32; see
    `reference.py` for the rule. The draws: `uniforms` (B, K + 1), or `seed` (and `offset`):
    u[b, j] = Philox(seed, offset + b (K + 1) + j) made in the kernel (`draws.py`; the
    reference takes `draws.philox_uniforms(seed, offset, (B, K + 1))`), the seed and offset
    given as integers or as a seed tensor on the inputs' device (`draws.py`). `validate` reads the
    draft ids back once to refuse ids outside the vocabulary; `block_v` (a power of two) is the
    vocabulary tile, small in the CPU tests."""
    check_chain_inputs(draft_probs, draft_token_ids, target_probs, uniforms)
    check_draws(uniforms, seed, offset)
    batch, k, vocab = draft_probs.shape
    if validate:
        check_draft_ids(draft_token_ids, vocab)
    device = draft_probs.device
    out = torch.empty((batch, k + 1), dtype=torch.int32, device=device)
    accepted = torch.empty(batch, dtype=torch.int32, device=device)
    emitted = torch.empty(batch, dtype=torch.int32, device=device)
    if batch == 0:
        return out, accepted, emitted
    block_k = max(2, triton.next_power_of_2(k))  # 2 * block_k > k covers the K + 1 outputs
    block_v = min(block_v, max(16, triton.next_power_of_2(vocab)))
    draws = uniforms if uniforms is not None else out  # not read when seeded
    in_memory = seed_in_memory(seed, device)
    chain_speculative_sampling_kernel[(batch,)](
        draft_probs, draft_token_ids, target_probs, draws, out, accepted, emitted,
        draft_probs.stride(0), draft_probs.stride(1), draft_token_ids.stride(0), target_probs.stride(0),
        target_probs.stride(1), draws.stride(0), out.stride(0), k, vocab, 0 if in_memory else seed or 0, offset,
        seed if in_memory else out, BLOCK_K=block_k, BLOCK_V=block_v, SEEDED=uniforms is None,
        SEED_IN_MEMORY=in_memory, num_warps=4)
    return out, accepted, emitted

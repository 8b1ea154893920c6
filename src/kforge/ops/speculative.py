"""`kforge.ops.chain_speculative_sampling(draft_probs, draft_token_ids, target_probs, ...)`: verify a
chain of K draft tokens against the target model's probabilities, FlashInfer's contract; and
`kforge.ops.tree_verify(tokens, first_child, next_sibling, target_probs, ...)`: verify a tree of
draft tokens (greedy, target-only, or with the draft's probabilities; `kernels/speculative/tree.py`).

    out, accepted, emitted = chain_speculative_sampling(draft_probs, draft_ids, target_probs,
                                                        generator=g)
    # out (B, K + 1) int32: emitted[b] drafts, then one token from the residual or the bonus, then -1

draft_probs (B, K, V), draft_token_ids (B, K), target_probs (B, K + 1, V). The draws are
`uniforms` (B, K + 1) float32 in [0, 1) if given; or, with `seed` (and `offset`), Philox
counters made inside the kernel, u[b, j] = Philox(seed, offset + b (K + 1) + j), no tensor of
draws at all (`kernels/speculative/draws.py`; `philox_uniforms(seed, offset, (B, K + 1))` is
the same tensor on the host); the seed may be a seed tensor, int64 (seed, offset) on the
inputs' device, read when the kernel runs, so a captured CUDA graph replays with fresh
counters once the caller advances it in place; else drawn with torch.rand from `generator`
on the inputs' device. The same draws give the same tokens on the kernel and on the reference
(`kforge.kernels.speculative.reference`, whose docstring states the rule).
`accepted` counts the drafts that pass the test each on its own, `emitted` the drafts
emitted before the first rejection.

Each is a `torch.library` custom op (`kforge::chain_speculative_sampling`, `kforge::tree_verify`)
with a fake implementation;
a generator's draws are made outside it (a Generator is no custom-op argument), a seed's inside. The Triton kernel runs on
CUDA tensors; elsewhere the op runs the float64 reference. validate=True (the default) reads
the draft ids back once to refuse ids outside the vocabulary.
"""

from __future__ import annotations

import torch

from kforge.kernels.speculative.chain import check_chain_inputs, check_draft_ids, check_draws
from kforge.kernels.speculative.draws import philox_uniforms, seed_values
from kforge.kernels.speculative.reference import chain_speculative_sampling_reference
from kforge.kernels.speculative.tree import (check_tree_draws, check_tree_inputs, check_tree_values,
                                             tree_verify_reference)


@torch.library.custom_op("kforge::chain_speculative_sampling", mutates_args=())
def _chain_speculative_sampling(draft_probs: torch.Tensor, draft_token_ids: torch.Tensor, target_probs: torch.Tensor,
                                uniforms: torch.Tensor | None, seed: int | None, seed_tensor: torch.Tensor | None,
                                offset: int, validate: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_chain_inputs(draft_probs, draft_token_ids, target_probs, uniforms)
    seed = seed_tensor if seed_tensor is not None else seed
    check_draws(uniforms, seed, offset)
    if validate:
        check_draft_ids(draft_token_ids, draft_probs.shape[2])
    if draft_probs.is_cuda:
        from kforge.kernels.speculative.chain import chain_speculative_sampling as kernel

        return kernel(draft_probs, draft_token_ids, target_probs, uniforms, seed=seed, offset=offset,
                      validate=False)
    if uniforms is None:
        batch, k, _ = draft_probs.shape
        uniforms = philox_uniforms(*seed_values(seed, offset), (batch, k + 1), draft_probs.device)
    return chain_speculative_sampling_reference(draft_probs, draft_token_ids, target_probs, uniforms)


@_chain_speculative_sampling.register_fake
def _(draft_probs, draft_token_ids, target_probs, uniforms, seed, seed_tensor, offset, validate):
    batch, k, _ = draft_probs.shape
    return (draft_probs.new_empty((batch, k + 1), dtype=torch.int32),
            draft_probs.new_empty((batch,), dtype=torch.int32), draft_probs.new_empty((batch,), dtype=torch.int32))


def chain_speculative_sampling(draft_probs: torch.Tensor, draft_token_ids: torch.Tensor, target_probs: torch.Tensor,
                               uniforms: torch.Tensor | None = None, *, seed: int | torch.Tensor | None = None,
                               offset: int = 0, generator: torch.Generator | None = None, validate: bool = True
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output ids (B, K + 1), accepted (B,), emitted (B,)), int32; each emitted token is distributed
    as the target's probabilities at its position. Pass `uniforms` (B, K + 1), a `seed` (and
    `offset`: advance it by B (K + 1) a step for fresh counters; or a seed tensor, module
    docstring) or a `generator`."""
    check_chain_inputs(draft_probs, draft_token_ids, target_probs, uniforms)
    if uniforms is None and seed is None:
        batch, k, _ = draft_probs.shape
        uniforms = torch.rand((batch, k + 1), generator=generator, dtype=torch.float32, device=draft_probs.device)
    check_draws(uniforms, seed, offset)
    tensor = seed if isinstance(seed, torch.Tensor) else None
    return _chain_speculative_sampling(draft_probs, draft_token_ids, target_probs, uniforms,
                                       None if tensor is not None else seed, tensor, int(offset), bool(validate))


@torch.library.custom_op("kforge::tree_verify", mutates_args=())
def _tree_verify(tokens: torch.Tensor, first_child: torch.Tensor, next_sibling: torch.Tensor,
                 target_probs: torch.Tensor, uniforms: torch.Tensor | None, draft_probs: torch.Tensor | None,
                 mode: str, seed: int | None, seed_tensor: torch.Tensor | None, offset: int, validate: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    seed = seed_tensor if seed_tensor is not None else seed
    seeded = check_tree_draws(uniforms, seed, offset, mode)
    check_tree_inputs(tokens, first_child, next_sibling, target_probs, draft_probs, uniforms, mode, seeded)
    if validate:
        check_tree_values(tokens, first_child, next_sibling, target_probs.shape[2])
    if target_probs.is_cuda:
        from kforge.kernels.speculative.tree import tree_verify as kernel

        return kernel(tokens, first_child, next_sibling, target_probs, uniforms, draft_probs=draft_probs, mode=mode,
                      seed=seed, offset=offset, validate=False)
    if seeded:
        uniforms = philox_uniforms(*seed_values(seed, offset), tuple(tokens.shape), target_probs.device)
    return tree_verify_reference(tokens, first_child, next_sibling, target_probs, uniforms, draft_probs=draft_probs,
                                 mode=mode)


@_tree_verify.register_fake
def _(tokens, first_child, next_sibling, target_probs, uniforms, draft_probs, mode, seed, seed_tensor, offset,
      validate):
    batch, nodes = tokens.shape
    return (tokens.new_empty((batch, nodes)), tokens.new_empty((batch, nodes)), tokens.new_empty((batch,)))


def tree_verify(tokens: torch.Tensor, first_child: torch.Tensor, next_sibling: torch.Tensor,
                target_probs: torch.Tensor, uniforms: torch.Tensor | None = None, *,
                draft_probs: torch.Tensor | None = None, mode: str = "target_only",
                seed: int | torch.Tensor | None = None, offset: int = 0, generator: torch.Generator | None = None,
                validate: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out_ids (B, N), out_nodes (B, N), emitted (B,)), int32: the accepted path through each
    request's draft tree and one final token. Random modes take `uniforms` (B, N), a `seed` (and
    `offset`: u[b, x] = Philox(seed, offset + b N + x), made in the kernel; or a seed tensor,
    module docstring) or draw them from `generator`; greedy takes none."""
    check_tree_draws(uniforms, seed, offset, mode)
    if seed is None and uniforms is None and mode != "greedy":
        batch, nodes = tokens.shape
        uniforms = torch.rand((batch, nodes), generator=generator, dtype=torch.float32, device=target_probs.device)
    tensor = seed if isinstance(seed, torch.Tensor) else None
    return _tree_verify(tokens, first_child, next_sibling, target_probs, uniforms, draft_probs, mode,
                        None if tensor is not None else seed, tensor, int(offset), bool(validate))

"""`kforge.ops.chain_speculative_sampling(draft_probs, draft_token_ids, target_probs, ...)`: verify a
chain of K draft tokens against the target model's probabilities, FlashInfer's contract; and
`kforge.ops.tree_verify(tokens, first_child, next_sibling, target_probs, ...)`: verify a tree of
draft tokens (greedy, target-only, or with the draft's probabilities; `kernels/speculative/tree.py`).

    out, accepted, emitted = chain_speculative_sampling(draft_probs, draft_ids, target_probs,
                                                        generator=g)
    # out (B, K + 1) int32: emitted[b] drafts, then one token from the residual or the bonus, then -1

draft_probs (B, K, V), draft_token_ids (B, K), target_probs (B, K + 1, V). The draws are
`uniforms` (B, K + 1) float32 in [0, 1) if given, else drawn with torch.rand from `generator`
on the inputs' device: the same draws give the same tokens on the kernel and on the
reference (`kforge.kernels.speculative.reference`, whose docstring states the rule).
`accepted` counts the drafts that pass the test each on its own, `emitted` the drafts
emitted before the first rejection.

Each is a `torch.library` custom op (`kforge::chain_speculative_sampling`, `kforge::tree_verify`)
with a fake implementation;
the draws are made outside it (a Generator is no custom-op argument). The Triton kernel runs on
CUDA tensors; elsewhere the op runs the float64 reference. validate=True (the default) reads
the draft ids back once to refuse ids outside the vocabulary.
"""

from __future__ import annotations

import torch

from kforge.kernels.speculative.chain import check_chain_inputs, check_draft_ids
from kforge.kernels.speculative.reference import chain_speculative_sampling_reference
from kforge.kernels.speculative.tree import check_tree_inputs, check_tree_values, tree_verify_reference


@torch.library.custom_op("kforge::chain_speculative_sampling", mutates_args=())
def _chain_speculative_sampling(draft_probs: torch.Tensor, draft_token_ids: torch.Tensor, target_probs: torch.Tensor,
                                uniforms: torch.Tensor, validate: bool
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_chain_inputs(draft_probs, draft_token_ids, target_probs, uniforms)
    if validate:
        check_draft_ids(draft_token_ids, draft_probs.shape[2])
    if draft_probs.is_cuda:
        from kforge.kernels.speculative.chain import chain_speculative_sampling as kernel

        return kernel(draft_probs, draft_token_ids, target_probs, uniforms, validate=False)
    return chain_speculative_sampling_reference(draft_probs, draft_token_ids, target_probs, uniforms)


@_chain_speculative_sampling.register_fake
def _(draft_probs, draft_token_ids, target_probs, uniforms, validate):
    batch, k, _ = draft_probs.shape
    return (draft_probs.new_empty((batch, k + 1), dtype=torch.int32),
            draft_probs.new_empty((batch,), dtype=torch.int32), draft_probs.new_empty((batch,), dtype=torch.int32))


def chain_speculative_sampling(draft_probs: torch.Tensor, draft_token_ids: torch.Tensor, target_probs: torch.Tensor,
                               uniforms: torch.Tensor | None = None, *, generator: torch.Generator | None = None,
                               validate: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output ids (B, K + 1), accepted (B,), emitted (B,)), int32; each emitted token is distributed
    as the target's probabilities at its position. Pass `uniforms` (B, K + 1) or a `generator`."""
    check_chain_inputs(draft_probs, draft_token_ids, target_probs, uniforms)
    if uniforms is None:
        batch, k, _ = draft_probs.shape
        uniforms = torch.rand((batch, k + 1), generator=generator, dtype=torch.float32, device=draft_probs.device)
    return _chain_speculative_sampling(draft_probs, draft_token_ids, target_probs, uniforms, bool(validate))


@torch.library.custom_op("kforge::tree_verify", mutates_args=())
def _tree_verify(tokens: torch.Tensor, first_child: torch.Tensor, next_sibling: torch.Tensor,
                 target_probs: torch.Tensor, uniforms: torch.Tensor | None, draft_probs: torch.Tensor | None,
                 mode: str, validate: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_tree_inputs(tokens, first_child, next_sibling, target_probs, draft_probs, uniforms, mode)
    if validate:
        check_tree_values(tokens, first_child, next_sibling, target_probs.shape[2])
    if target_probs.is_cuda:
        from kforge.kernels.speculative.tree import tree_verify as kernel

        return kernel(tokens, first_child, next_sibling, target_probs, uniforms, draft_probs=draft_probs, mode=mode,
                      validate=False)
    return tree_verify_reference(tokens, first_child, next_sibling, target_probs, uniforms, draft_probs=draft_probs,
                                 mode=mode)


@_tree_verify.register_fake
def _(tokens, first_child, next_sibling, target_probs, uniforms, draft_probs, mode, validate):
    batch, nodes = tokens.shape
    return (tokens.new_empty((batch, nodes)), tokens.new_empty((batch, nodes)), tokens.new_empty((batch,)))


def tree_verify(tokens: torch.Tensor, first_child: torch.Tensor, next_sibling: torch.Tensor,
                target_probs: torch.Tensor, uniforms: torch.Tensor | None = None, *,
                draft_probs: torch.Tensor | None = None, mode: str = "target_only",
                generator: torch.Generator | None = None, validate: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out_ids (B, N), out_nodes (B, N), emitted (B,)), int32: the accepted path through each
    request's draft tree and one final token. Random modes take `uniforms` (B, N) or draw them
    from `generator`; greedy takes none."""
    if uniforms is None and mode != "greedy":
        batch, nodes = tokens.shape
        uniforms = torch.rand((batch, nodes), generator=generator, dtype=torch.float32, device=target_probs.device)
    return _tree_verify(tokens, first_child, next_sibling, target_probs, uniforms, draft_probs, mode, bool(validate))

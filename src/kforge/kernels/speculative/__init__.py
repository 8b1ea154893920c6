"""Speculative decoding: verifying a draft model's tokens against the target model's
probabilities so that the emitted tokens are distributed exactly as the target's samples.

- `reference.py`: chain speculative sampling in PyTorch (float64), given the uniform draws:
  the specification the kernel is tested against.
- `chain.py`: the Triton kernel, one program per request, and the input checks.
- `tree.py`: tree verification (greedy, target-only, with draft probabilities: SpecInfer's
  multi-draft rejection sampling), the Triton kernel and its float64 reference.
- `draws.py`: the counter-based draws (Philox, as Triton's `tl.rand`) the kernels make from a
  seed, and the same numbers on the host for the references.
`kforge.ops.chain_speculative_sampling` wraps the kernel as a PyTorch operator.
"""

"""Attention forward: the online softmax, naive attention, and a FlashAttention kernel in Triton.

- `online_softmax.py`: the algorithm on a list of numbers, tile by tile (what
  `kforge trace online-softmax` prints), checked against the softmax of everything at once.
- `naive.py`: the N x N score matrix; the reference and the "before" picture.
- `flash_forward.py`: the Triton kernel (bf16, fp16, fp32; head dims 16..256; causal;
  grouped-query; any lengths), returning O and the log-sum-exp.
`kforge.ops.flash_attention` wraps the kernel as a PyTorch operator; `kforge bench
attention` times it against every SDPA backend.
"""


"""Attention: the online softmax, naive attention, and FlashAttention kernels in Triton (forward, backward).

- `online_softmax.py`: the algorithm on a list of numbers, tile by tile (what
  `kforge trace online-softmax` prints), checked against the softmax of everything at once.
- `naive.py`: the N x N score matrix; the reference and the "before" picture.
- `flash_forward.py`: the Triton kernel (bf16, fp16, fp32; head dims 16..256; causal;
  grouped-query; any lengths), returning O and the log-sum-exp.
- `flash_backward.py`: dQ, dK, dV in Triton from O and the log-sum-exp (dQ by its own kernel,
  bit-identical run to run, or by fp32 atomics).
- `flash_fp8.py`: the forward with Q K^T and P V in FP8 (e4m3: K smoothed, per-token Q and K
  scales, per-channel V scale), bf16/fp16 in and out.
`kforge.ops.flash_attention` wraps both as a PyTorch operator with autograd; `kforge bench
attention` times the forward against every SDPA backend, `--backward` the backward.
"""


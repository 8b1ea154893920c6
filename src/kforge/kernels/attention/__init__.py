"""Attention: the online softmax, naive attention, and FlashAttention kernels in Triton (forward, backward) and CUDA.

- `online_softmax.py`: the algorithm on a list of numbers, tile by tile (what
  `kforge trace online-softmax` prints), checked against the softmax of everything at once.
- `naive.py`: the N x N score matrix; the reference and the "before" picture.
- `flash_forward.py`: the Triton kernel (bf16, fp16, fp32; head dims 16..256; causal;
  grouped-query; any lengths), returning O and the log-sum-exp.
- `flash_backward.py`: dQ, dK, dV in Triton from O and the log-sum-exp (dQ by its own kernel,
  bit-identical run to run, or by fp32 atomics).
- `flash_fp8.py`: the forward with Q K^T and P V in FP8 (e4m3: K smoothed, per-token Q and K
  scales, per-channel V scale), bf16/fp16 in and out.
- `flash_hopper.py`, `flash_hopper.cu`, `hopper_attention.cuh`: the forward in CUDA for Hopper
  (TMA-fed K and V rings, two consumer warpgroups in ping-pong, the softmax under the
  previous tile's P V); bf16/fp16, head dims 64 and 128, causal, grouped-query. On the H200
  0.81-1.06x cuDNN (docs/attention.md).
`kforge.ops.flash_attention` wraps the forwards (the CUDA one at head dim 128 on sm_90, Triton's
elsewhere) and the Triton backward as a PyTorch operator with autograd; `kforge bench attention`
times the forward against every SDPA backend, `--backward` the backward.
"""


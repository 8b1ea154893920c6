"""FlashAttention forward with FP8 (e4m3) operands, in Triton: Q K^T and P V on Hopper's FP8
tensor cores (twice the bf16 rate), accumulated in fp32, as `flash_forward.py` walks the keys.

Quantization (`quantize_qkv`, Triton passes before the kernel), following SageAttention's recipe:
- K is smoothed first: k' = k - mean_t(k), the mean over the keys of each (batch, kv head,
  channel). A query row's scores all drop by the same q . mean, which the softmax does not see,
  and K's channel-wise offsets (large in trained models) no longer eat its FP8 range.
- Q gets one scale per row and K one per key (amax / 448, e4m3's largest normal): a tile of
  scores is dot(q8, k8^T) * (s_q s_k^T), one multiply an element on the fp32 tile, as a single
  block scale would cost, and each token uses the whole FP8 range.
- V gets one scale per channel (over all keys) and is stored transposed, (d, keys): the FP8
  wgmma reads both operands K-major, and for P V that is the key axis of V.
- P, each row's exp2(s - m) in [0, 1], is rounded to e4m3 before P V (FA3's choice); the row
  sums l are kept in fp32 from the unrounded P. `pv_fp8=False` keeps P V in bf16 (V as given)
  for the accuracy comparison.
The LSE the kernel sees is of the smoothed scores; the wrapper adds scale * q . mean back, so
the LSE returned is the true one.

Work and bytes: the same 4 N^2 d FLOPs per head as the bf16 kernel, at the FP8 rate (989
TFLOP/s dense on an H100 SXM against 495 for bf16); Q, K, V are read as one byte an element
instead of two. The quantization pass reads q, k, v in bf16 once and writes them in FP8 (3 n d
x 3 bytes a head, a memory-bound pass; K and V are read once more for their means and amaxes):
part of the op's time, so part of any speedup quoted (about 0.26 ms of 1.86 on an H200 at
B 8, H 16, N 4096, hd 128).

Accuracy (tests/kernels/test_flash_fp8.py, CPU interpreter, which accumulates exactly in fp32;
Hopper's FP8 wgmma accumulates in fewer bits, so the GPU's error can be larger) and speed on an
H200 (B 8, H 16, N 4096, hd 128: 1.19x our bf16 forward with the quantization, 1.38x the kernel
alone): docs/attention.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kforge.kernels.attention.flash_forward import (
    LOG2E,
    check_attention_inputs,
    key_range,
)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
# (BLOCK_M, BLOCK_N), warps, stages: the fastest of 32 configs that compile, timed on an H200
# (2026-11-28, B 8, H 16, N 4096, hd 128, full; `python scripts/fp8_attention_speed.py --sweep`):
# 64 x 128 with one warpgroup, 580 TFLOP/s, against 461 for the 128 x 128, 8-warp tile first chosen
GPU_BLOCKS = (64, 128)
GPU_WARPS, GPU_STAGES = 4, 3
INTERPRETER_BLOCKS = (32, 16)
HEAD_DIMS = (64, 128)


@dataclass(frozen=True)
class Fp8QKV:
    """What the kernel reads: the FP8 tensors, their scales, and what undoes the smoothing."""

    q: torch.Tensor  # (B, H, Nq, d) e4m3
    q_scale: torch.Tensor  # (B, H, Nq) fp32, a row's
    k: torch.Tensor  # (B, Hkv, Nk, d) e4m3, smoothed
    k_scale: torch.Tensor  # (B, Hkv, Nk) fp32, a key's
    v_t: torch.Tensor  # (B, Hkv, d, Nk padded to 16) e4m3: V transposed, for the K-major P V
    v_scale: torch.Tensor  # (B, Hkv, d) fp32
    k_mean: torch.Tensor  # (B, Hkv, d) fp32: what the smoothing took off
    q_shift: torch.Tensor  # (B, H, Nq) fp32: q . k_mean, what the smoothing took off each row's scores


@triton.jit
def quantize_rows_kernel(x_ptr, mean_ptr, out_ptr, scale_ptr, dot_ptr, n_rows, heads, kv_group,
                         stride_b, stride_h, stride_n,
                         HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr, SUBTRACT_MEAN: tl.constexpr,
                         DOT_MEAN: tl.constexpr):
    """One e4m3 scale per row of x (B, H, N, d), amax / 448, and the row cast with it. With
    SUBTRACT_MEAN the row first loses its head's channel means (K's smoothing); with DOT_MEAN the
    row's dot with its KV head's means is written too (Q's share of the LSE the smoothing moved)."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    batch_head = tl.program_id(1)
    batch, head = batch_head // heads, batch_head % heads
    cols = tl.arange(0, HEAD_DIM)
    inside = rows < n_rows
    x = tl.load(x_ptr + batch * stride_b + head * stride_h + rows[:, None] * stride_n + cols[None, :],
                mask=inside[:, None], other=0.0).to(tl.float32)
    mean_row = mean_ptr + (batch * (heads // kv_group) + head // kv_group) * HEAD_DIM + cols
    if SUBTRACT_MEAN:
        x = x - tl.load(mean_row)[None, :]
    amax = tl.max(tl.abs(x), 1)
    scale = tl.where(amax > 0, amax / 448.0, 1.0)
    x8 = tl.clamp(x / scale[:, None], -448.0, 448.0).to(out_ptr.dtype.element_ty)
    out_rows = batch_head * n_rows + rows
    tl.store(out_ptr + out_rows[:, None] * HEAD_DIM + cols[None, :], x8, mask=inside[:, None])
    tl.store(scale_ptr + out_rows, scale, mask=inside)
    if DOT_MEAN:
        tl.store(dot_ptr + out_rows, tl.sum(x * tl.load(mean_row)[None, :], 1), mask=inside)


@triton.jit
def quantize_v_transposed_kernel(v_ptr, scale_ptr, out_ptr, n_keys, n_padded, heads, stride_b, stride_h, stride_n,
                                 HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    """V (B, Hkv, N, d) over its per-channel scales, cast to e4m3 and stored transposed into
    (B, Hkv, d, N padded to 16); the padding columns get zeros."""
    keys = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    batch_head = tl.program_id(1)
    batch, head = batch_head // heads, batch_head % heads
    cols = tl.arange(0, HEAD_DIM)
    v = tl.load(v_ptr + batch * stride_b + head * stride_h + keys[:, None] * stride_n + cols[None, :],
                mask=(keys < n_keys)[:, None], other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + batch_head * HEAD_DIM + cols)
    v8 = tl.clamp(v / scale[None, :], -448.0, 448.0).to(out_ptr.dtype.element_ty)
    out = out_ptr + batch_head * HEAD_DIM * n_padded + cols[:, None] * n_padded + keys[None, :]
    tl.store(out, tl.trans(v8), mask=(keys < n_padded)[None, :])


def _quantize_rows(x: torch.Tensor, mean: torch.Tensor, kv_group: int, *, subtract: bool, dot: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    batch, heads, n, dim = x.shape
    if x.stride(3) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape, dtype=FP8, device=x.device)
    scale = torch.empty((batch, heads, n), dtype=torch.float32, device=x.device)
    dotted = torch.empty_like(scale) if dot else None
    rows = 16 if x.is_cuda else 8
    if out.numel():
        quantize_rows_kernel[(triton.cdiv(n, rows), batch * heads)](
            x, mean, out, scale, dotted, n, heads, kv_group, x.stride(0), x.stride(1), x.stride(2),
            HEAD_DIM=dim, BLOCK_ROWS=rows, SUBTRACT_MEAN=subtract, DOT_MEAN=dot, num_warps=4)
    return out, scale, dotted


def quantize_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Fp8QKV:
    """Q, K (smoothed), V to e4m3 with their scales (module docstring), in three Triton passes
    over Q, K and V and two reductions over K and V (each tensor read twice at most, the FP8
    copies written once); `quantize_qkv_reference` is the same in PyTorch, and what runs on a CPU:
    Triton 3.6's interpreter rounds fp32 to e4m3 half up and drops the carry into the exponent
    (124.3 becomes 64, not 128) unless `kforge.runtime.interpreter.mend_fp8_casts` has run, so
    the CPU tests call the kernels on exactly representable values."""
    if not q.is_cuda:
        return quantize_qkv_reference(q, k, v)
    batch, kv_heads, n_k, dim = k.shape
    group = q.shape[1] // kv_heads
    k_mean = k.mean(dim=2, dtype=torch.float32).contiguous()  # (B, Hkv, d)
    k8, k_scale, _ = _quantize_rows(k, k_mean, 1, subtract=True, dot=False)
    q8, q_scale, q_shift = _quantize_rows(q, k_mean, group, subtract=False, dot=True)
    v_amax = torch.linalg.vector_norm(v, ord=float("inf"), dim=2, dtype=torch.float32)  # (B, Hkv, d)
    v_scale = torch.where(v_amax > 0, v_amax / FP8_MAX, torch.ones_like(v_amax)).contiguous()
    padded = n_k + -n_k % 16  # 16-byte rows for TMA
    v_t = torch.empty((batch, kv_heads, dim, padded), dtype=FP8, device=v.device)
    if v.stride(3) != 1:
        v = v.contiguous()
    if v_t.numel():
        quantize_v_transposed_kernel[(triton.cdiv(padded, 64), batch * kv_heads)](
            v, v_scale, v_t, n_k, padded, kv_heads, v.stride(0), v.stride(1), v.stride(2), HEAD_DIM=dim, BLOCK_N=64,
            num_warps=4)
    return Fp8QKV(q8, q_scale, k8, k_scale, v_t, v_scale, k_mean, q_shift)


def _row_scales(x: torch.Tensor) -> torch.Tensor:
    """amax / 448 of each row of (B, H, N, d): (B, H, N); 1 for a row of zeros."""
    amax = x.float().abs().amax(-1)
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def _to_fp8(x: torch.Tensor, scale_per_row: torch.Tensor) -> torch.Tensor:
    return (x.float() / scale_per_row).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_qkv_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Fp8QKV:
    """`quantize_qkv` in PyTorch: the definition its kernels are tested against."""
    k_mean = k.float().mean(dim=2)  # (B, Hkv, d)
    k_smooth = k.float() - k_mean[:, :, None]
    q_scale, k_scale = _row_scales(q), _row_scales(k_smooth)
    q8 = _to_fp8(q, q_scale[..., None])
    k8 = _to_fp8(k_smooth, k_scale[..., None])
    v_amax = v.float().abs().amax(dim=2)  # (B, Hkv, d)
    v_scale = torch.where(v_amax > 0, v_amax / FP8_MAX, torch.ones_like(v_amax))
    v_t = _to_fp8(v.float().transpose(2, 3), v_scale[..., None])  # (B, Hkv, d, Nk)
    v_t = torch.nn.functional.pad(v_t.view(torch.uint8), (0, -v.shape[2] % 16)).view(FP8)  # 16-byte rows for TMA
    group = q.shape[1] // k.shape[1]
    q_shift = torch.einsum("bhnd,bhd->bhn", q.float(), k_mean.repeat_interleave(group, 1))
    return Fp8QKV(q8, q_scale, k8, k_scale, v_t.contiguous(), v_scale, k_mean, q_shift)


@triton.jit
def _fp8_key_blocks(acc, l_i, m_i, q, q_scale, k_desc, v_desc, k_scale_row, batch, kv_head, offs_m, lo, hi, n_k,
                    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr,
                    CAUSAL: tl.constexpr, PV_FP8: tl.constexpr):
    for start_n in tl.range(lo, hi, BLOCK_N):
        k = k_desc.load([batch, kv_head, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k_scale = tl.load(k_scale_row + offs_n, mask=offs_n < n_k, other=0.0)
        # the tile's dequantization and the softmax scale (log2 units, folded into q_scale): one multiply
        s = tl.dot(q, k.T) * (q_scale[:, None] * k_scale[None, :])
        if MASKED:
            keep = offs_n[None, :] < n_k
            if CAUSAL:
                keep = keep & (offs_m[:, None] >= offs_n[None, :])
            s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if PV_FP8:  # V^T's tile (d, BLOCK_N): its transpose is K-major for the FP8 wgmma
            v_t = v_desc.load([batch, kv_head, 0, start_n]).reshape(HEAD_DIM, BLOCK_N)
            acc = tl.dot(p.to(v_t.dtype), v_t.T, acc * alpha[:, None])
        else:
            v = v_desc.load([batch, kv_head, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def flash_fp8_kernel(q_desc, k_desc, v_desc, o_desc, q_scale_ptr, k_scale_ptr, v_scale_ptr, lse_ptr,
                     n_q, n_k, heads, kv_group, qk_scale,
                     HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                     PV_FP8: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    batch_head = tl.program_id(1)
    batch, head = batch_head // heads, batch_head % heads
    kv_head = head // kv_group
    kv_batch_head = batch * (heads // kv_group) + kv_head
    offs_m = start_m + tl.arange(0, BLOCK_M)

    q = q_desc.load([batch, head, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
    q_scale = tl.load(q_scale_ptr + batch_head * n_q + offs_m, mask=offs_m < n_q, other=0.0) * qk_scale
    k_scale_row = k_scale_ptr + kv_batch_head * n_k
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    unmasked_hi, hi = key_range(start_m, n_k, BLOCK_M, BLOCK_N, CAUSAL)
    acc, l_i, m_i = _fp8_key_blocks(acc, l_i, m_i, q, q_scale, k_desc, v_desc, k_scale_row, batch, kv_head, offs_m,
                                    0, unmasked_hi, n_k, BLOCK_N, HEAD_DIM, False, CAUSAL, PV_FP8)
    acc, l_i, m_i = _fp8_key_blocks(acc, l_i, m_i, q, q_scale, k_desc, v_desc, k_scale_row, batch, kv_head, offs_m,
                                    unmasked_hi, hi, n_k, BLOCK_N, HEAD_DIM, True, CAUSAL, PV_FP8)

    acc = acc / l_i[:, None]
    if PV_FP8:  # V's per-channel scale, once, on the output
        acc = acc * tl.load(v_scale_ptr + kv_batch_head * HEAD_DIM + tl.arange(0, HEAD_DIM))[None, :]
    o_desc.store([batch, head, start_m, 0], acc.to(o_desc.dtype).reshape(1, 1, BLOCK_M, HEAD_DIM))
    lse = (m_i + tl.math.log2(l_i)) / 1.4426950408889634
    tl.store(lse_ptr + batch_head * n_q + offs_m, lse, mask=offs_m < n_q)


def flash_attention_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                        scale: float | None = None, pv_fp8: bool = True, blocks: tuple[int, int] | None = None,
                        num_warps: int = GPU_WARPS, num_stages: int = GPU_STAGES, quantized: Fp8QKV | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, LSE) as `flash_forward.flash_attention_forward` returns them, for bf16/fp16 q (B, H,
    Nq, d), k and v (B, Hkv, Nk, d), d of 64 or 128, with Q K^T (and, with pv_fp8, P V) in FP8.
    `blocks` (BLOCK_M, BLOCK_N) is the tiling (small under the interpreter); `quantized` is
    `quantize_qkv(q, k, v)` done beforehand (a cache kept in FP8), else it is done here."""
    scale = check_attention_inputs(q, k, v, scale)
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"the FP8 forward takes bfloat16 or float16 inputs (it quantizes them), got {q.dtype}")
    batch, heads, n_q, dim = q.shape
    if dim not in HEAD_DIMS:
        raise ValueError(f"the FP8 forward takes head_dim {' or '.join(map(str, HEAD_DIMS))}, got {dim}")
    n_k = k.shape[2]
    block_m, block_n = blocks or (GPU_BLOCKS if q.is_cuda else INTERPRETER_BLOCKS)
    fp8 = quantize_qkv(q, k, v) if quantized is None else quantized
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads, n_q), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    v_operand = fp8.v_t if pv_fp8 else v
    v_block = [1, 1, dim, block_n] if pv_fp8 else [1, 1, block_n, dim]
    descs = [TensorDescriptor.from_tensor(fp8.q, [1, 1, block_m, dim]),
             TensorDescriptor.from_tensor(fp8.k, [1, 1, block_n, dim]),
             TensorDescriptor.from_tensor(v_operand, v_block),
             TensorDescriptor.from_tensor(out, [1, 1, block_m, dim])]
    grid = (triton.cdiv(n_q, block_m), batch * heads)
    flash_fp8_kernel[grid](*descs, fp8.q_scale, fp8.k_scale, fp8.v_scale, lse, n_q, n_k, heads, heads // k.shape[1],
                           scale * LOG2E, HEAD_DIM=dim, BLOCK_M=block_m,
                           BLOCK_N=block_n, CAUSAL=bool(causal), PV_FP8=bool(pv_fp8), num_warps=num_warps,
                           num_stages=num_stages)
    # the kernel's LSE is of the smoothed scores: add back scale * q . mean_t(k) per row
    return out, lse + scale * fp8.q_shift


def attention_fp8_flops(batch: int, heads: int, n_q: int, n_k: int, dim: int, causal: bool) -> float:
    """4 n_q n_k d a head (Q K^T and P V), halved by the causal mask for square problems."""
    pairs = n_q * n_k - (n_q * (n_q - 1) / 2 if causal and n_q == n_k else 0)
    return 4.0 * batch * heads * pairs * dim


def quantization_error(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict:
    """Relative L2 error of each dequantized operand against its bf16 input (what the scales cost)."""
    fp8 = quantize_qkv(q, k, v)

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    q_back = fp8.q.float() * fp8.q_scale[..., None]
    k_back = fp8.k.float() * fp8.k_scale[..., None] + fp8.k_mean[:, :, None]
    v_back = (fp8.v_t.float()[..., :v.shape[2]] * fp8.v_scale[..., None]).transpose(2, 3)
    return {"q": rel(q_back, q.float()), "k": rel(k_back, k.float()), "v": rel(v_back, v.float())}

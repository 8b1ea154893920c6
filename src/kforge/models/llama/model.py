"""The Llama-3 forward pass on kforge's operators, over a paged KV cache.

One `forward` serves prefill and decode alike (gpt-fast's shape, vLLM's batching): the
tokens of several sequences are packed into one (T,) batch, the decodes first (one token
each), then prompt chunks. Per layer, on `kforge.ops`:

    qkv    = rms_norm_qkv(h, attn_norm, wqkv)         the norm fused into the QKV projection
    q, k   = rope(q, k, positions)                     Llama-3 scaled frequencies (config.py)
    cache <- k, v                                      paged_kv_append, at each sequence's positions
    a      = paged_decode_attention(q_decode, cache)   decodes: one query over the pages
           | flash_attention_varlen(q, k, v, causal)   prompt chunks that start a sequence, packed
           | attention over the cached prefix          chunks that continue one (chunked prefill)
    x, h   = rms_norm(a @ wo, ffn_norm, residual=h)     the residual add fused into the norm
    h      = h + swiglu(x @ w_gate_up) @ w_down        gate and up in one GEMM

Linear layers of up to 16 rows run kforge's decode GEMV, larger ones kforge's GEMM; at
decode the GEMV stores swiglu(gate, up) and h + y itself (`linear_swiglu`,
`linear_residual`: two launches a layer fewer, the same bits) for unquantized weights, the
FP8 and W4A16 GEMVs h + y; one kernel rotates q and k and appends k and v
(`rope_paged_kv_append`) in every format; weights quantized at load time (quantize.py) take
`w4a16_matmul` or `fp8_gemv` instead, dequantized onto the bf16 GEMM above their row limits
(and a quantized wqkv an unfused rms_norm first). On a CPU every op runs its PyTorch
reference, so the CPU tests run this very code. Logits are computed only for the rows that
yield a token (a decode, or the last row of a prompt), in fp32.

A continued chunk attends to its sequence's earlier tokens through the cache: its K and V,
appended first, are gathered from the pages with the prefix's, and the varlen kernel runs
with the causal mask aligned bottom-right (query i of the chunk sees keys up to start + i).
The gather is a copy of the sequence's cache per layer; prompts that fit one step never
take it.

`decode` is the same layers for a step of decodes alone, written so that a CUDA graph can
capture it (graphs.py): its inputs are device tensors of fixed shape, and nothing in it
reads a device value on the host, builds a tensor from host values or sizes anything by
the step's values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kforge import ops
from kforge.errors import ModelError
from kforge.kernels.quant.fp8_gemv import MAX_BATCH as FP8_GEMV_MAX_ROWS
from kforge.kernels.serving.gemv import MAX_BATCH as GEMV_MAX_ROWS
from kforge.kernels.serving.rope import KERNEL_DTYPES as ROPE_KERNEL_DTYPES
from kforge.kernels.serving.rope import apply_rope_, rope_reference_
from kforge.models.llama.config import LlamaConfig, rope_table
from kforge.models.llama.quantize import FP8_BLOCK, Fp8Weight, Int4Weight
from kforge.ops.varlen_attention import cumulative_seqlens
from kforge.ops.w4a16 import MAX_BATCH as W4A16_MAX_ROWS


def linear(x: torch.Tensor, weight: torch.Tensor | Int4Weight | Fp8Weight) -> torch.Tensor:
    """x @ weight.T in the weight's format: for a plain weight the decode GEMV for a few rows,
    the GEMM otherwise; an INT4 weight through W4A16; an FP8 weight through the FP8 GEMV (x
    in bf16) for a few rows, else dequantized onto the bf16 GEMM."""
    if isinstance(weight, Int4Weight):
        if x.shape[0] <= W4A16_MAX_ROWS:
            return ops.w4a16_matmul(x, weight.qweight, weight.scales, weight.group)
        # Prefill is compute-bound: reading 4 bits instead of 16 saves nothing there, so the weight is
        # dequantized (a transient, freed after the GEMM) and multiplied on the bf16 tensor-core GEMM.
        return ops.matmul(x, ops.dequantize_int4(weight.qweight, weight.scales, weight.group).t())
    if isinstance(weight, Fp8Weight):
        if x.shape[0] <= FP8_GEMV_MAX_ROWS:  # decode: the weight's bytes are the cost, x stays bf16
            return ops.fp8_gemv(x, weight.q, weight.scale)
        # More rows take the dequantized weight on the bf16 GEMM, x still in bf16, so that a request's
        # numbers do not depend on how many rows share its step; the FP8 GEMM would quantize x per
        # 1 x 128 tile only above the GEMV's limit, and greedy tokens would change with the batch.
        w = ops.dequantize_fp8(weight.q, weight.scale, block=(FP8_BLOCK, FP8_BLOCK)).to(x.dtype)
        return ops.matmul(x, w.t())
    if x.shape[0] <= GEMV_MAX_ROWS:
        return ops.gemv(x, weight)
    return ops.matmul(x, weight.t())


# The decode step's fusions (see the module docstring); False runs each op on its own, the same
# numbers in more launches: scripts/decode_profile.py --unfused times the difference.
FUSED_DECODE = True


def linear_swiglu(x: torch.Tensor, weight: torch.Tensor | Int4Weight | Fp8Weight) -> torch.Tensor:
    """swiglu(x @ weight.T) of a fused gate/up weight: for a plain weight at decode, one GEMV with
    SwiGLU in its store (the same bits as the pair, one launch less); otherwise the pair."""
    if FUSED_DECODE and isinstance(weight, torch.Tensor) and x.shape[0] <= GEMV_MAX_ROWS:
        return ops.gemv_swiglu(x, weight)
    return ops.swiglu(linear(x, weight))


def linear_residual(x: torch.Tensor, weight: torch.Tensor | Int4Weight | Fp8Weight,
                    residual: torch.Tensor) -> torch.Tensor:
    """residual + x @ weight.T: at decode, the add in the GEMV's store (plain weights; FP8; INT4 at
    one token), the unfused pair's bits."""
    if FUSED_DECODE and isinstance(weight, torch.Tensor) and x.shape[0] <= GEMV_MAX_ROWS:
        return ops.gemv_residual(x, weight, residual)
    if FUSED_DECODE and isinstance(weight, Fp8Weight) and x.shape[0] <= FP8_GEMV_MAX_ROWS:
        return ops.fp8_gemv_residual(x, weight.q, weight.scale, residual)
    if FUSED_DECODE and isinstance(weight, Int4Weight) and x.shape[0] <= W4A16_MAX_ROWS:
        return ops.w4a16_matmul_residual(x, weight.qweight, weight.scales, residual, weight.group)
    return residual + linear(x, weight)


class KVCache:
    """Every layer's K and V pages. A sequence's slot is its block-table row, and the pages
    it is assigned (by the scheduler) hold its tokens in order: position p in
    pages[p // page_size] at offset p % page_size (`kforge.ops.paged_attention` explains the
    layout). Lengths and page lists live on the host.

    Beyond the `num_pages` pages and `max_slots` rows asked for there is one scratch page
    (number num_pages) and one more row, `pad_slot`, that names it: a padded row of a graphed
    decode step (graphs.py) writes its K and V there, never into a sequence's pages."""

    def __init__(self, config: LlamaConfig, *, num_pages: int, page_size: int, max_slots: int, max_context: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (config.n_layers, num_pages + 1, config.n_kv_heads, page_size, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_pages, self.page_size = num_pages, page_size
        self.block_tables = torch.full((max_slots + 1, -(-max_context // page_size)), -1, dtype=torch.int32,
                                       device=device)
        self.pad_slot = max_slots
        self.block_tables[self.pad_slot, 0] = num_pages
        self.lengths = [0] * max_slots
        self._pages: list[list[int]] = [[] for _ in range(max_slots)]

    def assign(self, slot: int, pages: list[int]) -> None:
        """Give `slot` these pages (a new sequence: its length starts at 0)."""
        if not 0 <= slot < self.pad_slot:
            raise ModelError(f"slot {slot} is not one of the cache's {self.pad_slot} slots")
        if len(pages) > self.block_tables.shape[1] or any(not 0 <= p < self.num_pages for p in pages):
            raise ModelError(f"slot {slot}: {len(pages)} pages do not fit a block-table row of "
                             f"{self.block_tables.shape[1]} or a pool of {self.num_pages}")
        self._pages[slot] = list(pages)
        self.lengths[slot] = 0
        self.block_tables[slot] = -1
        self.block_tables[slot, :len(pages)] = torch.tensor(pages, dtype=torch.int32)

    def gather(self, layer: int, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `length` cached K and V of `slot` in `layer`, (length, kv_heads, head_dim)."""
        pages = torch.tensor(self._pages[slot][:-(-length // self.page_size)], device=self.k.device)

        def tokens(pool: torch.Tensor) -> torch.Tensor:  # (pages, kv, page, d) -> (tokens, kv, d)
            return pool[layer].index_select(0, pages).transpose(1, 2).flatten(0, 1)[:length]

        return tokens(self.k), tokens(self.v)


@dataclass
class Batch:
    """One forward pass: `tokens` and `positions` (T,), the decodes' slots (their tokens come
    first, one each), then the prompt chunks as (slot, start, length), and which rows' logits
    are wanted (`logit_rows`, indices into T)."""

    tokens: torch.Tensor
    positions: torch.Tensor
    decode_slots: list[int]
    chunks: list[tuple[int, int, int]]
    logit_rows: torch.Tensor

    @classmethod
    def build(cls, decodes: list[tuple[int, int, int]], chunks: list[tuple[int, int, list[int], bool]],
              device: torch.device | str) -> Batch:
        """decodes: (slot, position, token); chunks: (slot, start, tokens, wants_logits)."""
        tokens = [t for _, _, t in decodes]
        positions = [p for _, p, _ in decodes]
        rows = list(range(len(decodes)))
        for _, start, chunk, wants in chunks:
            tokens += chunk
            positions += range(start, start + len(chunk))
            if wants:
                rows.append(len(tokens) - 1)
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
        return cls(as_tensor(tokens), as_tensor(positions), [s for s, _, _ in decodes],
                   [(s, start, len(chunk)) for s, start, chunk, _ in chunks], as_tensor(rows))


class Block(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        c = config
        self.attn_norm = nn.Parameter(torch.ones(c.dim))
        self.wqkv = nn.Parameter(torch.empty(c.q_dim + 2 * c.kv_dim, c.dim))  # [q; k; v] rows
        self.wo = nn.Parameter(torch.empty(c.dim, c.q_dim))
        self.ffn_norm = nn.Parameter(torch.ones(c.dim))
        self.w_gate_up = nn.Parameter(torch.empty(2 * c.ffn_dim, c.dim))  # [gate; up] rows, as ops.swiglu reads
        self.w_down = nn.Parameter(torch.empty(c.dim, c.ffn_dim))


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Parameter(torch.empty(config.vocab_size, config.dim))
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = nn.Parameter(torch.ones(config.dim))
        self.lm_head = None if config.tie_embeddings else nn.Parameter(torch.empty(config.vocab_size, config.dim))
        self.head_q: Int4Weight | Fp8Weight | None = None  # a quantized copy of the head (quantize.py, head=True)
        self._rope: torch.Tensor | None = None

    def init_random(self, seed: int = 0, std: float = 0.02) -> Llama:
        """Random weights (normal, std 0.02; norms 1), the same for a seed on any device."""
        generator = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            values = torch.ones(p.shape) if "norm" in name else torch.randn(p.shape, generator=generator) * std
            with torch.no_grad():
                p.copy_(values)
        return self

    def head_weight(self) -> torch.Tensor:
        return self.embed if self.lm_head is None else self.lm_head

    @property
    def head(self) -> torch.Tensor | Int4Weight | Fp8Weight:
        """The weight the logits are computed with: the quantized head (quantize.py, head=True) or
        `head_weight()`."""
        return self.head_q if self.head_q is not None else self.head_weight()

    def rope(self, positions: int) -> torch.Tensor:
        """The [cos | sin] table for `positions` positions on the model's device, built once."""
        if self._rope is None or self._rope.shape[0] < positions or self._rope.device != self.embed.device:
            self._rope = rope_table(self.config, positions, self.embed.device)
        return self._rope

    @torch.no_grad()
    def forward(self, batch: Batch, cache: KVCache) -> torch.Tensor:
        """Logits (len(batch.logit_rows), vocab) in fp32; appends every token's K and V to the
        cache and advances its lengths."""
        tables = cache.block_tables
        decodes = batch.decode_slots
        n_dec = len(decodes)
        dec_rows = torch.tensor(decodes, dtype=torch.long, device=tables.device)
        dec_tables = tables.index_select(0, dec_rows) if n_dec else None
        before = torch.tensor([cache.lengths[s] for s in decodes], dtype=torch.int32, device=tables.device)
        starts = _offsets(n_dec, batch.chunks)
        chunk_lens = [torch.tensor([start], dtype=torch.int32, device=tables.device) for _, start, _ in batch.chunks]
        # a continued chunk's queries and its whole sequence's keys, as one varlen sequence each
        continued = {row: (cumulative_seqlens([length], tables.device),
                           cumulative_seqlens([start + length], tables.device))
                     for (_, start, length), row in zip(batch.chunks, starts) if start}
        # the chunks that start a sequence: one packed varlen call per layer, its rows and offsets built once
        fresh = [(row, length) for (_, start, length), row in zip(batch.chunks, starts) if start == 0]
        if fresh:
            fresh_rows = torch.cat([torch.arange(row, row + length) for row, length in fresh]).to(tables.device)
            fresh_cu = cumulative_seqlens([length for _, length in fresh], tables.device)
            fresh_max = max(length for _, length in fresh)
        table = self.rope(int(batch.positions.max()) + 1)

        h = F.embedding(batch.tokens, self.embed)
        for layer, block in enumerate(self.layers):
            q, k, v = self._qkv(block, h, batch.positions, table)
            k_pool, v_pool = cache.k[layer], cache.v[layer]
            out = torch.empty_like(q)
            if n_dec:
                ops.paged_kv_append(k[:n_dec].contiguous(), v[:n_dec].contiguous(), k_pool, v_pool, dec_tables,
                                    before, validate=False)
                out[:n_dec] = ops.paged_decode_attention(q[:n_dec].contiguous(), k_pool, v_pool, dec_tables,
                                                         before + 1, validate=False)
            for (slot, start, length), row, before_chunk in zip(batch.chunks, starts, chunk_lens):
                rows = slice(row, row + length)
                ops.paged_kv_append(k[rows].unsqueeze(0).contiguous(), v[rows].unsqueeze(0).contiguous(), k_pool,
                                    v_pool, tables[slot:slot + 1], before_chunk, validate=False)
                if start:
                    k_seq, v_seq = cache.gather(layer, slot, start + length)
                    out[rows] = ops.flash_attention_varlen(q[rows], k_seq, v_seq, *continued[row], length,
                                                           start + length, causal=True, bottom_right=True,
                                                           check_lengths=False)
            if fresh:
                out[fresh_rows] = ops.flash_attention_varlen(q[fresh_rows], k[fresh_rows], v[fresh_rows], fresh_cu,
                                                             fresh_cu, fresh_max, fresh_max, causal=True,
                                                             check_lengths=False)
            h = self._after_attention(block, out, h)

        for slot in decodes:
            cache.lengths[slot] += 1
        for slot, start, length in batch.chunks:
            cache.lengths[slot] = start + length
        return self._logits(h.index_select(0, batch.logit_rows))

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cache: KVCache,
               rope: torch.Tensor) -> torch.Tensor:
        """Logits (B, vocab) in fp32 of one decode token per row: row i is `tokens[i]` at
        `positions[i]` of `slots[i]` (int64 (B,) tensors on the cache's device; a sequence at
        position p has p cached tokens). Appends each row's K and V to the cache; the caller
        advances `cache.lengths`. `rope`: a [cos | sin] table (`Llama.rope`) of every position.

        Capturable as a CUDA graph: the block-table rows are gathered and the lengths derived
        on the device, and every op is called with validate=False (no device read)."""
        tables = cache.block_tables.index_select(0, slots)
        before = positions.to(torch.int32)
        after = before + 1
        h = F.embedding(tokens, self.embed)
        for layer, block in enumerate(self.layers):
            k_pool, v_pool = cache.k[layer], cache.v[layer]
            # k, v and q are views into the QKV projection: the kernels take their strides as they are
            q, k, v = self._qkv(block, h, positions, rope, rotate=not FUSED_DECODE)
            if FUSED_DECODE:  # RoPE and the append in one launch, the same bits as the pair
                ops.rope_paged_kv_append(q, k, v, positions, rope, k_pool, v_pool, tables, before, validate=False)
            else:
                ops.paged_kv_append(k, v, k_pool, v_pool, tables, before, validate=False)
            # two launches: the one-launch reduce lost 1.6 us a call at 2,048 tokens and won 0.3 at 512
            # (H200, scripts/paged_decode_sweep.py)
            out = ops.paged_decode_attention(q, k_pool, v_pool, tables, after, validate=False, fused_reduce=False)
            h = self._after_attention(block, out, h)
        return self._logits(h)

    def _qkv(self, block: Block, h: torch.Tensor, positions: torch.Tensor, table: torch.Tensor, rotate: bool = True
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The block's normed QKV projection as (T, heads, head_dim) views, q and k rotated (unless
        not `rotate`: the caller's kernel does it)."""
        c = self.config
        if isinstance(block.wqkv, torch.Tensor):
            qkv = ops.rms_norm_qkv(h, block.attn_norm, block.wqkv, c.norm_eps)
        else:  # the fused op takes a plain weight
            qkv = linear(ops.rms_norm(h, block.attn_norm, c.norm_eps), block.wqkv)
        q = qkv[:, :c.q_dim].view(-1, c.n_heads, c.head_dim)
        k = qkv[:, c.q_dim:c.q_dim + c.kv_dim].view(-1, c.n_kv_heads, c.head_dim)
        v = qkv[:, c.q_dim + c.kv_dim:].view(-1, c.n_kv_heads, c.head_dim)
        if rotate:
            _rope(q, k, positions, table)
        return q, k, v

    def _after_attention(self, block: Block, attention: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The residual stream after the block: the output projection, the norm, SwiGLU."""
        c = self.config
        x, h = ops.rms_norm(linear(attention.view(-1, c.q_dim), block.wo), block.ffn_norm, c.norm_eps, residual=h)
        return linear_residual(linear_swiglu(x, block.w_gate_up), block.w_down, h)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return linear(ops.rms_norm(h, self.norm, self.config.norm_eps), self.head).float()


def _offsets(first: int, chunks: list[tuple[int, int, int]]) -> list[int]:
    """Each chunk's first row in the packed batch (the decodes' rows come first)."""
    rows, row = [], first
    for _, _, length in chunks:
        rows.append(row)
        row += length
    return rows


def _rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, table: torch.Tensor) -> None:
    """Rotate q and k in place: kforge's kernel on a GPU, its PyTorch reference elsewhere."""
    if q.is_cuda and q.dtype in ROPE_KERNEL_DTYPES:
        apply_rope_(q, k, positions, table)
    else:
        rope_reference_(q, k, positions, table)

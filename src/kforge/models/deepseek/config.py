"""DeepSeek-V3 shapes: one `DeepSeekConfig` for the real model's dimensions and for a tiny one.

The architecture (DeepSeek-V3 technical report, arXiv 2412.19437, sections 2.1-2.2):

- MLA attention. Each token's keys and values are compressed into one latent c (kv_lora_rank
  dims, 512) plus one decoupled RoPE key k_r (qk_rope_head_dim, 64) shared by every head; the
  cache holds these 576 numbers a token. Per head h the key is [W_UK,h c, k_r] (nope + rope =
  128 + 64 dims) and the value W_UV,h c (v_head_dim, 128). Queries optionally pass a low-rank
  bottleneck too (q_lora_rank, 1536; 0 means a plain projection). RMSNorm on both latents.
- FFN: the first `n_dense_layers` layers a dense SwiGLU MLP (ffn_dim), the rest mixture of
  experts: `n_routed_experts` SwiGLU experts of width moe_inter, `top_k` chosen a token by the
  sigmoid, bias-steered, group-limited router (n_group groups, topk_group kept), weights scaled
  by routed_scaling_factor, plus `n_shared_experts` always-on experts.
- MTP: one extra block (multi-token prediction depth 1) that reads the main model's last
  hidden state and the embedding of the next token and predicts the token after; sharing the
  embedding and the output head with the main model. kforge drafts with it.

Layer i < n_dense_layers is dense; the MTP block counts as layer n_layers (DeepSeek-V3's
layer 61, an MoE layer). An all-dense model (float64 checks: kforge's grouped GEMMs take
fp32 at most) sets n_dense_layers = n_layers + 1.

The kernel's limits are the config's: kforge's MLA decode takes a latent (kv_lora_rank) and a
RoPE key (qk_rope_head_dim) of powers of two >= 16, and its grouped GEMMs rows of 16-byte
multiples (hidden sizes multiples of 8).

RoPE: plain (theta^(-2i/d) per pair), or YaRN's extension when rope_factor > 1 (DeepSeek-V3
stretches a 4k context 40x; arXiv 2309.00071). YaRN keeps the high-frequency pairs as they
were (extrapolation), divides the low-frequency ones by the factor (interpolation), and ramps
linearly between, over the pairs whose wavelengths fit between beta_fast and beta_slow
rotations of the original context: with r(n) = d ln(L / (2 pi n)) / (2 ln theta) the pair
index where n rotations fit in L positions, the ramp runs from floor(r(beta_fast)) to
ceil(r(beta_slow)). cos and sin are multiplied by an attention factor (m(mscale) /
m(mscale_all_dim), or m(1) without both; m(s) = 0.1 s ln(factor) + 1), and the softmax scale by
m(mscale_all_dim)^2; DeepSeek-V3's mscale = mscale_all_dim = 1 give 1 and (0.1 ln 40 + 1)^2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from kforge.errors import ModelError


@dataclass(frozen=True)
class DeepSeekConfig:
    vocab_size: int
    dim: int  # hidden size
    n_layers: int  # main-model blocks (the MTP block is one more)
    n_dense_layers: int  # the first blocks use the dense FFN; the rest MoE
    n_heads: int
    q_lora_rank: int  # 0: queries from one dim -> heads projection
    kv_lora_rank: int  # the cached latent c
    qk_nope_head_dim: int  # per-head key/query part from the latent
    qk_rope_head_dim: int  # the decoupled RoPE part (one cached key shared by all heads)
    v_head_dim: int
    ffn_dim: int  # the dense layers' SwiGLU width
    moe_inter: int  # each expert's SwiGLU width
    n_routed_experts: int
    n_shared_experts: int
    top_k: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position: int = 4096
    rope_factor: float = 1.0  # YaRN's context stretch; 1: plain RoPE
    rope_original_max_position: int = 4096  # YaRN: the pretraining context
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 0.0  # 0: not given
    rope_mscale_all_dim: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and (not isinstance(value, int) or value < (0 if f.name in _MAY_BE_ZERO else 1)):
                least = "a non-negative" if f.name in _MAY_BE_ZERO else "a positive"
                raise ModelError(f"config: {f.name} must be {least} integer, got {value!r}")
        for name in ("kv_lora_rank", "qk_rope_head_dim"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ModelError(f"config: {name} must be a power of two >= 16 (kforge's MLA decode), got {value}")
        for name in ("dim", "moe_inter"):
            if getattr(self, name) % 8:
                raise ModelError(f"config: {name} must be a multiple of 8 (the grouped GEMM's 16-byte rows), got "
                                 f"{getattr(self, name)}")
        if self.n_dense_layers > self.n_layers + 1:
            raise ModelError(f"config: n_dense_layers ({self.n_dense_layers}) exceeds the {self.n_layers} layers "
                             f"and the MTP block")
        experts, groups = self.n_routed_experts, self.n_group
        if experts % groups or (groups > 1 and experts // groups < 2):
            raise ModelError(f"config: n_group ({groups}) must divide n_routed_experts ({experts}) into groups of "
                             f">= 2 experts")
        if not self.top_k <= experts or not self.topk_group <= groups or \
                self.topk_group * (experts // groups) < self.top_k:
            raise ModelError(f"config: top_k ({self.top_k}) experts must fit in topk_group ({self.topk_group}) of "
                             f"{groups} groups of {experts // groups}")
        if not self.routed_scaling_factor > 0 or not self.norm_eps > 0 or not self.rope_theta > 0:
            raise ModelError("config: routed_scaling_factor, norm_eps and rope_theta must be > 0")
        if not self.rope_factor >= 1 or not self.rope_beta_fast > self.rope_beta_slow > 0 or \
                self.rope_mscale < 0 or self.rope_mscale_all_dim < 0:
            raise ModelError("config: YaRN needs rope_factor >= 1, rope_beta_fast > rope_beta_slow > 0 and mscales >= 0")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Numbers cached a token and layer: the latent, then the RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def yarn(self) -> bool:
        return self.rope_factor > 1

    def _yarn_m(self, scale: float) -> float:
        return 0.1 * scale * math.log(self.rope_factor) + 1.0 if self.yarn else 1.0

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(qk_head_dim), times YaRN's m(mscale_all_dim)^2 where it applies."""
        mscale = self._yarn_m(self.rope_mscale_all_dim) if self.rope_mscale_all_dim else 1.0
        return self.qk_head_dim ** -0.5 * mscale * mscale

    def rope_frequencies(self) -> tuple[torch.Tensor, float]:
        """Each RoPE pair's angle per position (qk_rope_head_dim / 2,) float64, and the factor cos
        and sin are multiplied by (1 for plain RoPE): the module docstring's YaRN."""
        d = self.qk_rope_head_dim
        plain = self.rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
        if not self.yarn:
            return plain, 1.0

        def pair_index(rotations: float) -> float:
            return d * math.log(self.rope_original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(self.rope_theta))

        low = max(math.floor(pair_index(self.rope_beta_fast)), 0)
        high = min(math.ceil(pair_index(self.rope_beta_slow)), d - 1)
        ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
        keep = 1 - ramp  # 1: the pair keeps its frequency; 0: divided by the factor
        freqs = plain / self.rope_factor * (1 - keep) + plain * keep
        if self.rope_mscale and self.rope_mscale_all_dim:
            factor = self._yarn_m(self.rope_mscale) / self._yarn_m(self.rope_mscale_all_dim)
        else:
            factor = self._yarn_m(1.0)
        return freqs, factor

    def is_moe(self, layer: int) -> bool:
        """Whether block `layer` (n_layers: the MTP block) has the MoE FFN."""
        return layer >= self.n_dense_layers

    def parameter_count(self, mtp: bool = False) -> int:
        """The main model's parameters, or with `mtp` the MTP module's own (sharing the
        embedding and the output head, as DeepSeek-V3's does)."""
        d, h = self.dim, self.n_heads
        if self.q_lora_rank:
            q = d * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * h * self.qk_head_dim
        else:
            q = d * h * self.qk_head_dim
        kv = d * self.latent_dim + self.kv_lora_rank + self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim)
        attention = q + kv + h * self.v_head_dim * d
        dense = 3 * d * self.ffn_dim
        moe = 3 * d * self.moe_inter * (self.n_routed_experts + self.n_shared_experts) + (d + 1) * self.n_routed_experts

        def block(layer: int) -> int:
            return attention + (moe if self.is_moe(layer) else dense) + 2 * d

        if mtp:
            return 2 * d * d + 3 * d + block(self.n_layers)  # projection, three norms, the block
        return sum(block(i) for i in range(self.n_layers)) + 2 * self.vocab_size * d + d


_MAY_BE_ZERO = ("q_lora_rank", "n_dense_layers", "n_shared_experts")

PRESETS: dict[str, DeepSeekConfig] = {
    # DeepSeek-V3 / R1 (config.json of deepseek-ai/DeepSeek-V3): documents the shapes; never
    # instantiated in tests (671B parameters). YaRN: factor 40 over 4096 positions.
    "deepseek-v3-shapes": DeepSeekConfig(
        vocab_size=129280, dim=7168, n_layers=61, n_dense_layers=3, n_heads=128, q_lora_rank=1536,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, ffn_dim=18432,
        moe_inter=2048, n_routed_experts=256, n_shared_experts=1, top_k=8, n_group=8, topk_group=4,
        routed_scaling_factor=2.5, max_position=163840, rope_factor=40.0, rope_original_max_position=4096,
        rope_mscale=1.0, rope_mscale_all_dim=1.0),
    # for tests: every feature (q low rank, dense then MoE layers, groups, a shared expert) in ~1M parameters
    "tiny": DeepSeekConfig(
        vocab_size=512, dim=128, n_layers=2, n_dense_layers=1, n_heads=4, q_lora_rank=64, kv_lora_rank=32,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, ffn_dim=256, moe_inter=64, n_routed_experts=8,
        n_shared_experts=1, top_k=2, n_group=4, topk_group=2, routed_scaling_factor=2.5, max_position=512),
}


def preset(name: str) -> DeepSeekConfig:
    if name not in PRESETS:
        raise ModelError(f"no DeepSeek preset {name!r}; presets: {', '.join(PRESETS)}")
    return PRESETS[name]

"""Llama-3 shapes: the presets, and a Hugging Face `config.json` read into the same form.

One `LlamaConfig` describes every size. The presets are the published shapes (Meta's
Llama-3.1 8B and 70B, Llama-3.2 1B) and a tiny one for tests; `from_hf(config_json)`
accepts a `LlamaForCausalLM` checkpoint's config and refuses anything else with one line.

RoPE with Llama-3 scaling (the "llama3" rope_type): frequencies whose wavelength is
longer than original_max_position / low_freq_factor are divided by `factor`, those shorter
than original_max_position / high_freq_factor are kept, and the band between is blended
linearly in 1/wavelength (`rope_frequencies`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from kforge.errors import ModelError


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3's frequency scaling (Hugging Face `rope_scaling` with rope_type "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position: int


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    dim: int  # hidden size
    n_layers: int
    n_heads: int
    n_kv_heads: int  # grouped-query attention: n_heads / n_kv_heads query heads share a K/V head
    ffn_dim: int  # SwiGLU's hidden width
    head_dim: int = 0  # 0: dim // n_heads
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    max_position: int = 8192
    tie_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.dim // max(self.n_heads, 1))
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "head_dim", "max_position"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ModelError(f"config: {name} must be a positive integer, got {getattr(self, name)!r}")
        if self.n_heads % self.n_kv_heads:
            raise ModelError(f"config: n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ModelError(f"config: head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def parameter_count(self) -> int:
        per_layer = (self.dim * (self.q_dim + 2 * self.kv_dim) + self.q_dim * self.dim  # attention
                     + 3 * self.dim * self.ffn_dim + 2 * self.dim)  # SwiGLU, two norms
        embeddings = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return self.n_layers * per_layer + embeddings + self.dim

    def kv_bytes_per_token(self, dtype: torch.dtype = torch.bfloat16) -> int:
        return 2 * self.n_layers * self.kv_dim * dtype.itemsize


_LLAMA31_SCALING = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192)

PRESETS: dict[str, LlamaConfig] = {
    # Llama-3.1-8B and -70B: 128k context through the scaled RoPE
    "llama3-8b": LlamaConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                             rope_scaling=_LLAMA31_SCALING, max_position=131072, bos_token_id=128000,
                             eos_token_ids=(128001, 128008, 128009)),
    "llama3-70b": LlamaConfig(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
                              rope_scaling=_LLAMA31_SCALING, max_position=131072, bos_token_id=128000,
                              eos_token_ids=(128001, 128008, 128009)),
    # Llama-3.2-1B: tied embeddings, head_dim 64
    "llama3-1b": LlamaConfig(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
                             rope_scaling=replace(_LLAMA31_SCALING, factor=32.0), max_position=131072,
                             tie_embeddings=True, bos_token_id=128000, eos_token_ids=(128001, 128008, 128009)),
    # for tests: every feature (GQA, scaled RoPE already at short positions, untied head) in a few KB
    "tiny": LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=160,
                        rope_theta=10000.0, max_position=512, bos_token_id=1, eos_token_ids=(2,),
                        rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                 original_max_position=32)),
}


def preset(name: str) -> LlamaConfig:
    if name not in PRESETS:
        raise ModelError(f"no model preset {name!r}; presets: {', '.join(PRESETS)} (or a checkpoint directory)")
    return PRESETS[name]


def from_hf(hf: dict) -> LlamaConfig:
    """A Hugging Face LlamaForCausalLM `config.json` (as a dict) as a LlamaConfig."""
    architectures = hf.get("architectures") or []
    if hf.get("model_type") != "llama" or (architectures and "LlamaForCausalLM" not in architectures):
        raise ModelError(f"unknown architecture: model_type {hf.get('model_type')!r}, architectures "
                         f"{architectures}; kforge runs LlamaForCausalLM checkpoints")
    # transformers 5 writes `rope_parameters` (the theta inside); released checkpoints, `rope_scaling`
    rope = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type") else None)
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "default":
            scaling = None
        elif kind != "llama3":
            raise ModelError(f"unsupported rope_scaling type {kind!r}: kforge implements Llama-3's ('llama3')")
        else:
            scaling = RopeScaling(float(scaling["factor"]), float(scaling["low_freq_factor"]),
                                  float(scaling["high_freq_factor"]),
                                  int(scaling["original_max_position_embeddings"]))
    eos = hf.get("eos_token_id")
    try:
        return LlamaConfig(
            vocab_size=hf["vocab_size"], dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
            n_heads=hf["num_attention_heads"], n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            ffn_dim=hf["intermediate_size"], head_dim=hf.get("head_dim") or 0,
            norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            rope_scaling=scaling, max_position=hf.get("max_position_embeddings", 8192),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)), bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        )
    except KeyError as exc:
        raise ModelError(f"config.json lacks {exc.args[0]!r}, which a Llama config has") from None


def rope_frequencies(config: LlamaConfig) -> torch.Tensor:
    """The head's rotary frequencies (head_dim / 2,), float64, with Llama-3 scaling if any."""
    inv_freq = config.rope_theta ** (-torch.arange(0, config.head_dim, 2, dtype=torch.float64) / config.head_dim)
    s = config.rope_scaling
    if s is None:
        return inv_freq
    wavelength = 2 * math.pi / inv_freq
    low_freq_wavelength = s.original_max_position / s.low_freq_factor
    high_freq_wavelength = s.original_max_position / s.high_freq_factor
    scaled = torch.where(wavelength > low_freq_wavelength, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    between = (wavelength >= high_freq_wavelength) & (wavelength <= low_freq_wavelength)
    return torch.where(between, blended, scaled)


def rope_table(config: LlamaConfig, positions: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The (positions, head_dim) fp32 [cos | sin] table `kforge.kernels.serving.rope` reads."""
    if positions > config.max_position:
        raise ModelError(f"a context of {positions} tokens is longer than the model's {config.max_position}")
    angles = torch.arange(positions, dtype=torch.float64)[:, None] * rope_frequencies(config)[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=1).to(torch.float32).to(device)

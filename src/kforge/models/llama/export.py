"""kforge's Llama back into Hugging Face's layout: the inverse of `checkpoint.from_pretrained`.

The baselines need it (transformers' LlamaForCausalLM with exactly the weights kforge runs,
random presets included) and so do the tests (a checkpoint written from any config).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kforge.models.llama.checkpoint import hf_layer_parts
from kforge.models.llama.config import LlamaConfig
from kforge.models.llama.model import Llama


def to_hf_config(config: LlamaConfig) -> dict:
    """A LlamaForCausalLM `config.json` for this config (the rope_scaling layout both
    transformers 4 and 5 read)."""
    s = config.rope_scaling
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": config.vocab_size,
        "hidden_size": config.dim, "intermediate_size": config.ffn_dim, "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads, "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim, "rms_norm_eps": config.norm_eps, "rope_theta": config.rope_theta,
        "rope_scaling": None if s is None else {
            "rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor, "original_max_position_embeddings": s.original_max_position},
        "max_position_embeddings": config.max_position, "tie_word_embeddings": config.tie_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(config.eos_token_ids) if len(config.eos_token_ids) != 1 else config.eos_token_ids[0],
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
    }


def to_hf_state_dict(model: Llama) -> dict[str, torch.Tensor]:
    """The model's weights under Hugging Face's names, the fused ones split (views, no copy)."""
    tensors = {"model.embed_tokens.weight": model.embed, "model.norm.weight": model.norm}
    if model.lm_head is not None:
        tensors["lm_head.weight"] = model.lm_head
    parts = hf_layer_parts(model.config)
    for i, block in enumerate(model.layers):
        for name, (target, row, rows) in parts.items():
            tensors[f"model.layers.{i}.{name}.weight"] = getattr(block, target)[row:row + rows]
    return {name: t.detach() for name, t in tensors.items()}


def save_pretrained(model: Llama, directory: str | Path) -> Path:
    """config.json and model.safetensors in `directory` (created), readable by from_pretrained
    and by transformers."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(to_hf_config(model.config), indent=2))
    save_file({n: t.contiguous() for n, t in to_hf_state_dict(model).items()}, str(directory / "model.safetensors"))
    return directory

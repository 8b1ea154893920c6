"""A Llama-3 model on kforge's kernels: `config` (shapes, presets, Llama-3 RoPE scaling),
`model` (the forward pass over a paged KV cache), `checkpoint` (Hugging Face weights in)."""

from kforge.models.llama.checkpoint import from_pretrained, random_model
from kforge.models.llama.config import PRESETS, LlamaConfig, preset
from kforge.models.llama.model import Batch, KVCache, Llama

__all__ = ["PRESETS", "Batch", "KVCache", "Llama", "LlamaConfig", "from_pretrained", "preset", "random_model"]

"""A DeepSeek-V3-shaped model on kforge's kernels: `config` (shapes, presets), `model` (MLA over a
paged latent cache, dense and MoE FFNs, the MTP block), `generate` (plain or speculative with the
MTP block as the draft, one request), `engine` (the same, continuously batched on the Llama
engine's scheduler), `checkpoint` (a Hugging Face or deepseek-ai DeepSeek-V3 checkpoint loaded)."""

from kforge.models.deepseek.checkpoint import from_pretrained
from kforge.models.deepseek.config import PRESETS, DeepSeekConfig, preset
from kforge.models.deepseek.engine import DeepSeekEngine, EngineStats
from kforge.models.deepseek.generate import Generation, MtpDrafter, generate
from kforge.models.deepseek.model import DeepSeekV3, LatentCache, random_model

__all__ = ["PRESETS", "DeepSeekConfig", "DeepSeekEngine", "DeepSeekV3", "EngineStats", "Generation", "LatentCache",
           "MtpDrafter", "from_pretrained", "generate", "preset", "random_model"]

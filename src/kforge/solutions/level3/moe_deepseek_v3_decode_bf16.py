"""The DeepSeek-V3 MoE layer at decode (problem: the file of the same name in problems/level3):
the prefill solution's ModelNew. At 64 tokens the same launches run; each expert's run is one
64- or 128-row tile of ~2 real rows, so the grouped GEMMs read every reached expert's weight
panels once, the bytes that bound the layer here."""

from kforge.solutions.level3.moe_deepseek_v3_prefill_bf16 import ModelNew  # noqa: F401

"""Weight formats, chosen at load time: bf16, W4A16 (INT4 groups of 128) or FP8 (e4m3 blocks of 128 x 128).

    model = random_model("llama3-8b", weights="w4a16")      # or from_pretrained(DIR, weights="fp8")
    quantize_model(model, "fp8"); weight_bytes(model)       # the same, on a model already loaded

Every block's linear weights (wqkv, wo, w_gate_up, w_down) are quantized once, in place, and
`linear` (model.py) dispatches on their type. The embedding, the norms and the LM head stay as
loaded: the embedding is gathered a few rows a step and the norms are vectors, so neither
costs bandwidth, and the head is read once per step while its error reaches the logits
directly, unsoftened by any later layer. `head=True` quantizes a copy of the head too
(`Llama.head_q`; the bf16 head stays, for the embedding when tied and for export): llama3-8b's
head is 1.05 GB of the 2.6 GB a W4A16 step reads. Its quality cost is measured beside the
blocks' in tests/models/test_quantize.py.

A quantized weight is a plain attribute, not an nn.Parameter: `model.to` neither moves nor
casts it (a cast would turn e4m3 codes into floats), so quantize on the device the model runs on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kforge import ops
from kforge.errors import ModelError

if TYPE_CHECKING:
    from kforge.models.llama.model import Llama

FORMATS = ("bf16", "w4a16", "fp8")
LINEAR_WEIGHTS = ("wqkv", "wo", "w_gate_up", "w_down")
INT4_GROUP = 128  # the group of kforge's W4A16 kernels
FP8_BLOCK = 128  # DeepGEMM's scale block: 128 x 128 for weights, 1 x 128 for activations


@dataclass(frozen=True)
class Int4Weight:
    """W [N, K] as 4-bit codes, two per byte (qweight uint8 [N, K // 2]), and one bf16 scale per
    `group` values of a row (scales [N, K // group]): `ops.quantize_int4`'s layout."""

    qweight: torch.Tensor
    scales: torch.Tensor
    group: int

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.qweight.shape[0], 2 * self.qweight.shape[1]))

    @property
    def nbytes(self) -> int:
        return self.qweight.nbytes + self.scales.nbytes


@dataclass(frozen=True)
class Fp8Weight:
    """W [N, K] as e4m3 codes (q) and one fp32 scale per 128 x 128 block (scale [ceil(N/128), K/128]):
    `ops.quantize_fp8(w, "block", block=(128, 128))`'s layout, the b operand of `ops.fp8_gemm`."""

    q: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes


def check_format(fmt: str, dtype: torch.dtype) -> None:
    """Raise ModelError unless `fmt` is a format a model of `dtype` can take; the loaders call
    this before reading any weight, so a bad request costs nothing."""
    if fmt not in FORMATS:
        raise ModelError(f"weights must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if fmt != "bf16" and dtype != torch.bfloat16:
        raise ModelError(f"{fmt} weights take bf16 activations: load the model with dtype=torch.bfloat16, not {dtype}")


def quantize_model(model: Llama, fmt: str, *, head: bool = False) -> Llama:
    """Replace every block's linear weights by `fmt`'s, in place ("bf16" keeps them as loaded);
    with `head`, the LM head's too (`Llama.head_q`, beside the bf16 head). Every shape is
    checked before any weight changes, so a refused model is left whole."""
    check_format(fmt, model.embed.dtype)
    if fmt == "bf16":
        if head:
            raise ModelError("quantize_head needs a quantized format (w4a16 or fp8), not bf16")
        return model
    multiple = INT4_GROUP if fmt == "w4a16" else FP8_BLOCK
    if head:
        _check_head(model, fmt)
    for i, block in enumerate(model.layers):
        for name in LINEAR_WEIGHTS:
            weight = getattr(block, name)
            if not isinstance(weight, torch.Tensor):
                raise ModelError(f"layers.{i}.{name} is already quantized ({type(weight).__name__})")
            if weight.shape[1] % multiple:
                raise ModelError(f"layers.{i}.{name} {tuple(weight.shape)}: {fmt} needs its input dimension K to be "
                                 f"a multiple of {multiple}")
    for block in model.layers:
        for name in LINEAR_WEIGHTS:
            weight = getattr(block, name).detach()
            delattr(block, name)  # the nn.Parameter goes, and with it the bf16 copy
            setattr(block, name, _quantize(weight, fmt))
    return quantize_head(model, fmt) if head else model


def quantize_head(model: Llama, fmt: str) -> Llama:
    """Give `model` a `fmt` copy of its LM head (`Llama.head_q`), its blocks as they are: what
    `quantize_model(..., head=True)` adds, for a model already quantized (`kforge bench model`
    times one model's decode with and without it)."""
    check_format(fmt, model.embed.dtype)
    if fmt == "bf16":
        raise ModelError("quantize_head needs a quantized format (w4a16 or fp8), not bf16")
    _check_head(model, fmt)
    model.head_q = _quantize(model.head_weight().detach(), fmt)
    return model


def _check_head(model: Llama, fmt: str) -> None:
    multiple = INT4_GROUP if fmt == "w4a16" else FP8_BLOCK
    if model.config.dim % multiple:
        raise ModelError(f"the LM head's input dimension {model.config.dim}: {fmt} needs a multiple of {multiple}")


def _quantize(weight: torch.Tensor, fmt: str) -> Int4Weight | Fp8Weight:
    if fmt == "w4a16":
        return Int4Weight(*ops.quantize_int4(weight, INT4_GROUP), group=INT4_GROUP)
    return Fp8Weight(*ops.quantize_fp8(weight, "block", block=(FP8_BLOCK, FP8_BLOCK)))


def weight_bytes(model: Llama) -> int:
    """The weight bytes one decode step reads, what the weight-bandwidth floor divides: every
    block's linear weights and norms, the final norm and the LM head (the embedding itself when
    tied; the quantized copy when there is one). The embedding lookup reads a row per token, so an
    untied embedding does not count."""
    blocks = sum(getattr(block, name).nbytes for block in model.layers
                 for name in (*LINEAR_WEIGHTS, "attn_norm", "ffn_norm"))
    return blocks + model.norm.nbytes + model.head.nbytes

"""Weights in, from a Hugging Face checkpoint directory or from a seed; the tokenizer.

    model, tokenizer = from_pretrained("path/to/Llama-3.2-1B")     # config.json, *.safetensors, tokenizer.json
    model = random_model("llama3-8b", seed=0)                       # any preset, no download, ever
    model = random_model("llama3-8b", weights="w4a16")              # or "fp8": quantized as it loads (quantize.py)
    model = random_model("llama3-8b", device="cuda")                 # drawn on the GPU: seconds, not minutes

A checkpoint directory holds `config.json` (a LlamaForCausalLM's), the weights as one
`model.safetensors` or shards listed in `model.safetensors.index.json`, and optionally
`tokenizer.json` (read by the `tokenizers` library). Hugging Face's separate q/k/v and
gate/up projections are concatenated into kforge's fused weights as they load, one tensor
at a time, so the peak is the model plus one tensor. Anything missing, malformed or of
another architecture is one `ModelError` line.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kforge.errors import ModelError
from kforge.models.llama.config import LlamaConfig, from_hf, preset
from kforge.models.llama.model import Llama
from kforge.models.llama.quantize import check_format, quantize_model


def random_model(config: LlamaConfig | str, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu", weights: str = "bf16", quantize_head: bool = False) -> Llama:
    """`weights`: "bf16" (as `dtype`), "w4a16" or "fp8" (quantize.py; those need dtype bf16);
    `quantize_head`: the LM head in that format too (quantize.py).

    On the CPU the weights are `Llama.init_random`'s. On any other device they are drawn there,
    by that device's generator, in `dtype`, with the same distribution (normal, std 0.02; norms 1):
    the same for a seed on that kind of device, but not the CPU's values. Drawing 8B weights
    with the CPU's generator in fp32 and copying them over takes minutes and 32 GB of host
    memory; on a GPU it takes well under a second."""
    check_format(weights, dtype)
    config = preset(config) if isinstance(config, str) else config
    if torch.device(device).type == "cpu":
        model = Llama(config).init_random(seed).to(dtype=dtype)
    else:
        model = _random_on_device(config, seed, dtype, torch.device(device))
    return quantize_model(model.eval(), weights, head=quantize_head)


def _random_on_device(config: LlamaConfig, seed: int, dtype: torch.dtype, device: torch.device,
                      std: float = 0.02) -> Llama:
    # shapes only: nothing allocated, nothing drawn on the host; a Llama holds parameters alone (its
    # RoPE table is built at the first forward), so filling them below leaves nothing uninitialized
    with torch.device("meta"):
        model = Llama(config)
    model = model.to(dtype=dtype).to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=generator)
    return model


def from_pretrained(directory: str | Path, *, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                    weights: str = "bf16", quantize_head: bool = False) -> tuple[Llama, object | None]:
    """The model, its weights in `weights`' format (and `quantize_head`, as random_model), and its
    tokenizer (None when the directory has no tokenizer.json). Quantization follows the load, on
    the device."""
    check_format(weights, dtype)
    directory = Path(directory)
    config = read_config(directory)
    model = Llama(config)
    model.to(device=device, dtype=dtype)
    _load_weights(model, directory)
    quantize_model(model, weights, head=quantize_head)
    tokenizer_file = directory / "tokenizer.json"
    return model.eval(), (load_tokenizer(tokenizer_file) if tokenizer_file.exists() else None)


def read_config(directory: Path) -> LlamaConfig:
    return from_hf(read_config_json(directory))


def read_config_json(directory: Path) -> dict:
    """A Hugging Face checkpoint directory's config.json, as a dict (ModelError if it is not one)."""
    if not directory.is_dir():
        raise ModelError(f"no checkpoint directory at {directory}")
    path = directory / "config.json"
    if not path.is_file():
        raise ModelError(f"{directory} has no config.json: not a Hugging Face checkpoint")
    return read_json_object(path)


def read_json_object(path: Path) -> dict:
    """A JSON file holding an object, as a dict (ModelError, one line, for anything else)."""
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ModelError(f"{path} does not hold a JSON object")
    return value


def load_tokenizer(path: Path):
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ModelError("reading tokenizer.json needs the `tokenizers` package: pip install 'kforge[models]'") from None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the library raises its own exception types
        raise ModelError(f"{path} is not a tokenizer the `tokenizers` library can read: {exc}") from None


def _shards(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ModelError(f"{index} is not a safetensors index (no weight_map)") from None
        shards = [directory / name for name in dict.fromkeys(weight_map.values())]
    else:
        shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        raise ModelError(f"{directory} has no *.safetensors weights")
    for shard in shards:
        if not shard.is_file():
            raise ModelError(f"the index lists {shard.name}, which is not in {directory}")
    return shards


def hf_layer_parts(config: LlamaConfig) -> dict[str, tuple[str, int, int]]:
    """Each Hugging Face per-layer weight, by its name between `model.layers.N.` and `.weight`,
    as (kforge parameter, first row, rows): the fused weights hold several, stacked. The one
    table both directions read (loading here, export.py)."""
    q, kv, ffn, dim = config.q_dim, config.kv_dim, config.ffn_dim, config.dim
    return {
        "self_attn.q_proj": ("wqkv", 0, q), "self_attn.k_proj": ("wqkv", q, kv),
        "self_attn.v_proj": ("wqkv", q + kv, kv), "self_attn.o_proj": ("wo", 0, dim),
        "mlp.gate_proj": ("w_gate_up", 0, ffn), "mlp.up_proj": ("w_gate_up", ffn, ffn),
        "mlp.down_proj": ("w_down", 0, dim),
        "input_layernorm": ("attn_norm", 0, dim), "post_attention_layernorm": ("ffn_norm", 0, dim),
    }


def _destination(name: str, config: LlamaConfig) -> tuple[str, int] | None:
    """Where a checkpoint tensor goes: (kforge parameter, first row); ("", 0) for a name no
    Llama has; None for one to skip."""
    if name == "model.embed_tokens.weight":
        return "embed", 0
    if name == "model.norm.weight":
        return "norm", 0
    if name == "lm_head.weight":
        return ("lm_head", 0) if not config.tie_embeddings else None
    if name.endswith("rotary_emb.inv_freq"):  # older checkpoints saved the RoPE buffer: recomputed here
        return None
    parts = name.split(".")
    if len(parts) < 5 or parts[:2] != ["model", "layers"] or parts[-1] != "weight":
        return "", 0
    target = hf_layer_parts(config).get(".".join(parts[3:-1]))
    return (f"layers.{parts[2]}.{target[0]}", target[1]) if target else ("", 0)


def _load_weights(model: Llama, directory: Path) -> None:
    try:
        from safetensors import safe_open
    except ImportError:
        raise ModelError("reading a checkpoint needs the `safetensors` package: pip install 'kforge[models]'") from None
    params = dict(model.named_parameters())
    filled = {name: 0 for name in params}
    for shard in _shards(directory):
        try:
            handle = safe_open(str(shard), framework="pt")
        except Exception as exc:  # a truncated or foreign file
            raise ModelError(f"{shard} is not a readable safetensors file: {exc}") from None
        with handle:
            for name in handle.keys():
                where = _destination(name, model.config)
                if where is None:
                    continue
                target, row = where
                if target not in params:
                    raise ModelError(f"{shard.name}: unexpected tensor {name!r} for a Llama checkpoint")
                tensor = handle.get_tensor(name)
                param = params[target]
                if tensor.dim() != param.dim() or tensor.shape[1:] != param.shape[1:] or \
                        row + tensor.shape[0] > param.shape[0]:
                    raise ModelError(f"{shard.name}: {name} has shape {tuple(tensor.shape)}, which does not fit "
                                     f"{target} {tuple(param.shape)} as config.json describes it")
                with torch.no_grad():
                    param[row:row + tensor.shape[0]].copy_(tensor)
                filled[target] += tensor.shape[0] if tensor.dim() else 1
    missing = [name for name, p in params.items() if filled[name] != p.shape[0]]
    if missing:
        raise ModelError(f"the checkpoint lacks weights for {len(missing)} parameter(s), e.g. {missing[0]}")

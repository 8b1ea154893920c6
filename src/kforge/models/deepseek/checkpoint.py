"""A DeepSeek-V3 checkpoint in Hugging Face's layout, loaded into `DeepSeekV3`.

    model, tokenizer = from_pretrained("path/to/checkpoint")    # config.json, *.safetensors, tokenizer.json

The directory is what `DeepseekV3ForCausalLM.save_pretrained` writes, or deepseek-ai's own
release: `config.json` (model_type deepseek_v3), the weights in one `model.safetensors` or in
shards listed by `model.safetensors.index.json`, optionally `tokenizer.json`. How the names map:

- per block: input/post-attention norms; MLA's q_a_proj, q_a_layernorm, q_b_proj (or q_proj),
  kv_a_proj_with_mqa ([latent; RoPE key] rows, as `wkv_a`), kv_a_layernorm, kv_b_proj (per
  head [k_nope; v] rows), o_proj; a dense MLP's gate/up/down, concatenated into [gate; up];
  an MoE's router (`gate.weight`) and its `e_score_correction_bias`, one gate/up/down per
  expert, and the shared experts' MLP of width n_shared x moe_inter cut into n_shared experts
  (SwiGLU is a sum over its hidden units, so the cut changes nothing);
- the MTP block is layer `num_hidden_layers` of deepseek-ai's release (Hugging Face's model
  class has none, so its own `save_pretrained` writes none): `enorm`, `hnorm`, `eh_proj` and
  `shared_head.norm` beside a block's weights. `eh_proj` multiplies [enorm(embedding);
  hnorm(hidden)] there (the release's inference code and vLLM's); kforge's `proj` takes
  [hidden; embedding], so its two column halves are swapped. The release's copies of the
  embedding and head in that layer (`embed_tokens`, `shared_head.head`) are not read: the
  main model's are shared. A checkpoint without the layer leaves the MTP block at random
  weights (`model.mtp_from_checkpoint` is False): plain generation is exact, drafts are noise;
- RoPE: `rope_interleave` (Hugging Face's default for this model, and the release's layout)
  rotates adjacent pairs, as kforge does; without it, the pairs are (i, i + d/2), and the RoPE
  rows of q_b_proj and kv_a_proj_with_mqa are permuted to adjacent pairs as they load (q and k
  the same way, so every score is unchanged);
- FP8 weights (the release's: e4m3 with a `weight_scale_inv` of one fp32 scale a 128 x 128
  block, `quantization_config.weight_block_size`) are dequantized as they load.

RoPE: plain or YaRN (config.py), as deepseek-ai's config.json gives it (`rope_scaling`) or as
transformers 5 writes it (`rope_parameters`). Refused with one line: another architecture,
another RoPE scaling, softmax or unnormalized routing, MoE on every n-th layer only, tied
embeddings.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from kforge.errors import ModelError
from kforge.models.deepseek.config import DeepSeekConfig
from kforge.models.deepseek.model import DeepSeekV3
from kforge.models.llama.checkpoint import _shards, load_tokenizer, read_config_json

MODEL_TYPES = ("deepseek_v3",)


def config_from_hf(hf: dict) -> DeepSeekConfig:
    """A DeepSeekConfig from a deepseek_v3 config.json; ModelError naming what kforge does not model."""
    if hf.get("model_type") not in MODEL_TYPES:
        raise ModelError(f"config.json: model_type {hf.get('model_type')!r} is not DeepSeek-V3 ({', '.join(MODEL_TYPES)})")
    rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "yarn") or (rope_type == "yarn" and not rope.get("truncate", True)):
        raise ModelError(f"config.json: RoPE type {rope_type!r}: kforge's DeepSeek model has plain RoPE and YaRN "
                         "(with a truncated correction range) only")
    yarn = {}
    if rope_type == "yarn":
        original = rope.get("original_max_position_embeddings", 4096)
        factor = rope.get("factor") or hf.get("max_position_embeddings", original) / original
        if rope.get("attention_factor") is not None:
            raise ModelError("config.json: a given YaRN attention_factor is not modelled (kforge derives it from "
                             "mscale and mscale_all_dim)")
        yarn = {"rope_factor": float(factor), "rope_original_max_position": original,
                "rope_beta_fast": float(rope.get("beta_fast") or 32), "rope_beta_slow": float(rope.get("beta_slow") or 1),
                "rope_mscale": float(rope.get("mscale") or 0), "rope_mscale_all_dim": float(rope.get("mscale_all_dim") or 0)}
    for key, wanted in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("norm_topk_prob", True),
                        ("moe_layer_freq", 1), ("hidden_act", "silu"), ("tie_word_embeddings", False),
                        ("attention_bias", False)):
        if key in hf and hf[key] != wanted:
            raise ModelError(f"config.json: {key} = {hf[key]!r}; kforge's DeepSeek model supports {wanted!r} only")
    try:
        return DeepSeekConfig(
            vocab_size=hf["vocab_size"], dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
            n_dense_layers=hf.get("first_k_dense_replace", 0), n_heads=hf["num_attention_heads"],
            q_lora_rank=hf.get("q_lora_rank") or 0, kv_lora_rank=hf["kv_lora_rank"],
            qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
            v_head_dim=hf["v_head_dim"], ffn_dim=hf["intermediate_size"], moe_inter=hf["moe_intermediate_size"],
            n_routed_experts=hf["n_routed_experts"], n_shared_experts=hf.get("n_shared_experts") or 0,
            top_k=hf["num_experts_per_tok"], n_group=hf.get("n_group", 1), topk_group=hf.get("topk_group", 1),
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            max_position=hf.get("max_position_embeddings", 4096), **yarn)
    except KeyError as exc:
        raise ModelError(f"config.json lacks {exc.args[0]!r}, which a DeepSeek-V3 config has") from None


def from_pretrained(directory: str | Path, *, dtype: torch.dtype = torch.bfloat16,
                    device: torch.device | str = "cpu") -> tuple[DeepSeekV3, object | None]:
    """The model in `dtype` on `device`, and its tokenizer (None without tokenizer.json)."""
    directory = Path(directory)
    hf = read_config_json(directory)
    config = config_from_hf(hf)
    model = DeepSeekV3(config).init_random(0)  # every weight is overwritten below, the MTP block's if present
    model.to(dtype=dtype, device=device)
    block = (hf.get("quantization_config") or {}).get("weight_block_size", [128, 128])
    model.mtp_from_checkpoint = _load(model, directory, interleaved=hf.get("rope_interleave", True), block=block)
    tokenizer_file = directory / "tokenizer.json"
    return model.eval(), (load_tokenizer(tokenizer_file) if tokenizer_file.exists() else None)


class _Reader:
    """Every tensor of the shards by name, whichever shard holds it."""

    def __init__(self, directory: Path, stack: contextlib.ExitStack):
        try:
            from safetensors import safe_open
        except ImportError:
            raise ModelError("reading a checkpoint needs the `safetensors` package: pip install 'kforge[models]'") \
                from None
        self.where = {}
        for shard in _shards(directory):
            try:
                handle = stack.enter_context(safe_open(str(shard), framework="pt"))
            except Exception as exc:  # noqa: BLE001 - a truncated or foreign file
                raise ModelError(f"{shard} is not a readable safetensors file: {exc}") from None
            for name in handle.keys():
                self.where[name] = (shard, handle)

    def get(self, name: str, block: list[int]) -> torch.Tensor:
        """The tensor, dequantized where it is FP8 with a block-scale tensor beside it."""
        tensor = self.where[name][1].get_tensor(name)
        if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            scale_name = name + "_scale_inv"
            if scale_name not in self.where:
                raise ModelError(f"{name} is FP8 with no {scale_name} beside it")
            scale = self.where[scale_name][1].get_tensor(scale_name).float()
            rows, cols = tensor.shape
            expand = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
            if expand.shape != tensor.shape:
                raise ModelError(f"{scale_name} {tuple(scale.shape)} does not cover {name} {tuple(tensor.shape)} in "
                                 f"{block[0]} x {block[1]} blocks")
            tensor = tensor.float() * expand
        return tensor


def _rope_rows(rope_dim: int) -> torch.Tensor:
    """Source row of each destination row in a RoPE block: (i, i + d/2) pairs made adjacent."""
    half = torch.arange(rope_dim // 2)
    return torch.stack((half, half + rope_dim // 2), dim=1).flatten()


def _block_targets(rest: str, c: DeepSeekConfig, prefix: str, moe: bool, tensor: torch.Tensor,
                   interleaved: bool) -> list[tuple[str, tuple, torch.Tensor]]:
    """(kforge parameter, index into it, values) for one block weight named `rest` (after the
    layer number); [] when the name is not a block weight."""
    attn, ffn = prefix + "attn.", prefix + "ffn."
    whole = (slice(None),)
    if rest in ("self_attn.q_b_proj.weight", "self_attn.q_proj.weight", "self_attn.kv_a_proj_with_mqa.weight") \
            and not interleaved:
        tensor = tensor.clone()
        rope, rows = c.qk_rope_head_dim, _rope_rows(c.qk_rope_head_dim)
        starts = ([h * c.qk_head_dim + c.qk_nope_head_dim for h in range(c.n_heads)]
                  if "q_" in rest else [c.kv_lora_rank])
        for start in starts:
            tensor[start:start + rope] = tensor[start:start + rope][rows]
    simple = {
        "input_layernorm.weight": prefix + "attn_norm", "post_attention_layernorm.weight": prefix + "ffn_norm",
        "self_attn.q_a_proj.weight": attn + "wq_a", "self_attn.q_a_layernorm.weight": attn + "q_norm",
        "self_attn.q_b_proj.weight": attn + "wq_b", "self_attn.q_proj.weight": attn + "wq",
        "self_attn.kv_a_proj_with_mqa.weight": attn + "wkv_a", "self_attn.kv_a_layernorm.weight": attn + "kv_norm",
        "self_attn.kv_b_proj.weight": attn + "wkv_b", "self_attn.o_proj.weight": attn + "wo",
    }
    if rest in simple:
        return [(simple[rest], whole, tensor)]
    parts = rest.split(".")
    if not moe:
        rows = {"mlp.gate_proj.weight": ("w_gate_up", 0), "mlp.up_proj.weight": ("w_gate_up", c.ffn_dim),
                "mlp.down_proj.weight": ("w_down", 0)}.get(rest)
        return [(ffn + rows[0], (slice(rows[1], rows[1] + tensor.shape[0]),), tensor)] if rows else []
    if rest == "mlp.gate.weight":
        return [(ffn + "router", whole, tensor)]
    if rest == "mlp.gate.e_score_correction_bias":
        return [(ffn + "router_bias", whole, tensor)]
    inter = c.moe_inter
    offsets = {"gate_proj": ("w13", 0), "up_proj": ("w13", inter), "down_proj": ("w2", None)}
    if len(parts) == 5 and parts[:2] == ["mlp", "experts"] and parts[3] in offsets and parts[2].isdigit():
        expert = int(parts[2])
        if expert >= c.n_routed_experts:
            return []
        name, row = offsets[parts[3]]
        index = (expert,) if row is None else (expert, slice(row, row + inter))
        return [(ffn + name, index, tensor)]
    if len(parts) == 4 and parts[:2] == ["mlp", "shared_experts"] and parts[2] in offsets:
        name, row = offsets[parts[2]]
        targets = []
        for j in range(c.n_shared_experts):  # the shared MLP's hidden units, n_shared_experts experts' worth
            expert, units = c.n_routed_experts + j, slice(j * inter, (j + 1) * inter)
            if row is None:
                targets.append((ffn + name, (expert,), tensor[:, units]))
            else:
                targets.append((ffn + name, (expert, slice(row, row + inter)), tensor[units]))
        return targets
    return []


def _load(model: DeepSeekV3, directory: Path, *, interleaved: bool, block: list[int]) -> bool:
    """Fill the model's parameters; True when the checkpoint held the MTP block."""
    c = model.config
    params = dict(model.named_parameters())
    filled = dict.fromkeys(params, 0)
    with contextlib.ExitStack() as stack:
        reader = _Reader(directory, stack)
        for name in reader.where:
            if name.endswith(("_scale_inv", "rotary_emb.inv_freq")):
                continue  # read with its weight; RoPE is recomputed
            parts = name.split(".")
            if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
                found = [({"model.embed_tokens.weight": "embed", "model.norm.weight": "norm",
                           "lm_head.weight": "lm_head"}[name], (slice(None),), reader.get(name, block))]
            elif len(parts) > 3 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
                layer, rest = int(parts[2]), ".".join(parts[3:])
                if layer < c.n_layers:
                    found = _block_targets(rest, c, f"layers.{layer}.", c.is_moe(layer), reader.get(name, block),
                                           interleaved)
                elif layer == c.n_layers:  # the MTP block (depth 1)
                    mtp = {"enorm.weight": "mtp.embed_norm", "hnorm.weight": "mtp.hidden_norm",
                           "shared_head.norm.weight": "mtp.norm"}
                    if rest in mtp:
                        found = [(mtp[rest], (slice(None),), reader.get(name, block))]
                    elif rest == "eh_proj.weight":  # [embedding; hidden] columns there, [hidden; embedding] here
                        eh = reader.get(name, block)
                        found = [("mtp.proj", (slice(None),), torch.cat(eh.chunk(2, dim=1)[::-1], dim=1))]
                    elif rest in ("embed_tokens.weight", "shared_head.head.weight"):
                        continue  # copies of the main model's, which the MTP block shares
                    else:
                        found = _block_targets(rest, c, "mtp.block.", c.is_moe(c.n_layers), reader.get(name, block),
                                               interleaved)
                else:
                    continue  # deeper MTP modules: kforge drafts with depth 1
            else:
                found = []
            if not found:
                raise ModelError(f"{reader.where[name][0].name}: unexpected tensor {name!r} for a DeepSeek-V3 "
                                 f"checkpoint of this config.json")
            for target, index, values in found:
                param = params[target]
                slot = param[index]
                if tuple(values.shape) != tuple(slot.shape):
                    raise ModelError(f"{name} has shape {tuple(values.shape)} where {target}{_describe(index)} is "
                                     f"{tuple(slot.shape)}, as config.json describes it")
                with torch.no_grad():
                    slot.copy_(values)
                filled[target] += values.numel()
    mtp_loaded = any(filled[name] for name in params if name.startswith("mtp."))
    missing = [name for name, p in params.items() if filled[name] != p.numel()
               and (mtp_loaded or not name.startswith("mtp."))]
    if missing:
        raise ModelError(f"the checkpoint lacks weights for {len(missing)} parameter(s), e.g. {missing[0]}")
    return mtp_loaded


def _describe(index: tuple) -> str:
    def one(i):
        return f"{i.start}:{i.stop}" if isinstance(i, slice) and i != slice(None) else (":" if isinstance(i, slice)
                                                                                       else str(i))
    return "" if index == (slice(None),) else "[" + ", ".join(one(i) for i in index) + "]"

"""DeepSeek-V3 checkpoints (kforge.models.deepseek.checkpoint): a tiny model that Hugging Face's
`DeepseekV3ForCausalLM` writes loads and gives its logits (prefill and decode); deepseek-ai's
release layout (the MTP block as one more layer, FP8 weights with block scales, RoPE rows not
interleaved) round-trips a kforge model's weights exactly; what kforge does not model is refused
with one line."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from kforge.errors import ModelError
from kforge.models.deepseek.checkpoint import (
    _rope_rows,
    config_from_hf,
    from_pretrained,
)
from kforge.models.deepseek.config import preset
from kforge.models.deepseek.model import random_model

pytestmark = pytest.mark.usefixtures("one_thread")

TINY_HF = {"model_type": "deepseek_v3", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
           "moe_intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
           "n_shared_experts": 1, "n_routed_experts": 8, "routed_scaling_factor": 2.5, "kv_lora_rank": 32,
           "q_lora_rank": 64, "qk_rope_head_dim": 16, "v_head_dim": 32, "qk_nope_head_dim": 32, "n_group": 4,
           "topk_group": 2, "num_experts_per_tok": 2, "first_k_dense_replace": 1, "norm_topk_prob": True,
           "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}


def _hf_checkpoint(directory, **rope):
    """A tiny DeepseekV3ForCausalLM with weights large enough to route tokens apart, saved."""
    transformers = pytest.importorskip("transformers")
    config = transformers.DeepseekV3Config(**{k: v for k, v in TINY_HF.items() if k != "model_type"},
                                           rope_scaling=rope or None)
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.08 * torch.randn_like(p))
    model.save_pretrained(directory)
    return model


def _error(a, b):
    return float((a - b).norm() / b.norm())


# plain RoPE; DeepSeek-V3's YaRN (mscale = mscale_all_dim = 1: the softmax scale grows) on a 64-token
# original context; YaRN with mscale alone (cos and sin scaled, not the softmax)
ROPES = [{}, {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1.0,
              "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
         {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32}]


@pytest.mark.parametrize("rope", ROPES, ids=["plain RoPE", "YaRN as DeepSeek-V3", "YaRN, attention factor"])
def test_a_transformers_checkpoint_gives_transformers_logits_in_prefill_and_decode(tmp_path, rope):
    theirs = _hf_checkpoint(tmp_path, **rope)
    ours, tokenizer = from_pretrained(tmp_path, dtype=torch.float32)
    assert tokenizer is None and not ours.mtp_from_checkpoint, "Hugging Face's class writes no MTP block"
    assert ours.config.yarn == bool(rope)
    tokens = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = theirs(tokens[None]).logits[0].double()
    cache = ours.new_cache(1, 48)
    prefill = ours.logits(ours.prefill(tokens[:-1], cache))[0].double()
    decode = ours.logits(ours.decode(tokens[None, -1:], cache))[0, 0].double()
    assert expected.std() > 0.5, "the logits depend on the weights strongly enough to tell a mapping apart"
    assert _error(prefill, expected[:-1]) < 1e-5 and _error(decode, expected[-1]) < 1e-5, \
        (_error(prefill, expected[:-1]), _error(decode, expected[-1]))


def _release_state(model, *, interleaved: bool) -> dict[str, torch.Tensor]:
    """deepseek-ai's names for a kforge model's weights, its MTP block as layer n_layers."""
    c = model.config
    p = {name: t.detach().clone() for name, t in model.named_parameters()}
    state = {"model.embed_tokens.weight": p["embed"], "model.norm.weight": p["norm"], "lm_head.weight": p["lm_head"]}
    rows = _rope_rows(c.qk_rope_head_dim)
    inverse = torch.empty_like(rows)
    inverse[rows] = torch.arange(len(rows))

    def unpermute(t, starts):  # kforge's adjacent pairs back to (i, i + d/2)
        t = t.clone()
        for s in starts:
            t[s:s + len(rows)] = t[s:s + len(rows)][inverse]
        return t

    def block(prefix, src, moe):
        q_rows = [h * c.qk_head_dim + c.qk_nope_head_dim for h in range(c.n_heads)]
        wq_b, wkv_a = p[src + "attn.wq_b"], p[src + "attn.wkv_a"]
        if not interleaved:
            wq_b, wkv_a = unpermute(wq_b, q_rows), unpermute(wkv_a, [c.kv_lora_rank])
        out = {"input_layernorm.weight": p[src + "attn_norm"], "post_attention_layernorm.weight": p[src + "ffn_norm"],
               "self_attn.q_a_proj.weight": p[src + "attn.wq_a"], "self_attn.q_a_layernorm.weight": p[src + "attn.q_norm"],
               "self_attn.q_b_proj.weight": wq_b, "self_attn.kv_a_proj_with_mqa.weight": wkv_a,
               "self_attn.kv_a_layernorm.weight": p[src + "attn.kv_norm"],
               "self_attn.kv_b_proj.weight": p[src + "attn.wkv_b"], "self_attn.o_proj.weight": p[src + "attn.wo"]}
        if moe:
            w13, w2, inter, experts = p[src + "ffn.w13"], p[src + "ffn.w2"], c.moe_inter, c.n_routed_experts
            out["mlp.gate.weight"] = p[src + "ffn.router"]
            out["mlp.gate.e_score_correction_bias"] = p[src + "ffn.router_bias"]
            for e in range(experts):
                out[f"mlp.experts.{e}.gate_proj.weight"] = w13[e, :inter]
                out[f"mlp.experts.{e}.up_proj.weight"] = w13[e, inter:]
                out[f"mlp.experts.{e}.down_proj.weight"] = w2[e]
            out["mlp.shared_experts.gate_proj.weight"] = torch.cat(list(w13[experts:, :inter]))
            out["mlp.shared_experts.up_proj.weight"] = torch.cat(list(w13[experts:, inter:]))
            out["mlp.shared_experts.down_proj.weight"] = torch.cat(list(w2[experts:]), dim=1)
        else:
            gate, up = p[src + "ffn.w_gate_up"].chunk(2)
            out.update({"mlp.gate_proj.weight": gate, "mlp.up_proj.weight": up,
                        "mlp.down_proj.weight": p[src + "ffn.w_down"]})
        return {f"{prefix}{k}": v for k, v in out.items()}

    for layer in range(c.n_layers):
        state.update(block(f"model.layers.{layer}.", f"layers.{layer}.", c.is_moe(layer)))
    mtp = f"model.layers.{c.n_layers}."
    state.update(block(mtp, "mtp.block.", c.is_moe(c.n_layers)))
    hidden, embedding = p["mtp.proj"].chunk(2, dim=1)
    state.update({mtp + "enorm.weight": p["mtp.embed_norm"], mtp + "hnorm.weight": p["mtp.hidden_norm"],
                  mtp + "eh_proj.weight": torch.cat((embedding, hidden), dim=1), mtp + "shared_head.norm.weight":
                  p["mtp.norm"], mtp + "shared_head.head.weight": p["lm_head"], mtp + "embed_tokens.weight": p["embed"]})
    return state


def _fp8_blocks(weight: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes and one fp32 scale a block x block tile (the release's weight_scale_inv)."""
    rows, cols = weight.shape
    padded = torch.zeros(-(-rows // block) * block, -(-cols // block) * block)
    padded[:rows, :cols] = weight
    tiles = padded.view(padded.shape[0] // block, block, padded.shape[1] // block, block)
    scale = tiles.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448
    expand = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    return (weight / expand).to(torch.float8_e4m3fn), scale


def _save(directory, state, hf=None, shards=1):
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf or {**TINY_HF, "num_nextn_predict_layers": 1}))
    names = sorted(state)
    if shards == 1:
        save_file({n: state[n].clone() for n in names}, str(directory / "model.safetensors"))
        return
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        save_file({n: state[n].clone() for n in part}, str(directory / file))
        weight_map.update(dict.fromkeys(part, file))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.parametrize("interleaved, shared", [(True, 1), (False, 2)],
                         ids=["interleaved RoPE rows", "half-split RoPE rows, two shared experts"])
def test_the_release_layout_round_trips_every_weight_and_the_mtp_block(tmp_path, interleaved, shared):
    original = random_model(dataclasses.replace(preset("tiny"), n_shared_experts=shared), seed=3)
    _save(tmp_path, _release_state(original, interleaved=interleaved),
          {**TINY_HF, "num_nextn_predict_layers": 1, "rope_interleave": interleaved, "n_shared_experts": shared},
          shards=3)
    loaded, _ = from_pretrained(tmp_path, dtype=torch.float32)
    assert loaded.mtp_from_checkpoint
    mine = dict(loaded.named_parameters())
    for name, p in original.named_parameters():
        if interleaved or name.rsplit(".", 1)[-1] not in ("wq_b", "wkv_a"):
            assert torch.equal(mine[name], p), name
    tokens = torch.randint(0, 512, (9,), generator=torch.Generator().manual_seed(2))
    outputs = []
    for model in (original, loaded):  # the logits and the MTP draft's logits, whatever the RoPE row order
        cache, mtp_cache = model.new_cache(1, 16), model.new_cache(1, 16, mtp=True)
        hidden = model.prefill(tokens[:-1], cache)
        outputs.append((model.logits(hidden), model.mtp_logits(model.mtp_prefill(hidden, tokens[1:], mtp_cache))))
    for a, b in zip(*outputs):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def test_fp8_block_scaled_weights_are_dequantized_as_they_load(tmp_path):
    original = random_model(preset("tiny"), seed=4)
    state = _release_state(original, interleaved=True)
    quantized, expected = {}, {}
    for name, t in state.items():
        if name.endswith("proj.weight") and t.dim() == 2:  # the release quantizes the linear layers
            codes, scale = _fp8_blocks(t, 32)
            quantized[name], quantized[name + "_scale_inv"] = codes, scale
            expected[name] = codes.float() * scale.repeat_interleave(32, 0)[:t.shape[0]].repeat_interleave(32, 1)[:, :t.shape[1]]
        else:
            quantized[name] = t
    hf = {**TINY_HF, "num_nextn_predict_layers": 1,
          "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [32, 32]}}
    _save(tmp_path, quantized, hf)
    loaded, _ = from_pretrained(tmp_path, dtype=torch.float32)
    params = dict(loaded.named_parameters())
    assert torch.equal(params["layers.0.attn.wq_a"], expected["model.layers.0.self_attn.q_a_proj.weight"])
    assert torch.equal(params["layers.1.ffn.w13"][5, 64:], expected["model.layers.1.mlp.experts.5.up_proj.weight"])
    gap = (params["layers.0.attn.wo"] - dict(original.named_parameters())["layers.0.attn.wo"]).abs().max()
    assert 0 < gap < 0.1 * dict(original.named_parameters())["layers.0.attn.wo"].abs().max(), "e4m3 rounding, no more"
    del quantized["model.layers.0.self_attn.o_proj.weight_scale_inv"]
    _save(tmp_path, quantized, hf)
    with pytest.raises(ModelError, match="o_proj.weight is FP8 with no .*weight_scale_inv"):
        from_pretrained(tmp_path, dtype=torch.float32)


@pytest.mark.parametrize("change, message", [
    ({"model_type": "llama"}, "model_type 'llama' is not DeepSeek-V3"),
    ({"rope_scaling": {"type": "dynamic", "factor": 4}}, "RoPE type 'dynamic'"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 40, "truncate": False}}, "RoPE type 'yarn'"),
    ({"rope_scaling": {"type": "yarn", "factor": 40, "attention_factor": 1.2}}, "attention_factor is not modelled"),
    ({"rope_scaling": {"type": "yarn", "factor": 0.5}}, "YaRN needs rope_factor >= 1"),
    ({"norm_topk_prob": False}, "norm_topk_prob = False"),
    ({"scoring_func": "softmax"}, "scoring_func = 'softmax'"),
    ({"kv_lora_rank": 48}, "kv_lora_rank must be a power of two"),
    ({"hidden_size": None}, "dim must be a positive integer"),
])
def test_configs_kforge_does_not_model_are_refused_in_one_line(change, message):
    with pytest.raises(ModelError, match=message):
        config_from_hf({**TINY_HF, **change})
    with pytest.raises(ModelError, match="lacks 'kv_lora_rank'"):
        config_from_hf({k: v for k, v in TINY_HF.items() if k != "kv_lora_rank"})


def test_missing_unexpected_and_misshapen_weights_are_refused_in_one_line(tmp_path):
    state = _release_state(random_model(preset("tiny"), seed=5), interleaved=True)
    cases = [({k: v for k, v in state.items() if k != "model.layers.1.mlp.experts.3.down_proj.weight"},
              "lacks weights for 1 parameter"),
             ({**state, "model.layers.0.self_attn.q_norm.weight": torch.ones(4)}, "unexpected tensor"),
             ({**state, "model.layers.1.mlp.gate.weight": torch.zeros(8, 64)}, r"has shape \(8, 64\) where"),
             ({**state, "model.layers.1.mlp.experts.9.up_proj.weight": torch.zeros(64, 128)}, "unexpected tensor")]
    for i, (bad, message) in enumerate(cases):
        _save(tmp_path / str(i), bad)
        with pytest.raises(ModelError, match=message):
            from_pretrained(tmp_path / str(i), dtype=torch.float32)
    without_mtp = {k: v for k, v in state.items() if not k.startswith("model.layers.2.")}
    _save(tmp_path / "no-mtp", without_mtp)
    model, _ = from_pretrained(tmp_path / "no-mtp", dtype=torch.float32)
    assert not model.mtp_from_checkpoint
    with pytest.raises(ModelError, match="no checkpoint directory"):
        from_pretrained(tmp_path / "nowhere")


def test_the_command_generates_from_a_checkpoint_and_refuses_a_bad_one_in_one_line(tmp_path, capsys):
    from kforge.models.deepseek.generate import main

    _save(tmp_path / "ckpt", _release_state(random_model(preset("tiny"), seed=6), interleaved=True))
    main(["--checkpoint", str(tmp_path / "ckpt"), "--device", "cpu", "--prompt-len", "4", "--max-tokens", "3",
          "--k", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{tmp_path / 'ckpt'}, float32 on cpu") and lines[-1].split()[-1] == "yes", lines
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text(json.dumps({**TINY_HF, "rope_scaling": {"type": "dynamic"}}))
    with pytest.raises(SystemExit) as exited:
        main(["--checkpoint", str(tmp_path / "bad"), "--device", "cpu"])
    assert exited.value.code == 2 and "RoPE type 'dynamic'" in capsys.readouterr().err


def test_a_text_prompt_goes_through_the_checkpoints_tokenizer(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from kforge.models.deepseek import generate
    from kforge.models.deepseek.generate import main
    from kforge.models.sampling import SamplingParams

    original = random_model(preset("tiny"), seed=7)
    _save(tmp_path / "ckpt", _release_state(original, interleaved=True))
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(512)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "ckpt" / "tokenizer.json"))
    main(["--checkpoint", str(tmp_path / "ckpt"), "--device", "cpu", "--prompt", "w5 w300 w7", "--max-tokens", "4",
          "--k", "1"])
    out = capsys.readouterr().out
    want = generate(original, [5, 300, 7], SamplingParams(max_tokens=4)).tokens
    assert "prompt 3, 4 tokens" in out and out.splitlines()[-1] == "text (K = 0): " + " ".join(f"w{t}" for t in want)
    with pytest.raises(SystemExit) as exited:  # random weights have no tokenizer
        main(["--device", "cpu", "--prompt", "w5"])
    assert exited.value.code == 2 and "--prompt needs a checkpoint with a tokenizer.json" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--k", "a,b"], "argument --k: takes comma-separated integers, got 'a,b'"),
    (["--k", "2,0"], "argument --k: draft counts are at least 1"),
    (["--device", "gpu0"], "--device gpu0: not a device"),
    *([(["--device", "cuda"], "--device cuda: torch sees no CUDA device")] if not torch.cuda.is_available() else []),
])
def test_bad_arguments_are_one_usage_error_and_exit_2(argv, message, capsys):
    from kforge.models.deepseek.generate import main

    with pytest.raises(SystemExit) as exited:
        main(argv)
    error = capsys.readouterr().err
    assert exited.value.code == 2 and message in error and "Traceback" not in error

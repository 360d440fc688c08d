"""Hugging Face checkpoint I/O: ``save_pretrained`` / ``from_pretrained`` / ``Auto*`` round trips, metadata
on loaded parameters, and what happens with a checkpoint of another architecture."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import boost_hf  # noqa: F401  (registers boost_llama with the Auto classes)
from boost_hf import BoostLlamaConfig, BoostLlamaForCausalLM, ParallelConfig
from boost_hf.parallel.sharding import ShardSpec

def build(config: BoostLlamaConfig, seed: int = 0) -> BoostLlamaForCausalLM:
    torch.manual_seed(seed)
    return BoostLlamaForCausalLM(config).eval()


def logits(model, seed: int = 1) -> torch.Tensor:
    input_ids = torch.randint(0, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(input_ids).logits


@pytest.fixture
def saved(tmp_path, make_config, variant):
    """``(model, folder)``: a model of every variant and its ``save_pretrained`` folder."""
    model = build(make_config(variant))
    model.save_pretrained(tmp_path)
    return model, tmp_path


# ---------------------------------------------------------------------------------- round trip
def test_save_pretrained_writes_safetensors_and_config(saved):
    model, folder = saved
    assert (folder / "model.safetensors").is_file()
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "boost_llama"
    assert config["architectures"] == ["BoostLlamaForCausalLM"]
    assert config["bottleneck"] == model.config.bottleneck and config["rank"] == model.config.rank
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == sorted(model.state_dict())
        for name, tensor in model.state_dict().items():
            assert torch.equal(f.get_tensor(name), tensor), name


def test_auto_config_round_trip(saved):
    model, folder = saved
    config = AutoConfig.from_pretrained(folder)
    assert type(config) is BoostLlamaConfig
    expected = model.config.to_dict()
    for name in ("bottleneck", "rank", "only_lr_act", "lr_act", "lax_gate", "lax_latent_norm", "lax_base",
                 "lax_kronecker_factor", "num_key_value_heads", "head_dim", "rope_parameters", "tie_word_embeddings"):
        assert getattr(config, name) == expected[name], name


def test_auto_model_round_trip_is_bit_identical(saved):
    model, folder = saved
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    assert type(loaded) is BoostLlamaForCausalLM
    assert loaded.config.bottleneck == model.config.bottleneck
    assert next(loaded.parameters()).dtype == torch.float32
    assert torch.equal(logits(loaded), logits(model))


def test_from_pretrained_with_parallel_config_keeps_metadata(saved):
    model, folder = saved
    style = "btp" if model.config.bottleneck else "megatron"
    loaded = BoostLlamaForCausalLM.from_pretrained(folder, parallel_config=ParallelConfig(tp_style=style))
    assert torch.equal(logits(loaded), logits(model))
    for name, param in loaded.named_parameters():
        assert param.shard_spec == ShardSpec(tuple(param.shape)), name
    assert "tp=0/1" in repr(loaded)


def test_plain_load_is_the_single_device_model(saved):
    """A plain load carries no tensor-parallel state: the single-device model file is all there is."""
    _, folder = saved
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    assert not hasattr(loaded, "plan")
    assert not any(hasattr(param, "shard_spec") for param in loaded.parameters())


def test_loaded_model_prints(make_config, tmp_path):
    build(make_config("cola")).save_pretrained(tmp_path)
    repr(BoostLlamaForCausalLM.from_pretrained(tmp_path))  # extra_repr reads weight.shard_spec


def test_tied_embeddings_round_trip(make_config, tmp_path):
    model = build(make_config("cola", tie_word_embeddings=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(logits(loaded), logits(model))


# ---------------------------------------------------------------------------------- LLaMA checkpoints
def test_llama_checkpoint_loads_into_full_rank_boost(make_config, tmp_path):
    boost_config = make_config()
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(**{k: getattr(boost_config, k) for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "max_position_embeddings")})).eval()
    llama.save_pretrained(tmp_path)
    boost = BoostLlamaForCausalLM.from_pretrained(tmp_path)
    assert boost.config.bottleneck is None and boost.config.num_key_value_heads == 2
    assert (logits(boost) - logits(llama)).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="architecture"):
        BoostLlamaForCausalLM.from_pretrained(tmp_path, config=make_config("cola"), parallel_config=ParallelConfig())


# ---------------------------------------------------------------------------------- another architecture
def test_state_dict_of_another_architecture_is_rejected(make_config):
    cola = build(make_config("cola")).state_dict()
    with pytest.raises(RuntimeError, match=r"(?s)Missing key\(s\).*q_proj\.weight.*Unexpected key\(s\).*q_proj\.A"):
        build(make_config()).load_state_dict(cola, strict=True)
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*q_proj\.gate"):
        build(make_config("lax-dense")).load_state_dict(cola, strict=True)
    with pytest.raises(RuntimeError, match="size mismatch"):
        build(make_config("cola", rank=4)).load_state_dict(cola, strict=True)


def test_svd_and_cola_checkpoints_differ_only_in_config_json(make_config, tmp_path):
    """svd and cola have the same parameters: only config.json tells them apart, and from_pretrained reads it."""
    build(make_config("cola")).save_pretrained(tmp_path)
    build(make_config("svd")).load_state_dict(build(make_config("cola")).state_dict(), strict=True)
    assert AutoModelForCausalLM.from_pretrained(tmp_path).config.bottleneck == "cola"


@pytest.mark.parametrize("other", ["full", "lax-dense", "cola-rank-4"])
def test_checkpoint_of_another_architecture_with_parallel_config_raises(make_config, tmp_path, other):
    """The saved config.json names the fields first; past that check (``check_architecture=False``) the weights do."""
    build(make_config("cola")).save_pretrained(tmp_path)
    config = make_config("cola", rank=4) if other == "cola-rank-4" else make_config(other)
    with pytest.raises(ValueError, match="was saved from another architecture than the config used to load it"):
        BoostLlamaForCausalLM.from_pretrained(tmp_path, config=config, parallel_config=ParallelConfig())
    with pytest.raises(ValueError, match="does not match this model's architecture"):
        BoostLlamaForCausalLM.from_pretrained(tmp_path, config=config, parallel_config=ParallelConfig(), check_architecture=False)


def test_checkpoint_of_another_architecture_plain_from_pretrained(make_config, tmp_path):
    """A plain load with the wrong config names the differing fields of the saved config.json, and (past that check)
    the missing/unexpected weights instead of leaving garbage."""
    build(make_config("cola")).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"another architecture .*\(bottleneck: checkpoint 'cola', config None; rank: checkpoint 8"):
        BoostLlamaForCausalLM.from_pretrained(tmp_path, config=make_config())
    with pytest.raises(ValueError, match=r"another architecture .*\(rank: checkpoint 8, config 4\)"):
        BoostLlamaForCausalLM.from_pretrained(tmp_path, config=make_config("cola", rank=4))
    unchecked = {"check_architecture": False}
    with pytest.raises(ValueError, match=r"does not match.*missing.*_proj.weight.*unexpected.*_proj.A"):
        BoostLlamaForCausalLM.from_pretrained(tmp_path, config=make_config(), **unchecked)
    with pytest.raises(ValueError, match=r"shape mismatch.*q_proj.A"):
        BoostLlamaForCausalLM.from_pretrained(tmp_path, config=make_config("cola", rank=4), **unchecked)
    with pytest.raises(ValueError, match=r"missing.*latent_norm"):
        BoostLlamaForCausalLM.from_pretrained(tmp_path, config=make_config("lax-dense"), **unchecked)

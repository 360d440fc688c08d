"""A checkpoint written by the CoLA authors' code (``alvin-zyl/CoLA``) loads as it is, at TP 1 and 2.

The folder is built here from one of our models by the inverse of the documented mapping (``*.cola_a [in, r]`` =
``A^T``, ``*.cola_b [r, out]`` = ``B^T``, every other name LLaMA's), with a ``config.json`` as their
``ColaConfig`` (a transformers 4.48 ``LlamaConfig`` plus ``rank``, ``lr_act_type``, ``only_lr_act``) writes it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from boost_hf import BoostLlamaConfig, BoostLlamaForCausalLM, ParallelConfig
from tests.parallel.tp2_model_cases import section

# no GQA (their k/v projections are heads * head_dim wide); pad_token_id 0 as in their configs
SHAPE = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, rank=8)


def authors_config_json(config: BoostLlamaConfig) -> dict:
    """``config.json`` as the authors' ``ColaConfig.save_pretrained`` (transformers 4.48) writes it."""
    return {
        "architectures": ["ColaForCausalLM"], "attention_bias": config.attention_bias, "attention_dropout": 0.0,
        "bos_token_id": 0, "eos_token_id": 1, "head_dim": config.head_dim, "hidden_act": "silu",
        "hidden_size": config.hidden_size, "initializer_range": 0.02, "intermediate_size": config.intermediate_size,
        "lr_act_type": "silu", "max_position_embeddings": 2048, "max_sequence_length": 1024, "mlp_bias": config.mlp_bias,
        "model_type": "cola", "num_attention_heads": config.num_attention_heads, "num_hidden_layers": config.num_hidden_layers,
        "num_key_value_heads": config.num_key_value_heads, "only_lr_act": config.only_lr_act, "pad_token_id": 0,
        "pretraining_tp": 1, "rank": config.rank, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "torch_dtype": "float32", "transformers_version": "4.48.3", "use_cache": True,
        "vocab_size": config.vocab_size,
    }


def write_authors_checkpoint(model: BoostLlamaForCausalLM, folder: Path) -> None:
    """Our model in the authors' layout: ``A`` -> ``cola_a = A^T``, ``B`` -> ``cola_b = B^T``."""
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name.endswith(".A"):
            name, tensor = name[: -len("A")] + "cola_a", tensor.T
        elif name.endswith(".B"):
            name, tensor = name[: -len("B")] + "cola_b", tensor.T
        tensors[name] = tensor.contiguous()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(authors_config_json(model.config), indent=2))


def ours(**overrides) -> BoostLlamaForCausalLM:
    torch.manual_seed(3)
    config = BoostLlamaConfig(**{**SHAPE, "bottleneck": "cola", "pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 1, **overrides})
    return BoostLlamaForCausalLM(config).eval()


def ids() -> torch.Tensor:
    return torch.randint(0, SHAPE["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize(
    "overrides", [dict(only_lr_act=False), dict(only_lr_act=True, attention_bias=True, mlp_bias=True)], ids=["60m-like", "biases"]
)
def test_authors_checkpoint_loads_as_it_is_and_saves_canonical(tmp_path, overrides):
    model = ours(**overrides)
    write_authors_checkpoint(model, tmp_path / "authors")
    loaded = BoostLlamaForCausalLM.from_pretrained(tmp_path / "authors")
    config = loaded.config
    assert (config.bottleneck, config.rank, config.lr_act, config.pad_token_id) == ("cola", 8, "silu", 0)
    assert (config.only_lr_act, config.attention_bias, config.mlp_bias) == (model.config.only_lr_act, model.config.attention_bias, model.config.mlp_bias)
    assert not hasattr(config, "max_sequence_length") and not hasattr(config, "lr_act_type")
    with torch.no_grad():
        expected = model(ids()).logits
        assert torch.equal(loaded(ids()).logits, expected)
        assert loaded.model.embed_tokens.weight[0].abs().max() == 0  # their frozen zero padding row
    assert loaded.model.embed_tokens.padding_idx == 0

    loaded.save_pretrained(tmp_path / "canonical")
    with safe_open(str(tmp_path / "canonical" / "model.safetensors"), framework="pt") as f:
        saved = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    assert saved == {name: tuple(p.shape) for name, p in model.state_dict().items()}
    assert json.loads((tmp_path / "canonical" / "config.json").read_text())["model_type"] == "boost_llama"
    again = BoostLlamaForCausalLM.from_pretrained(tmp_path / "canonical")
    with torch.no_grad():
        assert torch.equal(again(ids()).logits, expected)


def test_auto_class_with_our_config_loads_the_authors_checkpoint(tmp_path):
    model = ours()
    write_authors_checkpoint(model, tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, config=BoostLlamaConfig.from_pretrained(tmp_path))
    assert isinstance(loaded, BoostLlamaForCausalLM)
    with torch.no_grad():
        assert torch.equal(loaded(ids()).logits, model(ids()).logits)


def test_what_the_authors_model_cannot_run_is_refused(tmp_path):
    model = ours()
    write_authors_checkpoint(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for field, value, message in (("num_key_value_heads", 2, "no GQA"), ("pretraining_tp", 2, "pretraining_tp=2"),
                                  ("rope_scaling", {"type": "linear", "factor": 2.0}, "rope_scaling"),
                                  ("model_type", "cola_m", "CoLA-M checkpoint.*not converted")):
        (tmp_path / "config.json").write_text(json.dumps({**config, field: value}))
        with pytest.raises(ValueError, match=message):
            BoostLlamaForCausalLM.from_pretrained(tmp_path)


def _load_at_tp(folder: str) -> dict:
    """Inside a launched group: the authors' checkpoint at TP=world under btp and vanilla vs one device."""
    single = BoostLlamaForCausalLM.from_pretrained(folder)
    out = {}
    with torch.no_grad():
        expected = single(ids()).logits
        for style in ("btp", "vanilla"):
            sharded = BoostLlamaForCausalLM.from_pretrained(folder, parallel_config=ParallelConfig(tp_size=2, tp_style=style))
            out[style] = float((sharded(ids()).logits - expected).abs().max())
    return out


def authors_checkpoint_at_tp() -> dict:
    """Inside a launched group: rank 0 writes the authors' checkpoint of a model with biases; every rank loads it."""
    import torch.distributed as dist

    from tests.parallel.tp_cases import shared_temporary_directory

    with shared_temporary_directory() as folder:
        if dist.get_rank() == 0:
            write_authors_checkpoint(ours(attention_bias=True, mlp_bias=True), Path(folder))
        dist.barrier()
        return _load_at_tp(folder)


def test_authors_checkpoint_at_tp2(tp2_model_results):
    """Run in the 2-rank launch shared with other files (tests/parallel/tp2_model_cases.py)."""
    for rank_result in section(tp2_model_results, "authors"):
        assert rank_result["btp"] <= 1e-5 and rank_result["vanilla"] <= 1e-5, rank_result

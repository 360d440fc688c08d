"""The final folder of a run is publishable as it is: a Hub repo's files, model card with Hub metadata and the
run's numbers, inference settings, tokenizer context and special tokens consistent with how training packed
documents, and a manifest that still verifies."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
import yaml
from transformers import AutoTokenizer, GenerationConfig

from boost_hf import BoostLlamaConfig
from boost_hf.checkpoint.integrity import verify_checkpoint
from boost_hf.perf.flops import forward_flops_per_token
from boost_hf.training.publish import model_card, save_tokenizer

from .conftest import BLOCK


def card_of(folder) -> tuple[dict, str]:
    text = open(os.path.join(folder, "README.md")).read()
    _, header, body = text.split("---\n", 2)
    return yaml.safe_load(header), body


def test_final_folder_is_a_hub_repo(trained_run):
    trainer, final = trained_run
    names = set(os.listdir(final))
    assert {"config.json", "generation_config.json", "model.safetensors", "README.md", "configuration_boost_llama.py",
            "modeling_boost_llama.py", "tokenizer.json", "tokenizer_config.json", "manifest.json"} <= names, names
    verify_checkpoint(str(final), trainer.model.config)  # the card and code are in the manifest, which still verifies


def test_inference_settings_and_tokenizer(trained_run):
    trainer, final = trained_run
    config = json.load(open(os.path.join(final, "config.json")))
    assert config["use_cache"] is True and trainer.model.config.use_cache is False  # the training model is unchanged
    assert GenerationConfig.from_pretrained(final).use_cache is True
    tokenizer = AutoTokenizer.from_pretrained(final)
    assert tokenizer.model_max_length == BLOCK
    # training packed "text </s> text </s>": no BOS declared (tools would prepend it), EOS the same as in training
    assert not trainer.trained_with_bos and tokenizer.bos_token is None and config["bos_token_id"] is None
    assert tokenizer.eos_token_id == config["eos_token_id"] == trainer.processing_class.eos_token_id
    assert tokenizer("The river").input_ids == trainer.processing_class("The river", add_special_tokens=False).input_ids
    assert trainer.processing_class.bos_token == "<s>"  # the trainer's own tokenizer is not modified


def test_a_declared_bos_that_training_used_is_kept(trained_run, tmp_path):
    tokenizer = trained_run[0].processing_class
    save_tokenizer(tokenizer, tmp_path / "used", context=16, used_bos=True)
    save_tokenizer(tokenizer, tmp_path / "unused", context=None, used_bos=False)
    used, unused = AutoTokenizer.from_pretrained(tmp_path / "used"), AutoTokenizer.from_pretrained(tmp_path / "unused")
    assert (used.bos_token, used.model_max_length) == ("<s>", 16)
    assert unused.bos_token is None and unused.model_max_length == tokenizer.model_max_length


def test_model_card(trained_run):
    trainer, final = trained_run
    metadata, body = card_of(final)
    assert metadata["library_name"] == "transformers" and metadata["pipeline_tag"] == "text-generation"
    assert metadata["license"] == "apache-2.0" and metadata["datasets"] == ["generated-test-text"]
    assert {"boost-hf", "cola", "low-rank"} <= set(metadata["tags"])
    assert "LlamaForCausalLM" in metadata["base_model_architecture"]
    config = trainer.model.config
    params = sum(p.numel() for p in trainer.model.parameters())
    full = BoostLlamaConfig(**{**config.to_dict(), "bottleneck": None})
    ratio = forward_flops_per_token(config, BLOCK) / forward_flops_per_token(full, BLOCK)
    assert f"| parameters | {params:,} |" in body and f"| rank | {config.rank} |" in body
    assert f"| FLOPs vs full rank | {ratio:.3f} | 1.000 |" in body
    assert "tp_size `1`, dp_size `1`, tp_style `btp`" in body
    assert f"| optimizer steps | {trainer.state.global_step} |" in body and "| global batch (sequences) | 4 |" in body
    assert f"| training tokens | {trainer.state.global_step * 4 * BLOCK} |" in body and "| peak learning rate | 0.003 |" in body
    last = [log for log in trainer.state.log_history if "eval_bits_per_byte" in log][-1]
    assert f"| eval_perplexity | {last['eval_perplexity']:.4f} |" in body
    assert f"| eval_bits_per_byte | {last['eval_bits_per_byte']:.4f} |" in body
    assert "trust_remote_code=True" in body and "parallel_config=boost_hf.ParallelConfig" in body
    assert "= LlamaForCausalLM.from_pretrained" not in body  # only full-rank models load as plain LLaMA


def test_full_rank_card_says_how_to_load_as_llama():
    config = BoostLlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    card = model_card(config, seq_len=16, license="mit")
    metadata = yaml.safe_load(card.split("---\n")[1])
    assert metadata["license"] == "mit" and "full-rank" in metadata["tags"] and metadata["base_model_architecture"] == "LlamaForCausalLM"
    assert "= LlamaForCausalLM.from_pretrained" in card and "| FLOPs vs full rank | 1.000 | 1.000 |" in card


def test_tensor_train_card_names_its_cores():
    config = BoostLlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              bottleneck="tt", tt_cores=4)
    card = model_card(config, seq_len=16, license="mit")
    assert "# tensor-train LLaMA" in card and "contracted from `4` tensor-train cores (`tt_rank=8`" in card
    assert "tt" in yaml.safe_load(card.split("---\n")[1])["tags"]


def test_push_to_hub_card_is_boost_hfs(trained_run, tmp_path):
    """Transformers' push_to_hub path writes its card through ``create_model_card``: ours, in output_dir."""
    trainer, _ = trained_run
    trainer.create_model_card()
    metadata, _ = card_of(trainer.args.output_dir)
    assert metadata["library_name"] == "transformers" and "boost-hf" in metadata["tags"]


def test_a_checkpoint_exports_to_the_final_folder(trained_run, tmp_path):
    """A training checkpoint holds the Hugging Face folder without weights (config with remote code, card, tokenizer)
    beside its DCP shards; ``boost-hf export`` (:func:`~boost_hf.training.publish.export_checkpoint`) writes the final folder from it: the same
    files, the weights split into safetensors files of at most ``max_shard_size`` with transformers' index (the same
    tensors), loadable, and a manifest that verifies."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from boost_hf.checkpoint.weights_io import resolve_checkpoint_files
    from boost_hf.cli import main

    trainer, final = trained_run
    trainer._save_checkpoint(trainer.model, None)
    checkpoint = os.path.join(trainer.args.output_dir, "checkpoint-6")
    assert {"configuration_boost_llama.py", "modeling_boost_llama.py", "README.md", "tokenizer.json", "config.json"} <= set(os.listdir(checkpoint))
    assert not [name for name in os.listdir(checkpoint) if name.endswith(".safetensors")]
    exported = str(tmp_path / "exported")
    assert main(["export", checkpoint, exported, "--max-shard-size", "20KB"]) == 0  # boost-hf export
    names, final_names = set(os.listdir(exported)), set(os.listdir(final))
    weights = {n for n in names if n.startswith("model-")}
    assert len(weights) > 2 and names - weights == (final_names - {"model.safetensors"}) | {"model.safetensors.index.json"}
    for name in ("config.json", "generation_config.json", "README.md", "tokenizer.json", "modeling_boost_llama.py"):
        assert open(os.path.join(exported, name)).read() == open(os.path.join(final, name)).read(), name
    shards = {}
    for path in resolve_checkpoint_files(exported):
        tensors = load_file(path)
        assert len(tensors) == 1 or sum(t.numel() * t.element_size() for t in tensors.values()) <= 20_000, path  # 20KB
        shards.update(tensors)
    whole = load_file(os.path.join(final, "model.safetensors"))
    assert shards.keys() == whole.keys() and all(torch.equal(shards[k], whole[k]) for k in whole)
    verify_checkpoint(exported, trainer.model.config)
    ids = torch.tensor([[1, 5, 9, 4]])
    with torch.no_grad():
        assert torch.equal(AutoModelForCausalLM.from_pretrained(exported)(ids).logits, AutoModelForCausalLM.from_pretrained(final)(ids).logits)


def test_export_never_replaces_its_source_a_run_or_a_folder_unless_told(tmp_path, capsys):
    """``boost-hf export CHECKPOINT OUT`` refuses an OUT that is the checkpoint, holds it (its run folder) or lies
    inside it, even with --overwrite; another run, another checkpoint or any non-empty folder only with --overwrite;
    a file never. Each refusal exits 2 before reading the checkpoint, and leaves every folder as it was."""
    from boost_hf.cli import main
    from boost_hf.training.publish import check_export_target

    def folder(path, *names):
        for name in names:
            (path / name).parent.mkdir(parents=True, exist_ok=True)
            (path / name).write_text("x")
        return str(path)

    run = tmp_path / "run"
    checkpoint = folder(run / "checkpoint-4", "dcp/.metadata", "config.json")
    other_run = folder(tmp_path / "other-run", "checkpoint-2/dcp/.metadata", ".boost_hf.lock")
    other_checkpoint = folder(tmp_path / "checkpoint-9", "dcp/.metadata")
    export = folder(tmp_path / "export", "model.safetensors")
    a_file = folder(tmp_path, "notes.txt") + "/notes.txt"
    refusals = [
        ([str(run)], r"holds the checkpoint"), ([str(run), "--overwrite"], r"holds the checkpoint"),
        ([checkpoint, "--overwrite"], r"is the checkpoint itself"), ([checkpoint + "/hf"], r"is inside the checkpoint"),
        ([other_run], r"holds a training run \(\.boost_hf\.lock, checkpoint-2\): exporting there would delete it"),
        ([other_checkpoint], r"is a training checkpoint \(it holds dcp/\)"),
        ([export], r"is not empty \(model\.safetensors\).*pass --overwrite"),
        ([a_file, "--overwrite"], r"exists and is not a folder"),
    ]
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    for arguments, message in refusals:
        with pytest.raises(SystemExit) as stopped:
            main(["export", checkpoint, *arguments])
        assert stopped.value.code == 2, arguments
        assert re.search(message, capsys.readouterr().err), arguments
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before
    for target in (other_run, other_checkpoint, export):
        check_export_target(checkpoint, target, overwrite=True)
    (tmp_path / "empty").mkdir()
    check_export_target(checkpoint, str(tmp_path / "empty"))
    check_export_target(checkpoint, str(tmp_path / "new"))

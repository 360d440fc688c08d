"""Manifest (size + SHA-256 of every file) and architecture record of checkpoint folders."""

from __future__ import annotations

import json

import pytest

from boost_hf import BoostLlamaConfig
from boost_hf.checkpoint.integrity import (
    ARCHITECTURE_METADATA_KEY,
    CheckpointIntegrityError,
    architecture_metadata,
    architecture_record,
    check_architecture,
    read_manifest,
    verify_checkpoint,
    verify_manifest,
    write_manifest,
)


def config(**fields) -> BoostLlamaConfig:
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                bottleneck="cola", rank=16)
    return BoostLlamaConfig(**{**base, **fields})


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "global_step3").mkdir()
    (tmp_path / "global_step3" / "optim.pt").write_bytes(b"x" * 10)
    write_manifest(str(tmp_path), config())
    return tmp_path


def test_an_intact_folder_verifies(folder):
    manifest = verify_manifest(str(folder))
    assert sorted(manifest["files"]) == ["global_step3/optim.pt", "model.safetensors"]
    verify_checkpoint(str(folder), config())


def test_a_flipped_byte_is_named(folder):
    data = bytearray((folder / "model.safetensors").read_bytes())
    data[100] ^= 0xFF
    (folder / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointIntegrityError, match="model.safetensors' is corrupted"):
        verify_manifest(str(folder))


def test_truncated_and_missing_files_are_named(folder):
    (folder / "global_step3" / "optim.pt").write_bytes(b"x")
    with pytest.raises(CheckpointIntegrityError, match="optim.pt' has 1 bytes, the manifest says 10"):
        verify_manifest(str(folder))
    (folder / "global_step3" / "optim.pt").unlink()
    with pytest.raises(CheckpointIntegrityError, match="incomplete: global_step3/optim.pt is missing"):
        verify_manifest(str(folder))


def test_a_folder_without_manifest_is_incomplete(tmp_path):
    with pytest.raises(CheckpointIntegrityError, match="has no manifest.json: its save did not complete"):
        verify_manifest(str(tmp_path))


@pytest.mark.parametrize("other, message", [
    (dict(bottleneck="svd"), "bottleneck: checkpoint 'cola', config 'svd'"),
    (dict(only_lr_act=False), "only_lr_act: checkpoint True, config False"),
    (dict(rank=8), "rank: checkpoint 16, config 8"),
    (dict(lr_act="gelu"), "lr_act: checkpoint 'silu', config 'gelu'"),
])
def test_another_architecture_is_refused(folder, other, message):
    with pytest.raises(CheckpointIntegrityError, match=message):
        verify_checkpoint(str(folder), config(**other))


def test_unused_options_do_not_count():
    assert architecture_record(config(bottleneck="svd", lr_act="gelu")) == architecture_record(config(bottleneck="svd"))
    assert architecture_record(config(bottleneck=None, rank=8)) == architecture_record(config(bottleneck=None))
    lax = config(bottleneck="lax", lax_gate="kronecker")
    assert architecture_record(lax)["lax_kronecker_factor"] == [4, 4]
    check_architecture(json.loads(architecture_metadata(lax)[ARCHITECTURE_METADATA_KEY]), lax)


@pytest.fixture
def saved_cola(tmp_path):
    import torch

    from boost_hf import BoostLlamaForCausalLM

    torch.manual_seed(0)
    model = BoostLlamaForCausalLM(config(bottleneck="lax", lax_base="cola", num_key_value_heads=4))
    model.save_pretrained(tmp_path)
    write_manifest(str(tmp_path), model.config)
    return tmp_path


@pytest.mark.parametrize("how, message", [
    ({"config": config(bottleneck="lax", lax_base="svd", num_key_value_heads=4)}, "lax_base: checkpoint 'cola', config 'svd'"),
    ({"only_lr_act": False}, "only_lr_act: checkpoint True, config False"),
    ({"config_json": {"lax_base": "svd"}}, "lax_base: checkpoint 'cola', config 'svd'"),
])
@pytest.mark.parametrize("parallel", [False, True], ids=["plain", "tp1-lowrank-checkpointing"])
def test_from_pretrained_refuses_a_config_computing_another_function(saved_cola, how, message, parallel):
    from boost_hf import BoostLlamaForCausalLM, ParallelConfig

    kwargs = dict(how)
    if "config_json" in kwargs:  # config.json edited after the save
        path = saved_cola / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **kwargs.pop("config_json")}))
    if parallel:
        kwargs["parallel_config"] = ParallelConfig(activation_checkpointing="lowrank")
    with pytest.raises(ValueError, match=rf"was saved from another architecture than the config used to load it \(.*{message}.*"
                                         r"or pass check_architecture=False"):
        BoostLlamaForCausalLM.from_pretrained(saved_cola, **kwargs)
    loaded = BoostLlamaForCausalLM.from_pretrained(saved_cola, check_architecture=False, **kwargs)  # the documented override
    assert loaded.config.architecture_differences(read_manifest(str(saved_cola))["architecture"])


def test_from_pretrained_with_its_own_config_loads(saved_cola):
    from boost_hf import BoostLlamaForCausalLM

    assert BoostLlamaForCausalLM.from_pretrained(saved_cola).config.lax_base == "cola"


@pytest.mark.parametrize("saved, used, message", [
    (config(), config(bottleneck="svd"), "bottleneck: checkpoint 'cola', config 'svd'"),  # the same tensors, no activation
    (config(bottleneck="lax", lax_base="cola", num_key_value_heads=4), config(bottleneck="lax", lax_base="svd", num_key_value_heads=4),
     "lax_base: checkpoint 'cola', config 'svd'"),
    (config(), {"only_lr_act": False}, "only_lr_act: checkpoint True, config False"),
], ids=["cola-as-svd", "lax-base-flipped", "only_lr_act-override"])
def test_a_folder_without_manifest_is_checked_against_its_config_json(tmp_path, saved, used, message):
    """Plain ``save_pretrained`` writes no manifest: the saved ``config.json`` is the record (the cola folder read as svd
    used to load and compute another function)."""
    import torch

    from boost_hf import BoostLlamaForCausalLM

    torch.manual_seed(0)
    BoostLlamaForCausalLM(saved).save_pretrained(tmp_path)
    assert not (tmp_path / "manifest.json").exists()
    kwargs = {"config": used} if isinstance(used, BoostLlamaConfig) else used
    with pytest.raises(ValueError, match=rf"'{tmp_path}' was saved from another architecture than the config used to load it "
                                         rf"\(.*{message}.*\): its weights would compute another function.*check_architecture=False"):
        BoostLlamaForCausalLM.from_pretrained(tmp_path, **kwargs)
    assert BoostLlamaForCausalLM.from_pretrained(tmp_path, check_architecture=False, **kwargs)  # the documented override
    assert BoostLlamaForCausalLM.from_pretrained(tmp_path).config.architecture_record() == saved.architecture_record()


def test_hashing_shares_give_each_rank_its_own_files_then_balance_the_rest():
    from boost_hf.checkpoint.integrity import hashing_shares

    files = {"dcp/__0_0.distcp": 100, "dcp/__1_0.distcp": 100, "dcp/__3_0.distcp": 90, "rng_state_2.pth": 5,
             "dcp/.metadata": 10, "config.json": 2, "big.pt": 60, "rng_state_7.pth": 5}
    shares = hashing_shares(files, 4)
    assert sorted(n for share in shares for n in share) == sorted(files)  # every file once
    assert "dcp/__1_0.distcp" in shares[1] and "dcp/__3_0.distcp" in shares[3] and "rng_state_2.pth" in shares[2]
    assert shares[2][:2] == ["rng_state_2.pth", "big.pt"]  # the largest other file to the least loaded rank
    assert hashing_shares(files, 4) == shares and sum(map(len, hashing_shares(files, 1))) == len(files)


@pytest.mark.parametrize("text", ['{"files": {"a": {"size": 1', "", '{"version": 1}', '{"files": {"a": 3}}'])
def test_a_damaged_manifest_is_named(folder, text):
    (folder / "manifest.json").write_text(text)
    with pytest.raises(CheckpointIntegrityError, match=rf"'{folder / 'manifest.json'}' is damaged \(not a valid manifest: "):
        verify_manifest(str(folder))

"""Tied embeddings (``--tie_word_embeddings true``, as the BOOST release's 1B configs) in every layout that can hold
them: train, checkpoint, resume at another layout, ``final/``, ``boost-hf export`` and a load with plain transformers
where boost-hf cannot be imported; refused before training, with the fix, where the embedding and the LM head are
split apart (BTP at tp > 1: along d and along the vocabulary; a pipeline: on the first and the last stage).

Two launches (``tied_cases.py``, a tied CoLA model, 6 steps of the same global batch of 8): 4 processes (DDP at
tp 1 x dp 4 without a checkpoint, vanilla TP at tp 2 x dp 2, ZeRO-1, FSDP2 and DeepSpeed ZeRO-2 at tp 1 x dp 4, each
with a checkpoint at step 3; FSDP2's checkpoint resumed under vanilla TP and vanilla's under FSDP2) and one process
(the reference, the FSDP2 and ZeRO-1 checkpoints resumed there, ``boost-hf export`` of three checkpoints). fp32 and
AdamW's ``eps`` 1e-3 as ``test_fully_shard_training.py``: losses within 1e-5 relative, every weight of ``final/``
within 1e-5 (relative L2 norm), the logits of each folder loaded without boost-hf within 1e-5 of the trained model's
(their scale, :func:`~tests.tolerances.scaled_error`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from boost_hf import BoostLlamaConfig
from boost_hf.training import BoostTrainingArguments
from boost_hf.training.preflight import check_model_and_data

from ..tolerances import scaled_error
from .final_logits import LOGITS_FILE, load_without_boost_hf
from .launcher import DEMO_RECIPE, TINY, accelerate_command, python_command, run_command
from .run_outputs import losses, weights_rel

TOL = 1e-5
FOUR = ["ddp", "vanilla", "zero1", "fsdp2", "zero2", "vanilla-from-fsdp2", "fsdp2-from-vanilla"]
ONE = ["single", "one-from-fsdp2", "one-from-zero1"]
RESUMED = {"vanilla-from-fsdp2": "fsdp2", "fsdp2-from-vanilla": "vanilla", "one-from-fsdp2": "fsdp2", "one-from-zero1": "zero1"}
EXPORTED = ["single", "fsdp2", "zero2"]


@pytest.fixture(scope="module")
def runs(training_env, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tied")
    common = [DEMO_RECIPE, *TINY, "--dataset", training_env["CORPUS"], "--adam_epsilon", "1e-3"]
    cases = "tests/training/tied_cases.py"
    run_command(accelerate_command("cpu-4proc.yaml", cases, "four", out, *common), training_env, timeout=1500)
    run_command(python_command(cases, "one", out, *common), training_env, timeout=900)
    return out


def test_every_run_trained_six_steps_and_published_its_final_model(runs):
    for run in [*FOUR, *ONE]:
        assert sorted(losses(runs / run)) == [1, 2, 3, 4, 5, 6], run
        assert (runs / run / "final" / "model.safetensors").is_file(), run
    assert not list((runs / "ddp").glob("checkpoint-*"))  # --save_strategy no: the trained model is in final/ alone


@pytest.mark.parametrize("run", ["ddp", "vanilla", "zero1", "fsdp2", "zero2"])
def test_a_tied_model_trains_one_process_run_in_every_layout_that_holds_it(runs, run):
    single, ours = losses(runs / "single"), losses(runs / run)
    assert max(abs(ours[s] - single[s]) / single[s] for s in single) < TOL
    worst = weights_rel(runs / run / "final", runs / "single" / "final")
    assert max(worst.values()) < TOL, max(worst.items(), key=lambda kv: kv[1])


@pytest.mark.parametrize("run", ["single", "ddp", "vanilla", "zero1", "fsdp2", "zero2", *(f"export-{s}" for s in EXPORTED)])
def test_every_saved_folder_holds_the_tied_matrix_once(runs, run):
    """As ``save_pretrained`` writes a tied model: ``model.embed_tokens.weight``, no ``lm_head.weight``, the config tied."""
    folder = runs / run if run.startswith("export-") else runs / run / "final"
    names = set(load_file(folder / "model.safetensors"))
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert json.loads((folder / "config.json").read_text())["tie_word_embeddings"] is True


@pytest.mark.parametrize("run, source", sorted(RESUMED.items()))
def test_a_tied_checkpoint_resumes_at_another_layout(runs, run, source):
    resumed, uninterrupted = losses(runs / run), losses(runs / source)
    assert max(abs(resumed[s] - uninterrupted[s]) / uninterrupted[s] for s in (4, 5, 6)) < TOL
    worst = weights_rel(runs / run / "final", runs / source / "final")
    assert max(worst.values()) < TOL, max(worst.items(), key=lambda kv: kv[1])


def test_the_export_of_a_tied_checkpoint_is_its_weights(runs):
    """``boost-hf export`` of checkpoint-3 of the FSDP2 and the DeepSpeed run: the one-process run's checkpoint-3."""
    for source in ("fsdp2", "zero2"):
        worst = weights_rel(runs / f"export-{source}", runs / "export-single")
        assert max(worst.values()) < TOL, (source, max(worst.items(), key=lambda kv: kv[1]))


def test_tied_folders_load_without_boost_hf_to_the_trained_logits(runs, tmp_path):
    """Every ``final/`` and export, loaded with plain transformers (remote code) where boost-hf cannot be imported:
    the LM head is the embedding, and the logits are the trained model's (recorded by the run after its final save;
    an export: the one-process checkpoint's export)."""
    finals = {run: runs / run / "final" for run in ("single", "ddp", "vanilla", "zero1", "fsdp2", "zero2")}
    exports = {f"export-{source}": runs / f"export-{source}" for source in EXPORTED}
    report, logits = load_without_boost_hf(tmp_path, {**finals, **exports})
    assert report.pop("boost_hf_importable") is False
    assert all(entry["head_is_embedding"] and entry["architectures"] == ["BoostLlamaForCausalLM"] for entry in report.values()), report
    for run in finals:
        assert scaled_error(logits[run], torch.load(runs / run / LOGITS_FILE)) < TOL, run
    for name in exports:
        assert scaled_error(logits[name], logits["export-single"]) < TOL, name


@pytest.mark.parametrize("layout, message", [
    ({"tp_size": 2, "tp_style": "btp"}, r"tie_word_embeddings=True cannot be combined with tp_style='btp' at tp_size > 1 .* "
                                        r"set tie_word_embeddings=False, or tp_style='vanilla'"),
    ({"pp_size": 2}, r"tie_word_embeddings=True cannot run under pipeline parallelism .* set tie_word_embeddings=False"),
])
def test_tied_embeddings_split_apart_are_refused_by_the_checks_before_any_collective(layout, message):
    """Where the layout would put the embedding and the LM head apart, the run's checks before any collective
    (:func:`~boost_hf.training.preflight.check_model_and_data`, which ``boost-hf train`` runs on every rank before it
    builds the data or the model) refuse it with the fix; the same model at tp 1 passes them."""
    config = BoostLlamaConfig.from_preset("cola-60m", vocab_size=512, tie_word_embeddings=True)
    tokenizer = type("Tokenizer", (), {"__len__": lambda self: 512})()
    parallel = BoostTrainingArguments(output_dir="unused", sample_max_new_tokens=0, **layout).to_parallel_config(config)
    with pytest.raises(ValueError, match=message):
        check_model_and_data(config, tokenizer, 64, parallel)
    check_model_and_data(config, tokenizer, 64, BoostTrainingArguments(output_dir="unused", tp_size=1).to_parallel_config(config))


def test_the_export_plan_of_a_tied_checkpoint_writes_the_matrix_once():
    """A checkpoint of a tied model holds ``model.embed_tokens.weight`` and no ``lm_head.weight`` (one parameter): the
    export's plan (:func:`~boost_hf.checkpoint.export.weight_files_plan`) is ``save_pretrained``'s, the matrix once
    (before the fix: ``missing ['lm_head.weight']``, the error that ended every tied run at ``final/``)."""
    from boost_hf.checkpoint.export import single_device_skeleton_of, weight_files_plan

    config = BoostLlamaConfig.from_preset("cola-60m", vocab_size=512, tie_word_embeddings=True, num_hidden_layers=1)
    saved = {name: (tuple(t.shape), t.dtype) for name, t in single_device_skeleton_of(config).state_dict().items()
             if name != "lm_head.weight"}
    planned = {name for names in weight_files_plan(config, saved, "5GB").filename_to_tensors.values() for name in names}
    assert "model.embed_tokens.weight" in planned and "lm_head.weight" not in planned
    assert planned == set(saved)

"""``recipes/demo.yaml`` (shrunk, see ``launcher.TINY``, with 4 layers) trained through pipeline stages under
``accelerate launch`` on 4 CPU processes computes what one process computes with the same global batch:
pp 2 x tp 2 (1F1B, checkpoint saved at step 3 and resumed at the same layout) and pp 2 x dp 2 with the
interleaved 1F1B schedule (2 stages per rank); the validation loss through the pipeline is the single
process's; ``final/`` loads in plain ``transformers``.

Four launches (about 4 minutes on 2 cores).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from .launcher import DEMO_RECIPE, TINY, accelerate_command, python_command, run_command

RELATIVE_TOLERANCE = 1e-4
FOUR_LAYERS = ["--num_hidden_layers", "4", "--eval_strategy", "steps", "--eval_steps", "3"]


@pytest.fixture(scope="module")
def runs(training_env, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pipeline_runs")
    common = [DEMO_RECIPE, *TINY, *FOUR_LAYERS, "--dataset", training_env["CORPUS"]]
    run_command(python_command("recipes/pretrain.py", *common, "--tp_size", "1", "--per_device_train_batch_size", "8",
                               "--output_dir", out / "single"), training_env, timeout=300)
    pp_tp = [*common, "--pp_size", "2", "--tp_size", "2", "--pp_microbatches", "2", "--per_device_train_batch_size", "8"]
    run_command(accelerate_command("cpu-4proc.yaml", "recipes/pretrain.py", *pp_tp, "--output_dir", out / "pp2-tp2",
                                   "--save_strategy", "steps", "--save_steps", "3"), training_env, timeout=600)
    run_command(accelerate_command("cpu-4proc.yaml", "recipes/pretrain.py", *pp_tp, "--output_dir", out / "pp2-tp2-resumed",
                                   "--resume_from_checkpoint", out / "pp2-tp2" / "checkpoint-3"), training_env, timeout=600)
    pp_dp = [*common, "--pp_size", "2", "--tp_size", "1", "--pp_schedule", "interleaved-1f1b", "--pp_microbatches", "4",
             "--per_device_train_batch_size", "4"]  # global batch 4 x dp 2 = 8
    run_command(accelerate_command("cpu-4proc.yaml", "recipes/pretrain.py", *pp_dp, "--output_dir", out / "pp2-dp2-interleaved"),
                training_env, timeout=600)
    return out


def log_history(run: Path) -> list[dict]:
    return json.loads((run / "trainer_state.json").read_text())["log_history"]


def losses(run: Path) -> dict[int, float]:
    return {entry["step"]: entry["loss"] for entry in log_history(run) if "loss" in entry}


def eval_losses(run: Path) -> dict[int, float]:
    return {entry["step"]: entry["eval_loss"] for entry in log_history(run) if "eval_loss" in entry}


def assert_close(actual: dict, expected: dict) -> None:
    assert sorted(actual) == sorted(expected)
    for step, value in expected.items():
        assert abs(actual[step] - value) <= RELATIVE_TOLERANCE * abs(value), (step, actual[step], value)


@pytest.mark.parametrize("run", ["pp2-tp2", "pp2-dp2-interleaved"])
def test_pipeline_losses_match_one_process(runs, run):
    assert len(losses(runs / "single")) == 6
    assert_close(losses(runs / run), losses(runs / "single"))
    assert_close(eval_losses(runs / run), eval_losses(runs / "single"))


def test_resumed_pipeline_run_continues_the_same_run(runs):
    """The resumed run's log holds the checkpoint's steps 1-3 and its own steps 4-6: all the single process's."""
    assert_close(losses(runs / "pp2-tp2-resumed"), losses(runs / "single"))
    assert_close(eval_losses(runs / "pp2-tp2-resumed"), eval_losses(runs / "single"))


def test_final_model_is_canonical_and_loads_in_plain_transformers(runs):
    from transformers import AutoModelForCausalLM

    single = AutoModelForCausalLM.from_pretrained(runs / "single" / "final", trust_remote_code=True)
    piped = AutoModelForCausalLM.from_pretrained(runs / "pp2-tp2" / "final", trust_remote_code=True)
    reference = dict(single.named_parameters())
    assert sorted(reference) == sorted(n for n, _ in piped.named_parameters())
    for name, param in piped.named_parameters():
        rel = (param - reference[name]).norm() / reference[name].norm()
        assert rel <= RELATIVE_TOLERANCE, (name, float(rel))
    layout = json.loads((runs / "pp2-tp2" / "checkpoint-3" / "training_layout.json").read_text())
    assert layout["pp_size"] == 2 and layout["tp_size"] == 2
    assert all((runs / "pp2-tp2" / "checkpoint-3" / f"optimizer_pp{p:02d}_tp{t:02d}.pt").is_file() for p in (0, 1) for t in (0, 1))
    assert torch.isfinite(torch.tensor(list(losses(runs / "pp2-tp2").values()))).all()


@pytest.mark.parametrize("fields, words", [
    ({"deepspeed": {"zero_optimization": {"stage": 2}}}, "DeepSpeed cannot run with pp_size=2"),
    ({"deepspeed": {"zero_optimization": {"stage": 3}}}, "Drop --deepspeed"),
    ({"gradient_accumulation_steps": 2}, "raise per_device_train_batch_size"),
])
def test_pipeline_refuses_deepspeed_and_gradient_accumulation(tmp_path, fields, words):
    from boost_hf.training import BoostTrainingArguments

    with pytest.raises(ValueError, match=words):
        BoostTrainingArguments(output_dir=str(tmp_path), pp_size=2, report_to="none", **fields)

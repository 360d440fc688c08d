"""``--init_from CHECKPOINT`` starts from the checkpoint's weights at any TP size: the validation loss logged at
step 0 is the one the checkpoint's own run measured on the same blocks at its end. Three launches (about a
minute on 2 cores): a short run, then ``--init_from <run>/final`` (the Hugging Face folder) at tp 1 (one process) and
``--init_from <run>/checkpoint-6`` (the training checkpoint: its DCP shards, resharded) at tp 2 (``torchrun``), these
two at the same time (the one-process run alone would leave a core idle)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .launcher import DEMO_RECIPE, TINY, python_command, run_command, run_commands, torchrun_command

RELATIVE_TOLERANCE = 1e-5


def eval_losses(run: Path) -> list[tuple[int, float]]:
    history = json.loads((run / "trainer_state.json").read_text())["log_history"]
    return [(entry["step"], entry["eval_loss"]) for entry in history if "eval_loss" in entry]


@pytest.fixture(scope="module")
def trained(training_env, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("init_from")
    common = [DEMO_RECIPE, *TINY, "--dataset", training_env["CORPUS"], "--per_device_train_batch_size", "8"]
    run_command(python_command("recipes/pretrain.py", *common, "--tp_size", "1", "--output_dir", out / "first",
                               "--save_strategy", "steps", "--save_steps", "6"), training_env, timeout=300)
    init = [*common, "--max_steps", "1", "--seed", "7"]
    run_commands([python_command("recipes/pretrain.py", *init, "--init_from", out / "first" / "final", "--tp_size", "1",
                                 "--output_dir", out / "tp1"),
                  torchrun_command(2, "recipes/pretrain.py", *init, "--init_from", out / "first" / "checkpoint-6", "--tp_size", "2",
                                   "--output_dir", out / "tp2")],
                 training_env, timeout=600)
    return out


@pytest.mark.parametrize("run", ["tp1", "tp2"])
def test_init_from_starts_at_the_checkpoints_validation_loss(trained, run):
    first = eval_losses(trained / "first")
    start_step, start_loss = eval_losses(trained / run)[0]
    assert first[0][1] > first[-1][1] * 1.05, f"the first run did not learn: {first}"  # init and trained differ
    assert start_step == 0
    assert start_loss == pytest.approx(first[-1][1], rel=RELATIVE_TOLERANCE), (run, start_loss, first)

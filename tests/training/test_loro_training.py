"""``recipes/demo.yaml`` (shrunk, ``launcher.TINY``) with ``--bottleneck svd --lowrank_optimizer loro
--loro_exact_every 3``: tp 2 x dp 2 under ``accelerate launch`` computes the single process's losses and weights; the
checkpoint written right after the exact step at step 3 holds balanced factors and reset moments; resuming the
checkpoints of steps 2 and 4 (inside a period: moments set, the next exact step to come) at tp 4 x dp 1 and tp 1 x dp 4
continues the same run (the LORO period and the moments travel with the optimizer state, resharded).

Two launches at the same time (about 2 minutes on 2 cores): the single-process run and one ``accelerate launch`` of
``loro_runs.py``.
"""

from __future__ import annotations

import pytest
import torch

from boost_hf.optim.loro import RESTART_FLOOR

from .checkpoint_files import read_checkpoint, saved_param_groups
from .launcher import DEMO_RECIPE, TINY, accelerate_command, python_command, run_commands
from .test_distributed import assert_same_losses, assert_same_weights, log_history, losses

LORO = ["--bottleneck", "svd", "--lowrank_optimizer", "loro", "--loro_exact_every", "3"]


@pytest.fixture(scope="module")
def runs(training_env, tmp_path_factory):
    out = tmp_path_factory.mktemp("loro_runs")
    common = [DEMO_RECIPE, *TINY, *LORO, "--dataset", training_env["CORPUS"]]
    distributed = [*common, "--tp_size", "2", "--per_device_train_batch_size", "4"]  # global batch 4 x dp 2 = 8
    run_commands([  # independent: at the same time
        python_command("recipes/pretrain.py", *common, "--tp_size", "1", "--per_device_train_batch_size", "8",
                       "--save_strategy", "steps", "--save_steps", "3", "--output_dir", out / "single"),
        accelerate_command("cpu-4proc.yaml", "tests/training/loro_runs.py", out, *distributed),
    ], training_env, timeout=900)
    return out


def test_single_process_loro_learns_and_restarts_its_schedule(runs):
    steps = losses(runs / "single")
    assert len(steps) == 6 and steps[6] < steps[1]
    rates = {entry["step"]: entry["learning_rate"] for entry in log_history(runs / "single") if "loss" in entry}
    assert rates[4] == pytest.approx(RESTART_FLOOR * 1e-2)  # the first step after the exact step of step 3
    assert rates[5] > rates[4] * 100 and rates[3] > rates[4] * 100  # warming up again


def test_tp2_dp2_loro_matches_one_process(runs):
    assert_same_losses(losses(runs / "loro"), losses(runs / "single"))
    assert_same_weights(runs / "loro" / "final", runs / "single" / "final")


def test_checkpoint_after_the_exact_step_holds_balanced_factors_and_reset_moments(runs):
    saved = read_checkpoint(runs / "loro" / "checkpoint-3")
    weights = saved["model"]
    pairs = [name[: -len(".A")] for name in weights if name.endswith(".A")]
    assert len(pairs) == 7 * 2
    for name in pairs:
        B, A = weights[f"{name}.B"].double(), weights[f"{name}.A"].double()
        gram_B, gram_A = B.T @ B, A @ A.T
        scale = gram_B.abs().max()
        assert (gram_B - gram_A).abs().max() / scale < 1e-5, name
        assert (gram_B - torch.diag(torch.diagonal(gram_B))).abs().max() / scale < 1e-5, name
    state = saved["optimizer"]["state"]
    assert len(state) == len(weights)
    assert all(float(v.abs().max()) == 0 for entry in state.values() for v in entry.values())
    assert all(group["loro_step"] == 0 for group in saved_param_groups(saved)["pp0"])


@pytest.mark.parametrize("run", ["loro-tp4-resumed", "loro-dp4-resumed"])
def test_loro_resumed_at_another_tp_dp_continues_the_same_run(runs, run):
    """A resume that lost the moments (Adam's first step has the size of the learning rate on every weight) or the
    place in the period (the exact step at another step) would change the losses by percents."""
    assert_same_losses(losses(runs / run), losses(runs / "loro"))
    assert_same_weights(runs / run / "final", runs / "loro" / "final")


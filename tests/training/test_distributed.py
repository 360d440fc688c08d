"""``recipes/demo.yaml`` (shrunk, see ``launcher.TINY``) at tp 2 x dp 2 under DDP and ZeRO-1/2/3 computes
what one process computes with the same global batch; resuming continues the same run; the data is sharded
by data-parallel rank.

Five launches (about 2.5 minutes on 2 cores): the single-process reference, one ``accelerate launch`` of
``distributed_cases.py`` (DDP, ZeRO-1, ZeRO-2, resumes at the same and at other TP x DP sizes, resumes that must
fail, tp 4, low-rank checkpointing, gradient accumulation, sequence parallelism, streaming, data), a one-process resume at tp 1, one
launch with the ZeRO-3 accelerate config (train, resume) and two ``torchrun`` "nodes" of 2 processes each.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from .checkpoint_files import read_checkpoint
from .launcher import DEMO_RECIPE, TINY, accelerate_command, python_command, run_command, run_commands, torchrun_node_commands
from .run_outputs import log_history, losses

RELATIVE_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def runs(training_env, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("runs")
    common = [DEMO_RECIPE, *TINY, "--dataset", training_env["CORPUS"]]
    distributed = [*common, "--tp_size", "2", "--per_device_train_batch_size", "4"]  # global batch 4 x dp 2 = 8
    run_command(
        python_command("recipes/pretrain.py", *common, "--tp_size", "1", "--per_device_train_batch_size", "8",
                       "--output_dir", out / "single"),
        training_env, timeout=300,
    )
    run_command(accelerate_command("cpu-4proc.yaml", "tests/training/distributed_cases.py", "all", out, *distributed), training_env, timeout=900)
    run_command(python_command("tests/training/distributed_cases.py", "tp1-resume", out, *distributed), training_env, timeout=300)
    run_command(accelerate_command("cpu-4proc-zero3.yaml", "tests/training/distributed_cases.py", "zero3", out, *distributed), training_env, timeout=300)
    run_commands(torchrun_node_commands(2, 2, "recipes/pretrain.py", *distributed, "--output_dir", out / "multinode",
                                        "--hang_timeout_s", "10"), training_env, timeout=300)
    return out


def eval_losses(run: Path) -> list[float]:
    return [entry["eval_loss"] for entry in log_history(run) if "eval_loss" in entry]


def assert_same_weights(actual: Path, expected: Path, tolerance: float = RELATIVE_TOLERANCE) -> None:
    """Every tensor within ``tolerance`` in relative L2 norm. (Elementwise comparison is ill-conditioned under
    Adam: the few elements whose gradient is near ``adam_epsilon`` turn rounding differences of a different
    summation order into visible update differences; the loss and the tensors as a whole are unaffected.)"""
    a, b = load_file(actual / "model.safetensors"), load_file(expected / "model.safetensors")
    assert a.keys() == b.keys()
    for name in b:
        error = (a[name] - b[name]).norm() / b[name].norm().clamp(min=1e-12)
        assert error <= tolerance, f"{name}: relative difference {error:.2e} between {actual} and {expected}"


def assert_same_losses(actual: dict[int, float], expected: dict[int, float], tolerance: float = RELATIVE_TOLERANCE) -> None:
    assert actual.keys() == expected.keys()
    for step in expected:
        assert actual[step] == pytest.approx(expected[step], rel=tolerance), f"step {step}: {actual[step]} vs {expected[step]}"


def test_single_process_recipe_learns(runs):
    single = runs / "single"
    steps = losses(single)
    assert len(steps) == 6 and steps[6] < steps[1]
    before, after = eval_losses(single)[0], eval_losses(single)[-1]
    assert after < before - 0.3
    for key in ("tokens_per_second", "tokens_per_second_per_device", "mfu", "grad_norm", "learning_rate"):
        assert all(key in entry for entry in log_history(single) if "loss" in entry), key


@pytest.mark.parametrize("run", ["ddp", "zero1", "zero2", "zero3", "ddp-lowrank", "ddp-accumulation", "zero2-accumulation", "ddp-sp"])
def test_tp2_dp2_matches_one_process(runs, run):
    assert_same_losses(losses(runs / run), losses(runs / "single"))
    assert_same_weights(runs / run / "final", runs / "single" / "final")
    assert eval_losses(runs / run)[-1] == pytest.approx(eval_losses(runs / "single")[-1], rel=RELATIVE_TOLERANCE)
    logged = [entry for entry in log_history(runs / run) if "loss" in entry]
    assert all(entry["comm_tp_bytes_per_step"] > 0 and entry["comm_dp_grad_bytes_per_step"] > 0 for entry in logged)


@pytest.mark.parametrize("run", ["dp4-ckpt-full", "dp4-ckpt-lowrank"])
def test_dp4_with_activation_checkpointing_matches_one_process(runs, run):
    """tp 1 x dp 4 in fp32 is accelerate's DDP, under boost-hf's re-entrant activation checkpointing: transformers asked
    DDP to find unused parameters (its own checkpointing off), and the first backward failed ("marked ready twice")."""
    assert_same_losses(losses(runs / run), losses(runs / "single"))
    assert_same_weights(runs / run / "final", runs / "single" / "final")


@pytest.mark.parametrize("run", ["ddp", "zero2", "zero3"])
def test_resume_continues_the_same_run(runs, run):
    resumed, original = losses(runs / f"{run}-resumed"), losses(runs / run)
    assert_same_losses(resumed, original, tolerance=1e-6)  # steps 1-3 restored from the checkpoint, 4-6 retrained
    assert_same_weights(runs / f"{run}-resumed" / "final", runs / run / "final", tolerance=1e-6)


@pytest.mark.parametrize("run", ["tp4-resumed", "dp4-resumed", "tp1-resumed"])
def test_resume_at_another_tp_dp_continues_the_same_run(runs, run):
    """``ddp/checkpoint-3`` (tp 2 x dp 2) resumed at tp 4 x dp 1, tp 1 x dp 4 and tp 1 in one process: the optimizer
    moments are resharded, so steps 4-6 are those of the uninterrupted run (a fresh AdamW would change them by
    percents, not 1e-4: its first update has the size of the learning rate on every weight)."""
    assert_same_losses(losses(runs / run), losses(runs / "ddp"))
    assert_same_weights(runs / run / "final", runs / "ddp" / "final")


def trained_rows(run: Path) -> dict[int, Counter]:
    """The rows of input_ids a run trained, by step (counted once per TP group: TP rank 0 of each DP rank)."""
    by_step: dict[int, Counter] = {}
    for entry in json.loads((run / "trained_samples.json").read_text()):
        if entry["tp_rank"] == 0:
            by_step.setdefault(entry["step"], Counter()).update(tuple(row) for row in entry["rows"])
    return by_step


@pytest.mark.parametrize("run", ["ddp-resumed", "tp4-resumed", "dp4-resumed", "tp1-resumed"])
def test_resume_at_another_dp_size_trains_every_sample_once(runs, run):
    """Steps 1-3 of the tp 2 x dp 2 run, then steps 4-6 of the run resumed at another DP size (same global batch of 8):
    48 samples, each of them once, and exactly those that the uninterrupted run trained at each step."""
    before, after, uninterrupted = trained_rows(runs / "ddp"), trained_rows(runs / run), trained_rows(runs / "ddp")
    assert sorted(after) == [4, 5, 6], "the resumed run retrained or skipped steps"
    assert all(sum(after[step].values()) == 8 for step in after)
    union = sum((before[step] for step in (1, 2, 3)), Counter()) + sum(after.values(), Counter())
    assert sum(union.values()) == 48 and max(union.values()) == 1, "a sample was trained twice"
    assert all(after[step] == uninterrupted[step] for step in after), "the resumed run trained other samples"


def test_deepspeed_resume_at_another_tp_dp_continues_the_same_run(runs):
    """``zero2/checkpoint-3`` (tp 2 x dp 2, ZeRO-2) resumed at tp 1 x dp 4 with ZeRO-2, converted to DeepSpeed's
    universal checkpoint on the way: steps 4-6 are those of the uninterrupted run (~1e-7 relative here: another TP
    size sums in another order), each sample of steps 1-6 trained once; the converted folder is gone."""
    resumed, original = losses(runs / "zero2-tp1-resumed"), losses(runs / "zero2")
    assert_same_losses(resumed, original, tolerance=1e-6)
    assert_same_weights(runs / "zero2-tp1-resumed" / "final", runs / "zero2" / "final", tolerance=1e-6)
    before, after = trained_rows(runs / "zero2"), trained_rows(runs / "zero2-tp1-resumed")
    assert sorted(after) == [4, 5, 6] and all(after[step] == before[step] for step in after)
    assert not list((runs / "zero2-tp1-resumed").glob(".universal-*"))


def test_deepspeed_resume_without_deepspeed_fails_clearly(runs):
    errors = json.loads((runs / "errors.json").read_text())
    ddp = errors["ddp-under-zero2"]
    assert ddp["type"] == "ResumeLayoutError" and "was saved without DeepSpeed" in ddp["message"]


def test_deepspeed_resume_verifies_the_manifest(runs):
    damaged = json.loads((runs / "errors.json").read_text())["zero2-damaged"]
    assert damaged["type"] == "CheckpointIntegrityError"
    assert "mp_rank_00_model_states.pt' is corrupted (SHA-256 differs from the manifest)" in damaged["message"]


def test_two_torchrun_nodes_match_one_process(runs):
    """Two ``torchrun`` "nodes" of 2 processes on 127.0.0.1 (static rendezvous), tp 2 x dp 2 across them."""
    assert_same_losses(losses(runs / "multinode"), losses(runs / "single"))
    assert_same_weights(runs / "multinode" / "final", runs / "single" / "final")


def test_streaming_training_set_under_tp(runs):
    """An iterable training set is split by DP rank (another sample order than the map-style runs)."""
    steps = losses(runs / "streaming")
    assert len(steps) == 6 and steps[6] < steps[1]


def test_checkpoints_are_complete_and_atomic(runs):
    ddp = runs / "ddp"
    assert sorted(p.name for p in ddp.iterdir() if p.name.startswith("checkpoint")) == ["checkpoint-3", "checkpoint-6"]
    assert not [p for p in runs.rglob(".*.tmp-*")], "a staging folder was left behind"
    checkpoint = ddp / "checkpoint-3"
    for name in ("dcp/.metadata", "config.json", "modeling_boost_llama.py", "tokenizer.json", "trainer_state.json",
                 "scheduler.pt", "rng_state_0.pth", "rng_state_3.pth", "training_layout.json", "manifest.json"):
        assert (checkpoint / name).is_file(), name
    assert not list(checkpoint.glob("*.safetensors")) and not list(checkpoint.glob("optimizer*.pt"))
    assert (runs / "zero2" / "checkpoint-3" / "global_step3").is_dir()


def test_every_rank_writes_its_share_once(runs):
    """tp 2 x dp 2: each of the 4 ranks wrote its own DCP file, together the model and AdamW state once (the DP
    replicas and the TP copies of replicated tensors deduplicated; twice the bytes without), balanced over the ranks."""
    from torch.distributed.checkpoint import FileSystemReader

    folder = runs / "ddp" / "checkpoint-3" / "dcp"
    files = {p.name: p.stat().st_size for p in folder.glob("__*_0.distcp")}
    assert sorted(files) == [f"__{rank}_0.distcp" for rank in range(4)]
    saved = read_checkpoint(runs / "ddp" / "checkpoint-3")
    tensors = [*saved["model"].values(), *(v for entry in saved["optimizer"]["state"].values() for v in entry.values())]
    payload = sum(t.numel() * t.element_size() for t in tensors)
    assert sum(files.values()) < 1.5 * payload, (files, payload)
    per_file = Counter()
    for entry in FileSystemReader(str(folder)).read_metadata().storage_data.values():
        per_file[entry.relative_path] += entry.length
    assert all(0.1 * payload < per_file[name] for name in files), (per_file, payload)


def test_canonical_checkpoint_loads_at_another_tp_size(runs):
    """The tp 2 run's final model, loaded at tp 4, evaluates to the same validation loss."""
    assert eval_losses(runs / "tp4-from-ddp")[0] == pytest.approx(eval_losses(runs / "ddp")[-1], rel=1e-5)


def test_final_model_loads_with_from_pretrained(runs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import boost_hf  # noqa: F401  (registers the Auto classes)

    final = runs / "ddp" / "final"
    model, tokenizer = AutoModelForCausalLM.from_pretrained(final), AutoTokenizer.from_pretrained(final)
    ids = tokenizer("The history of", return_tensors="pt").input_ids
    with torch.no_grad():
        assert model(ids).logits.shape[-1] == model.config.vocab_size


def test_epoch_is_sharded_by_data_parallel_rank(runs):
    data = json.loads((runs / "data.json").read_text())
    by_rank = {(r["dp_rank"], r["tp_rank"]): [tuple(row) for row in r["rows"]] for r in data["ranks"]}
    assert len(by_rank) == 4
    for dp in (0, 1):
        assert by_rank[(dp, 0)] == by_rank[(dp, 1)], "tensor-parallel peers saw different batches"
    seen = Counter(by_rank[(0, 0)] + by_rank[(1, 0)])
    available = Counter(tuple(row) for row in data["dataset"])
    assert all(seen[row] <= available[row] for row in seen), "a sample was seen twice within the epoch"
    assert sum(available.values()) - sum(seen.values()) < 2 * 4  # only the last incomplete global batch is dropped


def test_compute_metrics_sees_every_validation_block_once(runs):
    """tp 2 x dp 2: full-vocabulary logits (gathered over TP), predictions of both DP ranks, on every rank."""
    data = json.loads((runs / "compute_metrics.json").read_text())
    for seen in data["ranks"]:
        assert Counter(map(tuple, seen["label_rows"])) == Counter(map(tuple, data["validation"]))
        assert seen["prediction_shape"] == [len(data["validation"]), len(data["validation"][0])]
        assert 0 <= seen["max_prediction"] < data["vocab_size"]

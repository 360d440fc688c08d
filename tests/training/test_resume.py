"""Resume never silently drops state, in one process: the optimizer state resharded to another TP size is exactly
the saved one, missing optimizer or scheduler files and another global batch are errors, DeepSpeed layouts are
checked. (The same, end to end at tp 2 x dp 2 -> tp 4 / dp 4 / tp 1, with the samples each rank trained, is in
``test_distributed.py``.)"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from boost_hf.checkpoint_integrity import CheckpointIntegrityError, write_manifest
from boost_hf.parallel.sharding import ShardSpec
from boost_hf.training.deepspeed import DEEPSPEED_PARAMETER_ORDER
from boost_hf.training.resume import (
    LAYOUT_NAME,
    ResumeLayoutError,
    check_resume_layout,
    parameter_names,
    reshard_optimizer_state,
    write_training_layout,
)

from .test_reliability import trainer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A finished single-process run (steps 1-4, checkpoints at 2 and 4) and its trainer."""
    run = tmp_path_factory.mktemp("resume") / "run"
    t = trainer(run)
    t.train()
    t._output_dir_lock.release()
    return t, run / "checkpoint-2"


def split(state: dict, names: list[str], dims: dict[str, int | None], tp_size: int) -> list[dict]:
    """``state`` (an optimizer state dict at tp 1) as the files of ``tp_size`` TP ranks sharding along ``dims``."""
    files = []
    for rank in range(tp_size):
        entries = {}
        for i, entry in state["state"].items():
            dim = dims[names[i]]
            entries[i] = {k: v.chunk(tp_size, dim)[rank].clone() if v.dim() > 0 and dim is not None else v for k, v in entry.items()}
        files.append({"state": entries, "param_groups": state["param_groups"]})
    return files


def test_optimizer_state_reshards_exactly(checkpoint):
    """AdamW state of a real run, split as tp 2 would save it, resharded to tp 1 and to each rank of tp 4: every
    moment is bit-identical to the matching slice of the original, step counts and hyper-parameters kept."""
    t, _ = checkpoint
    optimizer, model = t.optimizer, t.model
    names = parameter_names(model, optimizer)
    params = dict(model.named_parameters())
    original = optimizer.state_dict()
    dims = {n: (0 if params[n].shape[0] % 4 == 0 else None) if params[n].dim() == 1 else 1 for n in names}
    saved = split(original, names, dims, 2)
    record = [{"files": [], "groups": [len(g["params"]) for g in optimizer.param_groups],
               "parameters": [{"name": n, "partition_dim": dims[n]} for n in names]}]
    full_specs = [ShardSpec(tuple(params[n].shape)) for n in names]
    at_tp1 = reshard_optimizer_state(lambda q: saved, record, names, full_specs, optimizer.param_groups)
    for i, entry in original["state"].items():
        for key, value in entry.items():
            assert torch.equal(at_tp1["state"][i][key], value), (names[i], key)
    assert at_tp1["param_groups"] == original["param_groups"]
    for rank in range(4):
        specs = [ShardSpec(tuple(params[n].shape), dims[n], rank, 4) for n in names]
        at_tp4 = reshard_optimizer_state(lambda q: saved, record, names, specs, optimizer.param_groups)
        for i, entry in original["state"].items():
            expected = entry["exp_avg_sq"].chunk(4, dims[names[i]])[rank] if dims[names[i]] is not None else entry["exp_avg_sq"]
            assert torch.equal(at_tp4["state"][i]["exp_avg_sq"], expected), names[i]
            assert torch.equal(at_tp4["state"][i]["step"], entry["step"])
    with pytest.raises(ResumeLayoutError, match=r"optimizer state is over other parameters: missing \['lm_head.extra'\]"):
        reshard_optimizer_state(lambda q: saved, record, names[:-1] + ["lm_head.extra"], full_specs, optimizer.param_groups)


def test_missing_optimizer_or_scheduler_file_is_an_error(checkpoint, tmp_path):
    """A checkpoint without optimizer state (``--save_only_model``) or without ``scheduler.pt`` (its manifest
    agreeing) is an error naming the file and ``--init_from``; a file deleted after the save fails the manifest."""
    weights_only = trainer(tmp_path / "weights-only", save_only_model=True, max_steps=2)
    weights_only.train()
    weights_only._output_dir_lock.release()
    with pytest.raises(FileNotFoundError, match=r"checkpoint-2/optimizer.pt is missing: resuming needs the optimizer state .*--init_from .*checkpoint-2"):
        trainer(tmp_path / "a").train(resume_from_checkpoint=str(tmp_path / "weights-only" / "checkpoint-2"))
    t, folder = checkpoint
    copy = tmp_path / "copy" / "checkpoint-2"
    shutil.copytree(folder, copy)
    (copy / "scheduler.pt").unlink()
    with pytest.raises(CheckpointIntegrityError, match="is incomplete: scheduler.pt is missing"):
        trainer(tmp_path / "b").train(resume_from_checkpoint=str(copy))
    write_manifest(str(copy), t.model.config)  # as if saved without it
    with pytest.raises(FileNotFoundError, match=r"checkpoint-2/scheduler.pt is missing: resuming needs the learning-rate scheduler state"):
        trainer(tmp_path / "c").train(resume_from_checkpoint=str(copy))
    (copy / "optimizer.pt").rename(copy / "optimizer_tp01.pt")  # a tp 2 checkpoint of a version without a layout file
    (copy / "training_layout.json").unlink()
    write_manifest(str(copy), t.model.config)
    with pytest.raises(ResumeLayoutError, match=r"has no optimizer.pt but optimizer_tp01.pt: it was saved at another TP size"):
        trainer(tmp_path / "d").train(resume_from_checkpoint=str(copy))


def test_resume_with_another_global_batch_is_refused(checkpoint, tmp_path):
    _, folder = checkpoint
    with pytest.raises(ResumeLayoutError, match=r"saved with a global batch of 4 samples per step .* this run has 2 .* = 4"):
        trainer(tmp_path, per_device_train_batch_size=2).train(resume_from_checkpoint=str(folder))
    resumed = trainer(tmp_path / "same", per_device_train_batch_size=2, gradient_accumulation_steps=2)
    resumed.train(resume_from_checkpoint=str(folder))  # 2 x 2 micro-batches: the same global batch resumes
    assert [log["step"] for log in resumed.state.log_history if "loss" in log] == [1, 2, 3, 4]


def test_resume_restores_the_optimizer_exactly(checkpoint, tmp_path):
    """Resuming checkpoint-2 and training to step 4 ends with the uninterrupted run's weights, bit for bit."""
    t, folder = checkpoint
    resumed = trainer(tmp_path)
    resumed.train(resume_from_checkpoint=str(folder))
    assert all(torch.equal(a, b) for a, b in zip(resumed.model.parameters(), t.model.parameters()))


def layout(tp: int, dp: int, zero: int | None, batch: int = 8) -> dict:
    order = {"deepspeed_parameter_order": DEEPSPEED_PARAMETER_ORDER} if zero is not None else {}
    return {"tp_size": tp, "dp_size": dp, "zero_stage": zero, "global_batch_size": batch, **order}


def test_deepspeed_layouts(tmp_path):
    write_training_layout(str(tmp_path), layout(2, 2, 3))
    check_resume_layout(str(tmp_path), layout(2, 2, 3))
    with pytest.raises(ResumeLayoutError, match="DeepSpeed checkpoint of tp_size=2 x dp=2, ZeRO-3, .* this run is tp_size=4 x dp=1, ZeRO-3"):
        check_resume_layout(str(tmp_path), layout(4, 1, 3))
    with pytest.raises(ResumeLayoutError, match="Resume at tp_size=2 on 4 processes with ZeRO-3"):
        check_resume_layout(str(tmp_path), layout(2, 2, 2))
    with pytest.raises(ResumeLayoutError, match="was saved with DeepSpeed .* Resume with DeepSpeed, or start from its weights only"):
        check_resume_layout(str(tmp_path), layout(2, 2, None))
    earlier = {k: v for k, v in layout(2, 2, 3).items() if k != "deepspeed_parameter_order"}  # before grouped storage
    write_training_layout(str(tmp_path), earlier)
    with pytest.raises(ResumeLayoutError, match="written by an earlier boost-hf version.* would load into the wrong parameters"):
        check_resume_layout(str(tmp_path), layout(2, 2, 3))
    write_training_layout(str(tmp_path), layout(2, 2, None))
    check_resume_layout(str(tmp_path), layout(1, 4, None))  # without DeepSpeed any TP x DP resumes
    assert json.loads((tmp_path / LAYOUT_NAME).read_text())["tp_size"] == 2

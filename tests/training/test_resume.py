"""Resume never silently drops state, in one process: the optimizer state resharded to another TP size is exactly
the saved one, missing optimizer or scheduler files and another global batch are errors, DeepSpeed layouts are
checked. (The same, end to end at tp 2 x dp 2 -> tp 4 / dp 4 / tp 1, with the samples each rank trained, is in
``test_distributed.py``.)"""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch

from boost_hf.checkpoint.integrity import CheckpointIntegrityError, write_manifest
from boost_hf.parallel.sharding import ShardSpec
from boost_hf.training.deepspeed import DEEPSPEED_PARAMETER_ORDER
from boost_hf.checkpoint.resume import (
    LAYOUT_NAME,
    ResumeLayoutError,
    check_resume_layout,
    parameter_names,
    reshard_optimizer_state,
    write_training_layout,
)

from boost_hf.training import BoostTrainer, BoostTrainingArguments

from .checkpoint_files import write_legacy_checkpoint
from .test_reliability import trainer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A finished single-process run (steps 1-4, checkpoints at 2 and 4) and its trainer."""
    run = tmp_path_factory.mktemp("resume") / "run"
    t = trainer(run)
    t.train()
    t.run.release()
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
    agreeing) is an error naming what is missing and ``--init_from``; a file deleted after the save fails the manifest."""
    weights_only = trainer(tmp_path / "weights-only", save_only_model=True, max_steps=2)
    weights_only.train()
    weights_only.run.release()
    with pytest.raises(FileNotFoundError, match=r"checkpoint-2 holds no optimizer state \(it was saved with --save_only_model.*--init_from .*checkpoint-2"):
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


def test_a_checkpoint_of_the_earlier_format_resumes_exactly(checkpoint, tmp_path):
    """A checkpoint as boost-hf 0.x wrote it (``model.safetensors``, ``optimizer.pt``) resumes to the uninterrupted
    run's weights, bit for bit; one of another TP size without its layout file is refused, naming why."""
    t, folder = checkpoint
    legacy = write_legacy_checkpoint(folder, tmp_path / "legacy" / "checkpoint-2")
    assert not (legacy / "dcp").exists() and (legacy / "model.safetensors").is_file()
    resumed = trainer(tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(legacy))
    assert all(torch.equal(a, b) for a, b in zip(resumed.model.parameters(), t.model.parameters()))
    (legacy / "optimizer.pt").rename(legacy / "optimizer_tp01.pt")  # a tp 2 checkpoint of a version without a layout file
    (legacy / "training_layout.json").unlink()
    write_manifest(str(legacy), t.model.config)
    with pytest.raises(ResumeLayoutError, match=r"has no optimizer.pt but optimizer_tp01.pt: it was saved at another TP size"):
        trainer(tmp_path / "d").train(resume_from_checkpoint=str(legacy))


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


def test_a_resume_under_another_precision_policy_says_what_changes(tmp_path, caplog):
    """The checkpoint's precision record against this run's: the same says nothing; another policy (or another
    gradient reduction dtype) is a warning naming both and each difference, and the resume goes on."""
    from boost_hf.training.precision import FP32, resolve_precision

    bf16 = resolve_precision(BoostTrainingArguments(output_dir=str(tmp_path), bf16=True, precision_policy="bf16_params")).record()
    write_training_layout(str(tmp_path), {**layout(2, 2, None), "precision": FP32.record()})
    with caplog.at_level("WARNING"):
        check_resume_layout(str(tmp_path), {**layout(2, 2, None), "precision": FP32.record()})
    assert "precision policy" not in caplog.text
    with caplog.at_level("WARNING"):
        check_resume_layout(str(tmp_path), {**layout(1, 4, None), "precision": bf16})
    assert re.search(rf"{tmp_path} was saved under the precision policy fp32 and this run resumes it under bf16_params "
                     r"\(compute fp32 -> bf16, parameters fp32 -> bf16, policy fp32 -> bf16_params.*\).* losses differ from the saved "
                     r"run's", caplog.text), caplog.text


# ---------------------------------------------------------------------------- a stream resumed without re-reading
class IdsTokenizer:
    """The tokenizer facts pre-tokenized documents need (:func:`~boost_hf.data.pipeline.document_token_ids`)."""

    bos_token_id, eos_token_id = 1, 2

    def __len__(self) -> int:
        return 64


def counting_decoded_rows(monkeypatch) -> list[int]:
    """Count every row ``datasets`` turns from Arrow into Python (what reading a document of an Arrow-backed stream
    costs), into the returned one-item list."""
    import datasets.iterable_dataset as streaming

    decoded = [0]
    format_batch = streaming.PythonFormatter.format_batch

    def counting(self, table):
        decoded[0] += table.num_rows
        return format_batch(self, table)

    monkeypatch.setattr(streaming.PythonFormatter, "format_batch", counting)
    return decoded


def test_a_stream_resumed_at_step_200_reads_at_most_two_global_batches_of_documents(tmp_path, monkeypatch):
    """A streamed run (pre-tokenized documents of 3-30 ids, 16-token blocks, a 32-block shuffle buffer, global batch 4)
    saved at step 200 and resumed: before its first step the resumed run decodes at most two global batches' worth of
    documents (the Trainer skipped no batch, the shuffle buffer came back from the checkpoint: refilling it alone would
    take 8 global batches), while the uninterrupted run had read ~200; steps 201-210 log the uninterrupted run's
    losses."""
    from datasets import Dataset

    from boost_hf.data import BlockStream, document_token_ids

    decoded = counting_decoded_rows(monkeypatch)
    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 31, 4000)
    documents = Dataset.from_dict({"input_ids": [rng.integers(3, 64, n).tolist() for n in lengths]})
    stream = BlockStream(documents.to_iterable_dataset(num_shards=4), document_token_ids(IdsTokenizer()), 16,
                         shuffle_buffer=32, seed=0)
    run = dict(train=stream, max_steps=210, save_steps=200, logging_steps=1)
    at_first_step = []
    training_step = BoostTrainer.training_step

    def first_step(self, *args, **kwargs):
        if not at_first_step:
            at_first_step.append(decoded[0])
        return training_step(self, *args, **kwargs)

    monkeypatch.setattr(BoostTrainer, "training_step", first_step)
    whole = trainer(tmp_path / "whole", **run)
    whole.train()
    whole.run.release()
    read_by_step_200 = whole.train_loader.documents_read
    decoded[0], at_first_step[:] = 0, []
    resumed = trainer(tmp_path / "resumed", **run)
    resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-200"))
    documents_per_global_batch = 4 * 16 / (lengths.mean() + 1)  # + the eos of each document
    assert at_first_step[0] <= 2 * documents_per_global_batch, (at_first_step[0], documents_per_global_batch)
    assert read_by_step_200 > 200 * documents_per_global_batch * 0.9
    losses = {log["step"]: log["loss"] for log in whole.state.log_history if "loss" in log}
    after = {log["step"]: log["loss"] for log in resumed.state.log_history if "loss" in log and log["step"] > 200}
    assert sorted(after) == list(range(201, 211))
    assert all(after[step] == pytest.approx(losses[step], rel=1e-4) for step in after)


def small_stream(**fields):
    from datasets import Dataset

    from boost_hf.data import BlockStream, document_token_ids

    rng = np.random.default_rng(1)
    documents = Dataset.from_dict({"input_ids": [rng.integers(3, 64, 20).tolist() for _ in range(60)]})
    return BlockStream(documents.to_iterable_dataset(), document_token_ids(IdsTokenizer()), 16, **fields)


def test_a_stream_resumes_only_as_it_was_defined(tmp_path):
    """A saved stream position continues only the same stream (block size, shuffle buffer, seed, cap) split the same
    way; a stream with less than one global batch per pass, or a split the layout cannot read, is refused."""
    from boost_hf.training.data import check_logical_streams

    saved = trainer(tmp_path / "saved", train=small_stream(shuffle_buffer=4), max_steps=2)
    saved.train()
    saved.run.release()
    checkpoint = str(tmp_path / "saved" / "checkpoint-2")
    with pytest.raises(ValueError, match=r"defined as \{.*'shuffle_buffer': 4.*this run's is \{.*'shuffle_buffer': 8"):
        trainer(tmp_path / "other-buffer", train=small_stream(shuffle_buffer=8)).train(resume_from_checkpoint=checkpoint)
    with pytest.raises(ValueError, match="stream_shards=2, but .* split into 1 logical streams: resume with stream_shards=1"):
        trainer(tmp_path / "other-split", train=small_stream(shuffle_buffer=4, logical_streams=2)).train(resume_from_checkpoint=checkpoint)
    with pytest.raises(ValueError, match="the training stream gave no whole global batch in a pass: one takes 4 blocks"):
        trainer(tmp_path / "short", train=small_stream(max_blocks=3)).train()
    with pytest.raises(ValueError, match="split into 4 logical streams .*data-parallel size 3 does not divide"):
        check_logical_streams(4, 3, 12)
    with pytest.raises(ValueError, match="global batch of 6 blocks .* does not split over the 4 logical streams"):
        check_logical_streams(4, 2, 6)

"""Training runs of ``recipes/pretrain.py`` inside one ``accelerate launch`` of 4 CPU processes.

Process start-up costs more than these tiny runs, so ``test_distributed.py`` launches this once:

    accelerate launch --config_file accelerate_configs/cpu-4proc.yaml tests/training/distributed_cases.py all OUT RECIPE.yaml [ARGS]

and it writes under ``OUT``: ``ddp``, ``ddp-resumed`` (from ``ddp/checkpoint-3``), ``tp4-resumed`` and
``dp4-resumed`` (the same checkpoint resumed at tp 4 x dp 1 and tp 1 x dp 4, same global batch), ``zero1``,
``zero2``, ``zero2-resumed``, ``zero2-tp1-resumed`` (``zero2/checkpoint-3`` resumed at tp 1 x dp 4 with ZeRO-2, through
DeepSpeed's universal checkpoint), ``tp4-from-ddp`` (the DDP run's final model loaded at tp_size 4), ``ddp-lowrank``
(low-rank activation checkpointing), ``dp4-ckpt-full`` and ``dp4-ckpt-lowrank`` (tp 1 x dp 4, accelerate's DDP,
with each activation checkpointing), ``ddp-accumulation`` and ``zero2-accumulation`` (2 micro-batches of
2 per step), ``ddp-sp`` (sequence parallelism, no end-of-training sample), ``streaming`` (an iterable training set), ``data.json`` (every rank's training samples over one
epoch) and ``errors.json`` (the messages of resumes that must fail: a DDP checkpoint under ZeRO-2, a damaged
ZeRO-2 checkpoint). Each run is tp 2 x dp 2 unless named otherwise, and writes
``<run>/trained_samples.json``: the rows of ``input_ids`` each rank trained, by step.

``distributed_cases.py tp1-resume OUT ...`` (one process) resumes ``ddp/checkpoint-3`` at tp 1;
``distributed_cases.py zero3 OUT ...`` (under the ZeRO-3 accelerate config) trains ``zero3`` and resumes it.

DeepSpeed runs use ``--deepspeed CONFIG``; accelerate drops DeepSpeed under ``ACCELERATE_USE_CPU`` (set by
the cpu-4proc config) and keeps ``ACCELERATE_USE_DEEPSPEED`` set after a DeepSpeed run, so each run here
sets both for itself.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))
import pretrain  # noqa: E402

from boost_hf.training import BoostTrainer  # noqa: E402
from boost_hf.training.pretrain import build_trainer  # noqa: E402

USE_CPU = os.environ.get("ACCELERATE_USE_CPU", "false")
TRAINED: list[dict] = []
_training_step = BoostTrainer.training_step


def _recording_training_step(self, model, inputs, num_items_in_batch=None):
    state = self.parallel_state
    TRAINED.append({"step": self.state.global_step + 1, "dp_rank": state.dp_rank, "tp_rank": state.tp_rank,
                    "rows": inputs["input_ids"].tolist()})
    return _training_step(self, model, inputs, num_items_in_batch)


BoostTrainer.training_step = _recording_training_step


def save_trained_samples(output_dir: Path) -> None:
    """Every rank's trained rows (``TRAINED``), gathered into ``output_dir/trained_samples.json``."""
    gathered = [TRAINED]
    if dist.is_initialized():
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, TRAINED)
    if not dist.is_initialized() or dist.get_rank() == 0:
        (output_dir / "trained_samples.json").write_text(json.dumps([entry for rank in gathered for entry in rank]))
    TRAINED.clear()


def train(argv: list[str], deepspeed_stage: int | None = None, out: Path | None = None) -> None:
    os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)
    os.environ["ACCELERATE_USE_CPU"] = "false" if deepspeed_stage else USE_CPU
    if deepspeed_stage:
        config = out / f"zero{deepspeed_stage}-rank{dist.get_rank()}.json"
        config.write_text(json.dumps({
            "zero_optimization": {"stage": deepspeed_stage},
            "train_batch_size": "auto",
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto",
        }))
        argv = argv + ["--deepspeed", str(config)]
    TRAINED.clear()
    pretrain.main(argv)
    save_trained_samples(Path(argv[argv.index("--output_dir") + 1]))


def expect_failure(argv: list[str], deepspeed_stage: int | None, out: Path) -> dict:
    """A run that must fail before training: its error type and message."""
    try:
        train(argv, deepspeed_stage, out)
    except Exception as error:  # noqa: BLE001 (recorded and asserted by the test)
        return {"type": type(error).__name__, "message": str(error)}
    return {"type": None, "message": "no error"}


def damaged_copy(checkpoint: Path) -> str:
    """A copy of a DeepSpeed checkpoint with 16 bytes flipped in its model states (transformers' resume never calls
    ``_load_from_checkpoint`` under DeepSpeed: ``BoostTrainer.train`` verifies the manifest itself)."""
    copy = checkpoint.parent.parent / "zero2-damaged-checkpoint" / checkpoint.name
    if dist.get_rank() == 0:
        shutil.copytree(checkpoint, copy)
        states = next(copy.glob("global_step*/mp_rank_00_model_states.pt"))
        data = bytearray(states.read_bytes())
        for i in range(16):
            data[len(data) // 2 + i] ^= 0xFF
        states.write_bytes(bytes(data))
    dist.barrier()
    return str(copy)


def seen_by_compute_metrics(prediction) -> dict:
    """What ``compute_metrics`` receives: every validation block once (labels), argmax over the full vocabulary."""
    return {"label_rows": prediction.label_ids.tolist(), "max_prediction": int(prediction.predictions.max()),
            "prediction_shape": list(prediction.predictions.shape)}


def record_epoch(argv: list[str], out: Path) -> None:
    """Every rank's training samples (rows of input_ids) over one epoch, gathered into ``out/data.json``; and what
    ``compute_metrics`` sees on every rank when evaluating the validation set (``out/compute_metrics.json``)."""
    trainer = build_trainer(argv, compute_metrics=seen_by_compute_metrics, preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(-1))
    metrics = trainer.evaluate()
    every_rank = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, {key: metrics[f"eval_{key}"] for key in ("label_rows", "max_prediction", "prediction_shape")})
    if dist.get_rank() == 0:
        validation = [list(r) for r in trainer.eval_dataset["input_ids"]]
        (out / "compute_metrics.json").write_text(json.dumps({"ranks": every_rank, "validation": validation,
                                                              "vocab_size": trainer.model.config.vocab_size}))
    rows = [row for batch in trainer.get_train_dataloader() for row in batch["input_ids"].tolist()]
    state = trainer.parallel_state
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"dp_rank": state.dp_rank, "tp_rank": state.tp_rank, "rows": rows})
    if dist.get_rank() == 0:
        dataset_rows = [list(r) for r in trainer.train_dataset["input_ids"]]
        (out / "data.json").write_text(json.dumps({"ranks": gathered, "dataset": dataset_rows}))


def main(mode: str, out: str, *common: str) -> None:
    out = Path(out)
    common = list(common)
    base = common + ["--save_strategy", "steps", "--save_steps", "3"]
    ddp_checkpoint = ["--resume_from_checkpoint", str(out / "ddp" / "checkpoint-3")]
    if mode == "tp1-resume":
        train(common + ["--output_dir", str(out / "tp1-resumed"), "--tp_size", "1", "--per_device_train_batch_size", "8", *ddp_checkpoint])
        return
    if mode == "zero3":
        train(base + ["--output_dir", str(out / "zero3")])
        train(common + ["--output_dir", str(out / "zero3-resumed"), "--resume_from_checkpoint", str(out / "zero3" / "checkpoint-3")])
        return
    train(base + ["--output_dir", str(out / "ddp")])
    train(common + ["--output_dir", str(out / "ddp-resumed"), *ddp_checkpoint])
    train(common + ["--output_dir", str(out / "tp4-resumed"), "--tp_size", "4", "--per_device_train_batch_size", "8", *ddp_checkpoint])
    train(common + ["--output_dir", str(out / "dp4-resumed"), "--tp_size", "1", "--per_device_train_batch_size", "2", *ddp_checkpoint])
    train(common + ["--output_dir", str(out / "zero1")], deepspeed_stage=1, out=out)
    train(base + ["--output_dir", str(out / "zero2")], deepspeed_stage=2, out=out)
    train(
        common + ["--output_dir", str(out / "zero2-resumed"), "--resume_from_checkpoint", str(out / "zero2" / "checkpoint-3")],
        deepspeed_stage=2, out=out,
    )
    train(  # at another tp x dp: through DeepSpeed's universal checkpoint
        common + ["--output_dir", str(out / "zero2-tp1-resumed"), "--tp_size", "1", "--per_device_train_batch_size", "2",
                  "--resume_from_checkpoint", str(out / "zero2" / "checkpoint-3")], deepspeed_stage=2, out=out,
    )
    errors = {
        "ddp-under-zero2": expect_failure(common + ["--output_dir", str(out / "ddp-under-zero2"), *ddp_checkpoint], 2, out),
        "zero2-damaged": expect_failure(
            common + ["--output_dir", str(out / "zero2-damaged"), "--resume_from_checkpoint", damaged_copy(out / "zero2" / "checkpoint-3")],
            2, out),
    }
    if dist.get_rank() == 0:
        (out / "errors.json").write_text(json.dumps(errors))
    train(common + ["--output_dir", str(out / "tp4-from-ddp"), "--tp_size", "4", "--init_from", str(out / "ddp" / "final"),
                    "--max_steps", "1"])
    train(common + ["--output_dir", str(out / "ddp-lowrank"), "--activation_checkpointing_mode", "lowrank"])
    for mode in ("full", "lowrank"):  # accelerate's DDP (tp 1, fp32), under boost-hf's re-entrant checkpointing
        train(common + ["--output_dir", str(out / f"dp4-ckpt-{mode}"), "--tp_size", "1", "--per_device_train_batch_size", "2",
                        "--activation_checkpointing_mode", mode])
    accumulation = ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2"]
    train(common + accumulation + ["--output_dir", str(out / "ddp-accumulation")])
    train(common + accumulation + ["--output_dir", str(out / "zero2-accumulation")], deepspeed_stage=2, out=out)
    train(common + ["--output_dir", str(out / "ddp-sp"), "--sequence_parallel", "true", "--sample_max_new_tokens", "0"])
    train(common + ["--output_dir", str(out / "streaming"), "--streaming", "true"])
    record_epoch(common + ["--output_dir", str(out / "data")], out)


if __name__ == "__main__":
    main(*sys.argv[1:])

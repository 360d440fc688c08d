"""Training runs of ``recipes/pretrain.py`` inside one ``accelerate launch`` of 4 CPU processes.

Process start-up costs more than these tiny runs, so ``test_distributed.py`` launches this once:

    accelerate launch --config_file accelerate_configs/cpu-4proc.yaml tests/training/distributed_cases.py OUT RECIPE.yaml [ARGS]

and it writes under ``OUT``: ``ddp``, ``ddp-resumed`` (from ``ddp/checkpoint-3``), ``zero1``, ``zero2``,
``zero2-resumed``, ``tp4-from-ddp`` (the DDP run's final model loaded at tp_size 4), ``ddp-lowrank``
(low-rank activation checkpointing), ``ddp-accumulation`` and ``zero2-accumulation`` (2 micro-batches of
2 per step), ``streaming`` (an iterable training set) and ``data.json`` (every rank's training samples
over one epoch). Each run is tp 2 x dp 2 unless named otherwise.

DeepSpeed runs use ``--deepspeed CONFIG``; accelerate drops DeepSpeed under ``ACCELERATE_USE_CPU`` (set by
the cpu-4proc config) and keeps ``ACCELERATE_USE_DEEPSPEED`` set after a DeepSpeed run, so each run here
sets both for itself.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))
import pretrain  # noqa: E402

from boost_hf.training import BoostTrainer, build_datasets, build_model, build_tokenizer, parse_recipe  # noqa: E402

USE_CPU = os.environ.get("ACCELERATE_USE_CPU", "false")


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
    pretrain.main(argv)


def seen_by_compute_metrics(prediction) -> dict:
    """What ``compute_metrics`` receives: every validation block once (labels), argmax over the full vocabulary."""
    return {"label_rows": prediction.label_ids.tolist(), "max_prediction": int(prediction.predictions.max()),
            "prediction_shape": list(prediction.predictions.shape)}


def record_epoch(argv: list[str], out: Path) -> None:
    """Every rank's training samples (rows of input_ids) over one epoch, gathered into ``out/data.json``; and what
    ``compute_metrics`` sees on every rank when evaluating the validation set (``out/compute_metrics.json``)."""
    model_args, data_args, training_args = parse_recipe(argv)
    tokenizer = build_tokenizer(data_args)
    datasets = build_datasets(data_args, tokenizer, training_args)
    trainer = BoostTrainer(
        model=build_model(model_args, training_args, tokenizer), args=training_args, train_dataset=datasets["train"],
        eval_dataset=datasets["validation"], processing_class=tokenizer, compute_metrics=seen_by_compute_metrics,
        preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(-1),
    )
    metrics = trainer.evaluate()
    every_rank = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, {key: metrics[f"eval_{key}"] for key in ("label_rows", "max_prediction", "prediction_shape")})
    if dist.get_rank() == 0:
        validation = [list(r) for r in datasets["validation"]["input_ids"]]
        (out / "compute_metrics.json").write_text(json.dumps({"ranks": every_rank, "validation": validation,
                                                              "vocab_size": trainer.model.config.vocab_size}))
    rows = [row for batch in trainer.get_train_dataloader() for row in batch["input_ids"].tolist()]
    state = trainer.parallel_state
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"dp_rank": state.dp_rank, "tp_rank": state.tp_rank, "rows": rows})
    if dist.get_rank() == 0:
        dataset_rows = [list(r) for r in datasets["train"]["input_ids"]]
        (out / "data.json").write_text(json.dumps({"ranks": gathered, "dataset": dataset_rows}))


def main(out: str, *common: str) -> None:
    out = Path(out)
    common = list(common)
    base = common + ["--save_strategy", "steps", "--save_steps", "3"]
    train(base + ["--output_dir", str(out / "ddp")])
    train(common + ["--output_dir", str(out / "ddp-resumed"), "--resume_from_checkpoint", str(out / "ddp" / "checkpoint-3")])
    train(common + ["--output_dir", str(out / "zero1")], deepspeed_stage=1, out=out)
    train(base + ["--output_dir", str(out / "zero2")], deepspeed_stage=2, out=out)
    train(
        common + ["--output_dir", str(out / "zero2-resumed"), "--resume_from_checkpoint", str(out / "zero2" / "checkpoint-3")],
        deepspeed_stage=2, out=out,
    )
    train(common + ["--output_dir", str(out / "tp4-from-ddp"), "--tp_size", "4", "--init_from", str(out / "ddp" / "final"),
                    "--max_steps", "1"])
    train(common + ["--output_dir", str(out / "ddp-lowrank"), "--activation_checkpointing_mode", "lowrank"])
    accumulation = ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2"]
    train(common + accumulation + ["--output_dir", str(out / "ddp-accumulation")])
    train(common + accumulation + ["--output_dir", str(out / "zero2-accumulation")], deepspeed_stage=2, out=out)
    train(common + ["--output_dir", str(out / "streaming"), "--streaming", "true"])
    record_epoch(common + ["--output_dir", str(out / "data")], out)


if __name__ == "__main__":
    main(*sys.argv[1:])

"""Training runs of ``recipes/pretrain.py`` with tied embeddings (``--tie_word_embeddings true``), for
``test_tied_embeddings.py``:

    accelerate launch --config_file accelerate_configs/cpu-4proc.yaml tests/training/tied_cases.py four OUT RECIPE [ARGS]
    python tests/training/tied_cases.py one OUT RECIPE [ARGS]

Every run trains 6 steps of the same global batch of 8 sequences of a tied CoLA model and writes ``OUT/<run>`` (the
trainer's state, its checkpoints, ``final/``) and ``OUT/<run>/final-logits.pt``, the trained model's logits
(:mod:`tests.training.final_logits`).

* ``four`` (4 processes): ``ddp`` (tp 1 x dp 4, no checkpoint: ``--save_strategy no``, the trained model only in
  ``final/``), ``vanilla`` (tp 2 x dp 2, ``tp_style vanilla``: the embedding and the head split along the vocabulary,
  one parameter), ``zero1`` (tp 1 x dp 4, ZeRO-1), ``fsdp2`` (tp 1 x dp 4, ``--data_parallel fsdp2``), ``zero2``
  (DeepSpeed ZeRO-2, tp 1 x dp 4), each with a checkpoint at step 3 but ``ddp``; ``fsdp2``'s checkpoint-3 resumed at
  tp 2 x dp 2 under vanilla (``vanilla-from-fsdp2``) and ``vanilla``'s under FSDP2 at tp 1 x dp 4 (``fsdp2-from-vanilla``).
* ``one`` (one process): ``single`` (checkpoint at 3), ``fsdp2``'s and ``zero1``'s checkpoint-3 resumed in one process
  (``one-from-fsdp2``, ``one-from-zero1``), and ``boost-hf export`` of the ``single``, ``fsdp2`` and ``zero2``
  checkpoint-3s into ``OUT/export-<run>``.

DeepSpeed runs use ``--deepspeed CONFIG`` and set accelerate's variables for themselves, as ``distributed_cases.py``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))
import pretrain  # noqa: E402

from boost_hf.cli import main as boost_hf_cli  # noqa: E402
from tests.training.final_logits import record_final_logits  # noqa: E402

USE_CPU = os.environ.get("ACCELERATE_USE_CPU", "false")
record_final_logits()


def train(argv: list[str], out: Path, deepspeed_stage: int | None = None) -> None:
    """One run of the recipe (``deepspeed_stage``: under DeepSpeed's ZeRO of that stage)."""
    os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)
    os.environ["ACCELERATE_USE_CPU"] = "false" if deepspeed_stage else USE_CPU
    if deepspeed_stage:
        config = out / f"zero{deepspeed_stage}-rank{dist.get_rank()}.json"
        config.write_text(json.dumps({"zero_optimization": {"stage": deepspeed_stage}, "train_batch_size": "auto",
                                      "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                                      "gradient_clipping": "auto"}))
        argv = argv + ["--deepspeed", str(config)]
    pretrain.main(argv)
    if dist.is_initialized():
        dist.barrier()


def main(mode: str, out: str, *common: str) -> None:
    out, common = Path(out), [*common, "--tie_word_embeddings", "true"]
    saving = ["--save_strategy", "steps", "--save_steps", "3"]
    dp4 = ["--tp_size", "1", "--per_device_train_batch_size", "2"]
    vanilla = ["--tp_size", "2", "--tp_style", "vanilla", "--per_device_train_batch_size", "4"]
    fsdp2 = [*dp4, "--data_parallel", "fsdp2"]
    one = ["--tp_size", "1", "--per_device_train_batch_size", "8"]

    def run(name: str, layout: list[str], *extra: str, deepspeed_stage: int | None = None) -> None:
        train([*common, *layout, *extra, "--output_dir", str(out / name)], out, deepspeed_stage)

    def resume(source: str) -> list[str]:
        return ["--resume_from_checkpoint", str(out / source / "checkpoint-3")]

    if mode == "four":
        run("ddp", dp4)
        run("vanilla", vanilla, *saving)
        run("zero1", dp4, "--zero1_optimizer", "true", *saving)
        run("fsdp2", fsdp2, *saving)
        run("zero2", dp4, *saving, deepspeed_stage=2)
        run("vanilla-from-fsdp2", vanilla, *resume("fsdp2"))
        run("fsdp2-from-vanilla", fsdp2, *resume("vanilla"))
    elif mode == "one":
        run("single", one, *saving)
        run("one-from-fsdp2", one, *resume("fsdp2"))
        run("one-from-zero1", one, *resume("zero1"))
        for source in ("single", "fsdp2", "zero2"):
            if boost_hf_cli(["export", str(out / source / "checkpoint-3"), str(out / f"export-{source}")]) != 0:
                raise RuntimeError(f"boost-hf export of {source}/checkpoint-3 failed")
    else:
        raise ValueError(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(*sys.argv[1:])

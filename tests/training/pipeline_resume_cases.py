"""Training runs of ``recipes/pretrain.py`` that save and resume across pipeline layouts, for
``test_pipeline_resume.py``, a few per launch (process start-up costs more than these tiny runs):

    python tests/training/pipeline_resume_cases.py single OUT RECIPE.yaml [ARGS]        # one process
    accelerate launch --config_file accelerate_configs/cpu-4proc.yaml tests/training/pipeline_resume_cases.py four OUT ...
    python tests/training/pipeline_resume_cases.py one OUT RECIPE.yaml [ARGS]           # one process, after ``four``

Every run has the global batch 8 and writes under ``OUT/<run>``; a resumed run also writes
``loaded-optimizer/rank<r>.pt``: per canonical parameter name, the optimizer state this rank holds right after
loading the checkpoint (its ZeRO-1 share only under ``--zero1_optimizer``) and the parameter's shard spec. Every run
writes ``memory.json``: per rank, the bytes it holds after the backward of its last step (unique storages of its
parameters, their gradients, the optimizer state it steps, and the buckets of every ``DistributedDataParallel`` it
runs), with the model config and layout, for ``boost_hf.perf.memory.static_memory``.

* ``single``: ``single`` (tp 1, one process; checkpoint at step 3).
* ``four``: ``pp2-tp2`` (checkpoint at 3, ``--save_async``); ``pp2-tp2-from-single`` (``single/checkpoint-3`` resumed at
  pp 2 x tp 2); ``pp2-tp2-from-legacy`` (the same checkpoint in the format of boost-hf 0.x, ``single-legacy``);
  ``tp2-dp2-from-pp2`` (``pp2-tp2/checkpoint-3`` at pp 1 x tp 2 x dp 2); ``pp2-dp2-interleaved-from-pp2`` (the same at
  pp 2 x dp 2, interleaved 1F1B: 2 stages per rank, other layers per pipeline rank); ``pp2-dp2`` (1F1B, no ZeRO-1);
  ``pp2-dp2-zero1`` (the same with ``--zero1_optimizer``, checkpoint at 3); ``pp2-dp2-zero1-resumed`` (its checkpoint
  at the same layout); ``dp4-zero1-from-zero1`` (its checkpoint at pp 1 x tp 1 x dp 4, ZeRO-1 over 4 ranks);
  ``tp2-dp2-zero1`` (``--zero1_optimizer`` at pp 1 x tp 2 x dp 2: each TP rank's shards over its DP group, checkpoint
  at 3) and ``tp2-dp2-zero1-resumed`` (its checkpoint at the same layout).
* ``one``: ``single-from-pp2`` (``pp2-tp2/checkpoint-3`` in one process), ``single-from-zero1``
  (``pp2-dp2-zero1/checkpoint-3`` in one process, without ZeRO-1) and ``single-from-tp2-zero1`` (the same from
  ``tp2-dp2-zero1/checkpoint-3``).

Streamed runs (:data:`STREAM`: 19 blocks per pass, split into 4 logical streams, an 8-block shuffle buffer; each pass
gives 2 whole global batches and 3 blocks, so 6 steps cross two pass ends and the checkpoint at step 3 is inside
the second pass): ``stream-single`` (one process, checkpoint at 3), ``stream-single-keep-last``
(``--dataloader_drop_last false``: the short global batch is trained), ``stream-pp2-dp2`` (checkpoint at 3),
``stream-tp2-dp2-from-pp2`` (its checkpoint at pp 1 x tp 2 x dp 2), ``stream-dp4-from-single`` (``stream-single``'s at
dp 4), ``stream-pp2-tp2-keep-last`` (2 micro-batches of 4 rows: the short batch is 3 rows) and
``stream-single-from-pp2`` (``stream-pp2-dp2``'s checkpoint in one process). Each writes ``documents_read.json``: the
documents every rank read from the stream.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))
import pretrain  # noqa: E402

from boost_hf.parallel.sharding import shard_spec_of  # noqa: E402
from boost_hf.training import BoostTrainer  # noqa: E402
from boost_hf.training.zero1 import sharded_over_data_parallel  # noqa: E402

_load_optimizer_and_scheduler = BoostTrainer._load_optimizer_and_scheduler


def _recording_load(self, checkpoint):
    """Load, then write what this rank's optimizer holds per canonical parameter name."""
    _load_optimizer_and_scheduler(self, checkpoint)
    if checkpoint is None:
        return
    optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
    zero = sharded_over_data_parallel(optimizer)
    held = zero.optim.state if zero is not None else optimizer.state
    record = {}
    for name, param in self.model.named_parameters():
        if param in held:
            spec = shard_spec_of(param)
            record[name] = {"state": {k: v.clone() for k, v in held[param].items()},
                            "spec": [list(spec.full_shape), spec.partition_dim, spec.tp_rank, spec.tp_size]}
    folder = Path(self.args.output_dir) / "loaded-optimizer"
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(record, folder / f"rank{dist.get_rank() if dist.is_initialized() else 0}.pt")


BoostTrainer._load_optimizer_and_scheduler = _recording_load
_training_step = BoostTrainer.training_step
HELD: dict = {}  # what this rank held after the backward of the current run's latest step


def _unique_bytes(tensors) -> int:
    storages = {StorageWeakRef(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors if t is not None}
    return sum(storages.values())


def _held_after_backward(self, model, inputs, num_items_in_batch=None):
    """The training step, then what this rank holds: its parameters, their gradients, its optimizer state (from the
    previous step) and the buckets of each DDP module it runs (the trainer's, or each pipeline stage's)."""
    loss = _training_step(self, model, inputs, num_items_in_batch)
    params = list(self.model.parameters())
    optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
    zero = sharded_over_data_parallel(optimizer)
    state = (zero.optim if zero is not None else optimizer).state
    pipeline = getattr(self.model, "pipeline", None)
    ddp = [module for module in (self.model_wrapped, *((pipeline._wrapped or []) if pipeline is not None else []))
           if isinstance(module, torch.nn.parallel.DistributedDataParallel)]
    ranks = self.parallel_state
    HELD.update(
        parameters=_unique_bytes(params),
        gradients=_unique_bytes(p.grad for p in params),
        optimizer_states=_unique_bytes(v for per_param in state.values() for v in per_param.values() if torch.is_tensor(v)),
        gradient_buckets=sum(int(n) for module in ddp for n in str(module._get_ddp_logging_data()["bucket_sizes"]).split(",") if n.strip()),
        ranks={"pp": ranks.pp_rank, "tp": ranks.tp_rank, "dp": ranks.dp_rank},
        dp_size=ranks.dp_size, zero1=bool(self.args.zero1_optimizer), bf16=bool(self.args.bf16),
        config=self.model.config.to_dict(), parallel=self.args.to_parallel_config(self.model.config).to_dict(),
    )
    return loss


BoostTrainer.training_step = _held_after_backward
STREAM = ["--streaming", "true", "--stream_shards", "4", "--shuffle_buffer", "8", "--max_train_blocks", "19"]
LOADERS = []
_get_train_dataloader = BoostTrainer.get_train_dataloader


def _remembering_get_train_dataloader(self):
    LOADERS.append(_get_train_dataloader(self))
    return LOADERS[-1]


BoostTrainer.get_train_dataloader = _remembering_get_train_dataloader


def train(out: Path, run: str, common: list[str], *layout: str, save: bool = False, resume: str | None = None) -> None:
    argv = [*common, *layout, "--output_dir", str(out / run)]
    if save:
        argv += ["--save_strategy", "steps", "--save_steps", "3"]
    if resume:
        argv += ["--resume_from_checkpoint", str(out / resume / "checkpoint-3")]
    HELD.clear()
    LOADERS.clear()
    pretrain.main(argv)
    held = [dict(HELD)]
    if dist.is_initialized():
        held = [None] * dist.get_world_size()
        dist.all_gather_object(held, dict(HELD))
    if not dist.is_initialized() or dist.get_rank() == 0:
        (out / run / "memory.json").write_text(json.dumps(held))
    if "--streaming" in layout:
        read = [LOADERS[-1].documents_read]
        if dist.is_initialized():
            read = [None] * dist.get_world_size()
            dist.all_gather_object(read, LOADERS[-1].documents_read)
        if not dist.is_initialized() or dist.get_rank() == 0:
            (out / run / "documents_read.json").write_text(json.dumps(read))


def requeue_finished(out: Path, run: str, common: list[str], *layout: str) -> None:
    """A copy of ``run``'s folder without its ``final/`` (a run stopped after its last step, before publishing) is
    requeued with ``--resume_from_checkpoint auto``: it trains no step and publishes ``final/``."""
    import shutil

    copy = out / f"{run}-requeued"
    if not dist.is_initialized() or dist.get_rank() == 0:
        shutil.copytree(out / run, copy, ignore=shutil.ignore_patterns("final", ".boost_hf.lock"))
    if dist.is_initialized():
        dist.barrier()
    pretrain.main([*common, *layout, "--output_dir", str(copy), "--resume_from_checkpoint", "auto"])


def main(mode: str, out: str, *common: str) -> None:
    out, common = Path(out), list(common)
    single = ["--tp_size", "1", "--per_device_train_batch_size", "8"]
    if mode == "single":
        train(out, "single", common, *single, save=True)
        train(out, "stream-single", common, *single, *STREAM, save=True)
        train(out, "stream-single-keep-last", common, *single, *STREAM, "--dataloader_drop_last", "false")
    elif mode == "one":
        train(out, "single-from-pp2", common, *single, resume="pp2-tp2")
        train(out, "stream-single-from-pp2", common, *single, *STREAM, resume="stream-pp2-dp2")
        train(out, "single-from-zero1", common, *single, resume="pp2-dp2-zero1")
        train(out, "single-from-tp2-zero1", common, *single, resume="tp2-dp2-zero1")
    elif mode == "four":
        pp2_tp2 = ["--pp_size", "2", "--tp_size", "2", "--pp_microbatches", "2", "--per_device_train_batch_size", "8"]
        pp2_dp2 = ["--pp_size", "2", "--tp_size", "1", "--pp_microbatches", "2", "--per_device_train_batch_size", "4"]
        tp2_dp2 = ["--tp_size", "2", "--per_device_train_batch_size", "4"]
        train(out, "pp2-tp2", common, *pp2_tp2, "--save_async", "true", save=True)
        requeue_finished(out, "pp2-tp2", common, *pp2_tp2)
        train(out, "pp2-tp2-from-single", common, *pp2_tp2, resume="single")
        train(out, "pp2-tp2-from-legacy", common, *pp2_tp2, resume="single-legacy")
        train(out, "tp2-dp2-from-pp2", common, *tp2_dp2, resume="pp2-tp2")
        train(out, "pp2-dp2-interleaved-from-pp2", common, "--pp_size", "2", "--tp_size", "1", "--pp_schedule", "interleaved-1f1b",
              "--pp_microbatches", "4", "--per_device_train_batch_size", "4", resume="pp2-tp2")
        train(out, "pp2-dp2", common, *pp2_dp2)
        train(out, "pp2-dp2-zero1", common, *pp2_dp2, "--zero1_optimizer", "true", save=True)
        train(out, "pp2-dp2-zero1-resumed", common, *pp2_dp2, "--zero1_optimizer", "true", resume="pp2-dp2-zero1")
        train(out, "dp4-zero1-from-zero1", common, "--tp_size", "1", "--per_device_train_batch_size", "2", "--zero1_optimizer", "true",
              resume="pp2-dp2-zero1")
        train(out, "tp2-dp2-zero1", common, *tp2_dp2, "--zero1_optimizer", "true", save=True)
        train(out, "tp2-dp2-zero1-resumed", common, *tp2_dp2, "--zero1_optimizer", "true", resume="tp2-dp2-zero1")
        train(out, "stream-pp2-dp2", common, *pp2_dp2, *STREAM, save=True)
        train(out, "stream-tp2-dp2-from-pp2", common, *tp2_dp2, *STREAM, resume="stream-pp2-dp2")
        train(out, "stream-dp4-from-single", common, "--tp_size", "1", "--per_device_train_batch_size", "2", *STREAM, resume="stream-single")
        train(out, "stream-pp2-tp2-keep-last", common, *pp2_tp2, *STREAM, "--dataloader_drop_last", "false")
    else:
        raise ValueError(f"unknown mode {mode!r}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(*sys.argv[1:])

"""The trainer's checkpoints, one call each: :func:`save_checkpoint` (``Trainer._save_checkpoint``),
:func:`load_weights` (``_load_from_checkpoint``) and :func:`load_optimizer_and_scheduler`
(``_load_optimizer_and_scheduler``), written on the checkpoint package (:mod:`boost_hf.checkpoint`: the folders,
their manifest and integrity, the model's and the optimizer's sharded state and its resharding, the layout record,
the run folder) and on what the trainer adds to a checkpoint (the publishable files, the data position, the fp32
masters of ``bf16_params``).
"""

from __future__ import annotations

import json
import logging
import os
import sys

import torch
import torch.distributed as dist
from transformers import Trainer
from transformers.trainer import SCHEDULER_NAME, TRAINER_STATE_NAME
from transformers.trainer_callback import ExportableState, TrainerState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy, TrainOutput, rotate_checkpoints

from ..checkpoint.export import save_model_files
from ..checkpoint.folders import full_parameters
from ..checkpoint.optimizer_state import load_optimizer_state, optimizer_state
from ..checkpoint.resume import (
    load_optimizer_files, missing_file_error, optimizer_record, read_training_layout, training_layout, write_training_layout,
)
from ..checkpoint.sharded_state import DCP_FOLDER, is_distributed_checkpoint, load_model_state, model_state
from ..checkpoint.weights_io import load_canonical_checkpoint, resolve_checkpoint_files
from .data import save_data_position
from .precision import full_precision_parameters
from .publish import publishing, save_publishing_files, schedule_name

logger = logging.getLogger(__name__)


def save_checkpoint(trainer, trial) -> None:
    """The Trainer's checkpoint, every rank writing its own shards: the model's parameters and the optimizer's
    state as a ``torch.distributed.checkpoint`` in ``dcp/`` (:func:`~boost_hf.checkpoint.sharded_state.model_state`,
    :func:`~boost_hf.checkpoint.optimizer_state.optimizer_state`; under DeepSpeed the model only, its optimizer in its
    own folder), beside the Trainer's other files (``Trainer._save_checkpoint``'s: scheduler, RNG, trainer state,
    best-model record, hub push) and the Hugging Face folder without weights. Written by
    :class:`~boost_hf.checkpoint.folders.CheckpointSaver`: a staging folder, the manifest, the record of the lineage's
    last checkpoint, the rename; only then are the lineage's oldest checkpoints rotated out, by step
    (``--save_total_limit``). ``--save_async``: the shards are copied to host
    memory and written in the background; the next save (and the final model) waits for this one."""
    if trainer.hp_search_backend is None and trial is None:
        trainer.store_flos()
    trainer.run.claim()
    run_dir = trainer._get_output_dir(trial=trial)
    target = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}")
    trainer.run.saver.wait()  # the previous save is complete under its name (best-model record, rotation)

    def write_files(staging: str) -> None:
        if not trainer.args.save_only_model:  # first: its collectives (the optimizer records, DeepSpeed's save), before
            trainer._save_optimizer_and_scheduler(staging)  # a rank's own writes, which one rank may fail
        if trainer.args.should_save:
            with publishing(trainer):
                save_model_files(trainer.model, staging)
            save_publishing_files(trainer, staging)
        if trainer.args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST) and trainer.state.best_global_step:
            best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.best_global_step}")
            if best == target or os.path.exists(best):
                trainer.state.best_model_checkpoint = best
        if not trainer.args.save_only_model:
            trainer._save_scaler(staging)
            trainer._save_rng_state(staging)
            save_data_position(staging, trainer.train_dataset, trainer.train_loader, trainer.args)
        if trainer.args.should_save:
            for callback in trainer.callback_handler.callbacks + [trainer.control]:
                if isinstance(callback, ExportableState):
                    name, exported = type(callback).__name__, callback.state()
                    if isinstance(trainer.state.stateful_callbacks[name], list):
                        trainer.state.stateful_callbacks[name].append(exported)
                    else:
                        trainer.state.stateful_callbacks[name] = exported
            trainer.state.save_to_json(os.path.join(staging, TRAINER_STATE_NAME))

    def rotate() -> None:  # by step: the checkpoint-<step> folders are the lineage's (boost_hf.checkpoint.lineage)
        rotate_checkpoints(output_dir=run_dir, save_total_limit=trainer.args.save_total_limit,
                           best_model_checkpoint=trainer.state.best_model_checkpoint, use_mtime=False)

    with full_precision_parameters(trainer.model), full_parameters(trainer.model, trainer.zero_stage):  # bf16_params: the masters
        shards = {"model": model_state(trainer.model)}
        if not trainer.args.save_only_model and not trainer.is_deepspeed_enabled:
            shards["optimizer"] = optimizer_state(trainer.model, trainer.optimizer)
        trainer.run.saver.save(target, write_files=write_files, state_dict=shards, config=trainer.model.config,
                                   asynchronous=getattr(trainer.args, "save_async", False),
                                   after_commit=rotate if trainer.args.should_save else None)
    if trainer.args.push_to_hub:
        trainer.run.saver.wait()
        trainer._push_from_checkpoint(target)


def run_layout(trainer, optimizer_records: list[dict] | None = None) -> dict:
    """This run's PP x TP x DP sizes, ZeRO stage, global batch, precision policy (its record: what computes,
    stores, accumulates and reduces in which dtype), data parallelism (DDP, or FSDP2's shard and replica sizes) and,
    given, the optimizer record of each pipeline rank
    (:func:`optimizer_records`; :mod:`boost_hf.checkpoint.resume`)."""
    state = trainer.parallel_state
    layout = training_layout(tp_size=state.tp_size, dp_size=state.dp_size, pp_size=state.pp_size, zero_stage=trainer.zero_stage,
                             args=trainer.args, optimizer_records=optimizer_records)
    how = trainer.fully_shard()
    data_parallel = {"backend": "ddp"} if how is None else {
        "backend": "fsdp2", "shard_size": how.shard_size, "replicate_size": how.replicate_size,
        "reshard_after_forward": how.reshard_after_forward, "units": "decoder_layers" if how.layers_apart else "model"}
    # what the published final/ takes from training (the trained context, whether BOS was in the batches): restored by
    # a resume, so a resumed run publishes what the uninterrupted one would
    trained = {"context": trainer.trained_context, "bos_seen": trainer.trained_with_bos}
    return {**layout, "precision": trainer.precision.record(), "data_parallel": data_parallel, "trained": trained}


def restore_trained_record(trainer, checkpoint: str) -> None:
    """What the published ``final/`` takes from training, as ``checkpoint`` recorded it (:func:`run_layout`: the
    trained context, whether BOS was in the batches): a resumed run publishes what the uninterrupted one would."""
    trained = (read_training_layout(checkpoint) or {}).get("trained") or {}
    trainer.trained_context = trained.get("context") or trainer.trained_context
    trainer._bos_seen = bool(trained.get("bos_seen")) or trainer._bos_seen


def continue_complete_run(trainer, checkpoint: str) -> TrainOutput:
    """``checkpoint`` was saved at ``max_steps``: its weights (the fp32 masters under ``bf16_params``) and trainer
    state are loaded, and no step is trained, so the run goes on (evaluation, ``final/``) exactly as the
    uninterrupted run did after its last step, and no checkpoint is saved or rotated."""
    trainer.state = TrainerState.load_from_json(os.path.join(checkpoint, TRAINER_STATE_NAME))
    trainer._load_from_checkpoint(checkpoint)
    step, max_steps = trainer.state.global_step, trainer.args.max_steps
    if trainer.is_world_process_zero():
        said = (f"was saved at step {step}, this run's max_steps: its training is complete; no step is trained" if step == max_steps
                else f"was saved at step {step}, past this run's max_steps {max_steps}: no step is trained (a run does not go "
                     f"back: to end at an earlier step, resume an earlier checkpoint); the run ends with step {step}'s weights")
        print(f"boost-hf: {checkpoint} {said}.", file=sys.stderr, flush=True)
    return TrainOutput(trainer.state.global_step, 0.0, {})


def optimizer_records(trainer) -> list[dict] | None:
    """:func:`~boost_hf.checkpoint.resume.optimizer_record` of every pipeline rank, in pipeline order (``None`` under
    DeepSpeed). Collective under pipeline parallelism: one ``all_gather_object`` over the PP group."""
    if trainer.is_deepspeed_enabled:
        return None
    own = optimizer_record(trainer.model, trainer.optimizer)
    if trainer.parallel_state.pp_group is None:
        return [own]
    records = [None] * trainer.parallel_state.pp_size
    dist.all_gather_object(records, own, group=trainer.parallel_state.pp_group)
    return records


def save_optimizer_and_scheduler(trainer, output_dir: str) -> None:
    """The scheduler and ``training_layout.json`` with each pipeline rank's optimizer record (which lets a run at
    another PP x TP x DP layout check and reshard the optimizer state, saved by every rank with the model's shards);
    under DeepSpeed its own checkpoint folder (ZeRO partitions per DP and TP rank). Collective."""
    records = optimizer_records(trainer)
    if trainer.is_deepspeed_enabled:
        Trainer._save_optimizer_and_scheduler(trainer, output_dir)
    if trainer.args.should_save:
        if not trainer.is_deepspeed_enabled:
            torch.save(trainer.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
        write_training_layout(output_dir, run_layout(trainer, records))


def load_optimizer_and_scheduler(trainer, checkpoint: str | None) -> None:
    """The optimizer state of this rank (resharded if the checkpoint has another PP x TP x DP layout) and the
    scheduler; a missing one is an error naming it (``--init_from`` starts from the weights only)."""
    if checkpoint is None:
        return
    scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
    if trainer.is_deepspeed_enabled:
        if not os.path.isfile(scheduler) and type(trainer.lr_scheduler).__name__ != "DeepSpeedSchedulerWrapper":
            raise missing_file_error(scheduler, checkpoint, "learning-rate scheduler state")
        return Trainer._load_optimizer_and_scheduler(trainer, checkpoint)
    state, elsewhere = trainer.parallel_state, trainer.engine.absent_parameters
    with full_precision_parameters(trainer.model, loading=True):  # the state in the masters' dtype (bf16_params)
        if is_distributed_checkpoint(checkpoint):
            load_optimizer_state(trainer.optimizer, trainer.model, checkpoint, elsewhere)
        else:
            device = "cpu" if trainer.args.device.type == "cpu" else trainer.args.device  # torch cannot restore to "cpu:0"
            load_optimizer_files(trainer.optimizer, trainer.model, checkpoint, state.tp_rank, state.tp_size, device,
                                 state.pp_rank, state.pp_size, held_elsewhere=elsewhere)
    if not os.path.isfile(scheduler):
        raise missing_file_error(scheduler, checkpoint, "learning-rate scheduler state")
    trainer.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))
    continue_schedule(trainer, checkpoint)


def continue_schedule(trainer, checkpoint: str) -> None:
    """A checkpoint saved in a run of another ``max_steps`` (raised on a finished run, or lowered): the learning-rate
    schedule is this run's, the schedule of a run of this ``max_steps``, from the checkpoint's step on (the restored
    optimizer's rates, the saved schedule's, replaced by this schedule's at that step: without it the first step
    would train at the saved rate, the next jump to this schedule's), and global rank 0 says so with both rates."""
    with open(os.path.join(checkpoint, TRAINER_STATE_NAME)) as f:
        saved = json.load(f)
    before, now, step = saved.get("max_steps"), trainer.state.max_steps, saved.get("global_step", 0)
    scheduler = trainer.lr_scheduler
    if not before or before == now or not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        return
    saved_rate = trainer.optimizer.param_groups[0]["lr"]
    scheduler.last_epoch = step - 1
    scheduler.step()  # the rates of this run's schedule after `step` steps, into the optimizer's groups
    rate = scheduler.get_last_lr()[0]
    if trainer.is_world_process_zero():
        where = f"the end of its {before} steps" if step >= before else f"step {step} of its {before}"
        logger.warning(
            f"{checkpoint} was saved at step {step} of a run of max_steps {before} and this run trains to max_steps {now}: "
            f"the learning-rate schedule ({schedule_name(trainer.args)}) continues as a run of {now} steps has it, from step "
            f"{step + 1} on: {rate:.2e} at step {step + 1} (the saved schedule was at {saved_rate:.2e} there, {where}). "
            f"To keep the saved schedule, resume with --max_steps {before}."
        )


def load_weights(trainer, resume_from_checkpoint: str, model=None) -> None:
    """This rank's shards of the checkpoint's weights, saved at any layout (its ``dcp/``, resharded by DCP; a
    checkpoint of boost-hf 0.x: its canonical ``model.safetensors``); :meth:`train` verified the folder against
    its manifest and architecture record first."""
    model = trainer.accelerator.unwrap_model(model if model is not None else trainer.model)
    with full_precision_parameters(model, loading=True):  # bf16_params: into the fp32 masters
        if is_distributed_checkpoint(resume_from_checkpoint):
            load_model_state(model, os.path.join(resume_from_checkpoint, DCP_FOLDER))
        else:
            load_canonical_checkpoint(model, resolve_checkpoint_files(resume_from_checkpoint))


__all__ = ["load_optimizer_and_scheduler", "load_weights", "optimizer_records", "run_layout", "save_checkpoint",
           "save_optimizer_and_scheduler"]

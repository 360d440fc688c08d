"""``BoostTrainer``: ``transformers.Trainer`` for tensor-parallel x data-parallel pre-training.

The model arrives already sharded (``BoostLlamaForCausalLM(config, parallel_config)`` inside the launched
process group); the trainer adds the data-parallel half and keeps every Trainer feature (logging,
evaluation, checkpoints, callbacks, ``report_to``). What it changes, and why:

=====================================  ======================================================================
Trainer hook                           boost-hf behaviour
=====================================  ======================================================================
``get_train_dataloader``               shard by DP rank: TP peers get the same micro-batch; a stream
                                       (``BlockStream``) read once per DP replica, its position restored on
                                       resume (:mod:`boost_hf.training.data`)
``get_eval_dataloader`` /              DP-sharded validation, exact token-weighted loss all-reduced over DP;
``evaluation_loop``                    ``eval_perplexity = exp(eval_loss)``, ``eval_bits_per_byte`` (with a
                                       tokenizer), through the local ``evaluate`` metric (:mod:`boost_hf.evaluation`);
                                       (pp > 1) forward only through the pipeline, ``compute_metrics`` on the
                                       last stage's logits, its metrics broadcast to every stage
``create_accelerator_and_postprocess``  ``--torch_compile``: each decoder layer compiled in place
                                       (:mod:`boost_hf.parallel.compile`), not the whole model; accelerate's bf16
                                       autocast off: the precision policy is applied here (next row); created
                                       without accelerate's parallelism_config (the arguments honour it)
``autocast_smart_context_manager``     the precision policy (:mod:`boost_hf.training.precision`, ``--bf16``,
                                       ``--precision_policy``): its autocast around every forward (training,
                                       evaluation, the sample); (pp > 1) each stage applies it, and sends its
                                       boundary tensors in the compute dtype; ``bf16_params``: bf16 parameters
                                       with fp32 masters, gradients accumulated and all-reduced over DP in fp32
                                       (no DDP), the masters stepped, saved and loaded
``create_optimizer`` /                 ``--lowrank_optimizer loro``: LORO on the factors of an svd model, AdamW on the rest,
``create_scheduler``                   the schedule restarting after each exact step (:mod:`boost_hf.optim.loro`), or the
                                       LORO authors' (``--loro_schedule authors``, :mod:`boost_hf.optim.loro_schedule`);
                                       ``--zero1_optimizer``: the optimizer sharded over DP (:mod:`boost_hf.training.zero1`)
``get_tp_size``                        our TP size: global batch and loss scaling count DP ranks only
``_wrap_model``                        (tp > 1, no DeepSpeed) DDP over the DP group, never across TP ranks;
                                       (pp > 1) no DDP here: the pipeline wraps each stage (:mod:`.pipeline_steps`);
                                       (``bf16_params``) no DDP at all: the master parameters' hooks reduce the
                                       fp32 gradients over DP
``_prepare_for_training``              (DeepSpeed) ``deepspeed.initialize`` gets our groups as ``mpu``: ZeRO
                                       shards over DP only; grouped projections stay stored together in its
                                       bf16 cast and flat buffers (:mod:`boost_hf.training.deepspeed`); a ZeRO-1/2
                                       checkpoint of another tp x dp goes through DeepSpeed's universal checkpoint
                                       (:mod:`boost_hf.training.deepspeed_universal`)
``_clip_grad_norm`` / ``_get_grad_norm``  (no DeepSpeed) the true global norm: TP shards summed over the TP
                                       group, replicated parameters once (DeepSpeed does the same via ``mpu``)
``training_step`` / ``log``            tokens/s, MFU, communication per step (:mod:`boost_hf.training.metrics`),
                                       skipped non-finite steps; (pp > 1) the step runs the pipeline schedule,
                                       its point-to-point bytes logged
``compute_loss`` / ``_get_grad_norm``  non-finite loss or grad norm: stop or skip the step
                                       (:mod:`boost_hf.training.health`)
``save_model``                         the Hugging Face folder (``final/``) streamed from every rank's shards (no
                                       gather), publishable (remote code, ``use_cache``, tokenizer context and BOS,
                                       ``README.md`` model card: :mod:`boost_hf.training.publish`)
``_save_checkpoint``                   every rank writes its own model and optimizer shards (DCP, ``--save_async``:
                                       in the background), the Trainer's small files beside them; staging folder,
                                       manifest of every rank's digests, rename, then rotation
                                       (:mod:`boost_hf.training.checkpoint`, :mod:`.optimizer_state`); also the
                                       data position (:func:`~boost_hf.training.data.save_data_position`)
``_save_optimizer_and_scheduler``      the scheduler and ``training_layout.json`` (:mod:`boost_hf.training.resume`);
                                       under DeepSpeed its own optimizer folder
``train``                              resume from the last *complete* checkpoint (newer damaged ones skipped,
                                       logged; a stream continues from its saved position: the Trainer skips no
                                       batch, ``ignore_data_skip`` during ``train``), refused at a layout it cannot
                                       resume exactly (another global batch; ZeRO-3 at another tp x dp);
                                       refuse an earlier run's ``output_dir`` unless ``overwrite_output_dir``;
                                       lock ``output_dir``; start the hang watchdog; a collective that
                                       times out (``--ddp_timeout``) is named, also in ``evaluate``
                                       (:mod:`boost_hf.training.watchdog`)
``_load_from_checkpoint`` /            resume (``train`` verified manifest and architecture, each rank its share of
                                       the files, also under DeepSpeed), then this rank's shards of
``_load_optimizer_and_scheduler``      the weights and of the optimizer state (resharded by DCP when saved at another
                                       PP x TP x DP layout; checkpoints of boost-hf 0.x through
                                       :mod:`boost_hf.training.resume`); a missing optimizer or scheduler raises
=====================================  ======================================================================

Launch with ``accelerate launch`` (``world = dp x tp_size`` processes; TP ranks are adjacent, see
:mod:`boost_hf.parallel.state`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import uuid

import datasets
import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from accelerate.utils import DynamoBackend
from transformers import Trainer
from transformers.trainer import SCHEDULER_NAME, TRAINER_STATE_NAME
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, EvalLoopOutput, EvalPrediction, SaveStrategy, rotate_checkpoints

from ..parallel.export import save_model_files
from ..parallel.sharded_state import load_model_state, model_state
from ..parallel.weights_io import load_canonical_checkpoint, resolve_checkpoint_files
from ..perf.flops import training_flops_per_token
from ..optim.loro import check_loro_training, loro_optimizer, restart_schedule_at_exact_steps
from ..optim.loro_schedule import authors_schedule
from .arguments import authors_schedule_shift, default_peak_tflops
from .checkpoint import (
    DCP_FOLDER,
    CheckpointSaver,
    atomic_directory,
    check_fresh_output_dir,
    completed_checkpoints,
    full_parameters,
    is_distributed_checkpoint,
    newest_complete_checkpoint,
    remove_earlier_run,
    remove_stale_staging,
    verify_checkpoint_once,
)
from ..parallel.compile import compile_decoder_layers
from ..data.collate import causal_lm_collator
from ..data.stream import BlockStream
from .output_lock import OutputDirInUseError, OutputDirLock
from .data import EvalShard, StreamLoader, restore_data_position, save_data_position, shard_by_data_parallel_rank
from .compatibility import accelerator_without_parallelism_config
from ..parallel.state import ParallelState
from ..evaluation import batch_sums, metrics_from_sums, sums_of_batch
from .deepspeed import ModelParallelUnit, configure_deepspeed, deepspeed_initialize_hooks, skip_shm_comm_if_requested
from .deepspeed_universal import universal_resume
from .grad_norm import clip_grad_norm_, global_grad_norm
from .health import is_finite, nonfinite_error, poison_nonfinite_loss
from .metrics import TrainingMetrics
from .optimizer_state import load_optimizer_state, optimizer_state
from .pipeline_steps import (
    PipelineReplica,
    boundary_bytes_per_step,
    from_last_stage,
    last_stage_logits,
    pipeline_evaluation_sums,
    pipeline_greedy_generate,
    pipeline_of,
    pipeline_training_step,
)
from .preemption import StopAtStepEnd, StopRequests, TrainingStopped, parse_exit_signals
from .precision import (
    DEFAULT_BUCKET_MB,
    CastAfterOptimizerStep,
    DataParallelReplica,
    full_precision_parameters,
    keep_master_parameters,
    resolve_precision,
    set_residual_dtype,
)
from .preflight import TokenIdCheckingCollator, check_dataset
from .resume import (
    check_resume_layout,
    load_optimizer_files,
    missing_file_error,
    optimizer_record,
    read_training_layout,
    training_layout,
    write_training_layout,
)
from .watchdog import TRAINING, HangWatchdog, enter_phase, exit_with_launcher, in_phase, naming_collective_timeouts, running_watchdog
from .zero1 import zero1_class_and_kwargs
from .publish import inference_settings, model_card, publish_special_tokens, save_tokenizer


class BoostTrainer(Trainer):
    """A ``transformers.Trainer`` for :class:`~boost_hf.BoostLlamaForCausalLM` under TP x DP.

    Takes the Trainer's arguments; ``args`` is usually a
    :class:`~boost_hf.training.arguments.BoostTrainingArguments` whose ``tp_size`` must match the model's.
    Without ``data_collator``, batches are stacked as they are with ``labels`` derived from ``input_ids``
    (:func:`~boost_hf.data.collate.causal_lm_collator`: packed blocks); every batch's token ids are checked against
    the model's vocabulary. Before anything else, every rank checks the
    datasets (at least one global batch of training blocks, a non-empty validation set, token ids in range).
    ``compute_metrics`` (with ``preprocess_logits_for_metrics``) is honoured: evaluation gathers each batch's
    full-vocabulary logits (one all-gather over TP), hands them to ``preprocess_logits_for_metrics`` on each rank,
    and calls ``compute_metrics`` on every rank with the predictions of all DP ranks; the loss, perplexity and bits
    per byte stay the exact sums. Without ``compute_metrics`` no logits are gathered. Under pipeline parallelism
    the logits come out of the last stage: its ranks do the above and broadcast the metrics to the other stages.
    """

    def __init__(self, model=None, args=None, **kwargs):
        exit_with_launcher()
        self.parallel_state = model.plan.state if hasattr(model, "plan") else ParallelState()  # a plain model: one device
        for field in ("tp_size", "pp_size"):
            built, asked = getattr(self.parallel_state, field), getattr(args, field, getattr(self.parallel_state, field))
            if asked != built:
                raise ValueError(
                    f"the model was built with {field}={built} but args.{field}={asked}: build it with args.to_parallel_config(config)."
                )
        if getattr(args, "zero1_optimizer", False) and (kwargs.get("optimizers") or (None, None))[0] is not None:
            raise ValueError(
                "--zero1_optimizer builds the optimizer sharded over the data-parallel group, but an optimizer was passed in "
                "optimizers=(...): pass optimizer_cls_and_kwargs=(class, kwargs) instead, or drop --zero1_optimizer."
            )
        vocab_size = model.config.vocab_size
        kwargs["data_collator"] = TokenIdCheckingCollator(kwargs.get("data_collator") or causal_lm_collator, vocab_size)
        if args is not None:
            global_batch = args.per_device_train_batch_size * self.parallel_state.dp_size * args.gradient_accumulation_steps
            check_dataset(kwargs.get("train_dataset"), vocab_size, "training", global_batch)
            eval_sets = kwargs.get("eval_dataset")
            for name, dataset in (eval_sets.items() if isinstance(eval_sets, dict) else [("validation", eval_sets)]):
                if dataset is not None:
                    check_dataset(dataset, vocab_size, name, 1)
        self.run_id: str | None = None
        self.checkpoint_saver: CheckpointSaver | None = None  # created with the run id (claim_output_dir)
        self.data_resume_from: str | None = None  # the checkpoint whose data position the training data continues from
        self.train_loader: DataLoader | StreamLoader | None = None
        self.hang_watchdog: HangWatchdog | None = None
        self.trained_context: int | None = None  # sequence length of the training micro-batches (model card, tokenizer)
        self._bos_seen: torch.Tensor | bool = False  # whether a training micro-batch held the tokenizer's BOS id (no sync)
        self.card_metadata = {"license": "apache-2.0", "datasets": []}  # Hub metadata of the model card
        self.nonfinite_skipped_steps = 0
        self.nonfinite_consecutive_skips = 0
        self._nonfinite_loss_logged: torch.Tensor | bool = False  # a non-finite micro-batch loss since the last log
        super().__init__(model=model, args=args, **kwargs)
        state = self.parallel_state
        self.precision = resolve_precision(self.args)
        self.master_parameters = None  # bf16_params: the fp32 masters and gradients (training/precision.py)
        if self.precision.has_masters:
            bucket = (getattr(self.args, "ddp_bucket_cap_mb", None) or DEFAULT_BUCKET_MB) << 20
            self.master_parameters = keep_master_parameters(model, self.precision, state.dp_group, state.dp_size, bucket)
            self.add_callback(CastAfterOptimizerStep(self.master_parameters))
        if self.precision.keeps_fp32_residual:
            set_residual_dtype(model, self.precision.residual_dtype)
        if pipeline_of(model) is not None:
            pipeline_of(model).set_precision(self.precision.stage_precision(), ddp_over_data_parallel=self.master_parameters is None)
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self.metrics = TrainingMetrics(
            model.config,
            world_size=state.tp_size * state.dp_size * state.pp_size,
            dp_size=state.dp_size,
            peak_tflops=getattr(self.args, "peak_tflops", None) or default_peak_tflops(),
            dp_grad_bytes=0 if state.dp_size == 1 else trained * self.precision.grad_reduce_dtype.itemsize,
        )
        self.add_callback(self.metrics)
        self.stop_requests = StopRequests(parse_exit_signals(getattr(self.args, "exit_signals", "")),
                                          getattr(self.args, "exit_after_minutes", 0.0), run_broken=self._a_peer_exited)
        self.stop_at_step_end = StopAtStepEnd(self.stop_requests, self.args.device)
        self.add_callback(self.stop_at_step_end)

    # ------------------------------------------------------------------ set-up
    def create_accelerator_and_postprocess(self) -> None:
        with accelerator_without_parallelism_config():  # honoured by the arguments, not to be applied again
            super().create_accelerator_and_postprocess()
        if self.args.deepspeed_plugin is not None and not self.is_deepspeed_enabled:
            raise ValueError(
                "DeepSpeed was requested but accelerate runs without it: ACCELERATE_USE_CPU is set (`accelerate launch "
                "--cpu`, or the environment). Remove it; boost-hf selects the CPU itself when there is no GPU."
            )
        if getattr(self.args, "lowrank_optimizer", "adamw") == "loro":
            check_loro_training(self.model, deepspeed=self.is_deepspeed_enabled)
        if self.is_deepspeed_enabled:
            configure_deepspeed(self.accelerator.state.deepspeed_plugin.hf_ds_config, self.args, self.parallel_state.dp_size)
            skip_shm_comm_if_requested()
        if self.args.torch_compile:
            # per decoder layer, in place, at any TP size; accelerate must not compile the whole model again
            compile_decoder_layers(self.model, backend=self.args.torch_compile_backend, mode=self.args.torch_compile_mode)
            self.accelerator.state.dynamo_plugin.backend = DynamoBackend.NO
        if self.accelerator.mixed_precision == "bf16" and not self.is_deepspeed_enabled:
            # the precision policy's autocast is applied here (autocast_smart_context_manager) and by each pipeline
            # stage; accelerate would wrap the forward of the models it prepares only, and bf16_params runs none
            self.accelerator.native_amp = False

    def autocast_smart_context_manager(self, cache_enabled: bool | None = True) -> contextlib.AbstractContextManager:
        """The precision policy's autocast (``torch.autocast`` to the compute dtype, or nothing) for a forward."""
        return self.precision.autocast(self.args.device.type)

    def create_optimizer(self, model=None):
        if self.optimizer is None and getattr(self.args, "lowrank_optimizer", "adamw") == "loro":
            model = self.model if model is None else model
            args = self.args
            self.optimizer = loro_optimizer(
                model, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
                weight_decay=args.weight_decay, exact_every=args.loro_exact_every, lr_scale=args.loro_lr_scale,
                decay_parameter_names=self.get_decay_parameter_names(model), epsilon_placement=args.adam_epsilon_placement,
            )
        if self.optimizer is None and getattr(self.args, "zero1_optimizer", False) and self.parallel_state.dp_size > 1:
            chosen = self.optimizer_cls_and_kwargs
            optimizer_cls, kwargs = chosen or self.get_optimizer_cls_and_kwargs(self.args, self.model if model is None else model)
            self.optimizer_cls_and_kwargs = zero1_class_and_kwargs(optimizer_cls, kwargs, self.parallel_state.dp_group)
            try:
                return super().create_optimizer(model)
            finally:
                self.optimizer_cls_and_kwargs = chosen
        return super().create_optimizer(model)

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        args = self.args
        loro = getattr(args, "lowrank_optimizer", "adamw") == "loro"
        if self.lr_scheduler is None and loro and args.loro_schedule == "authors":
            self.lr_scheduler = authors_schedule(
                self.optimizer if optimizer is None else optimizer, training_steps=num_training_steps,
                warmup_steps=args.get_warmup_steps(num_training_steps), restart_every=args.loro_exact_every,
                restart_warmup_steps=args.loro_restart_warmup_steps, min_ratio=args.lr_scheduler_kwargs["min_lr_rate"],
                shift=authors_schedule_shift(args, num_training_steps),
            )
            self._created_lr_scheduler = True
            return self.lr_scheduler
        created = self.lr_scheduler is None
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        if created and loro:
            restart_schedule_at_exact_steps(scheduler, args.loro_exact_every, args.loro_restart_warmup_steps)
        return scheduler

    def get_tp_size(self) -> int:
        return self.parallel_state.tp_size

    @property
    def _zero_stage(self) -> int | None:
        return self.accelerator.state.deepspeed_plugin.zero_stage if self.is_deepspeed_enabled else None

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        if pipeline_of(self.model) is not None:
            return model if isinstance(model, PipelineReplica) else PipelineReplica(model)
        if training and self.master_parameters is not None:  # gradients reduced over DP by the master parameters
            return model if isinstance(model, DataParallelReplica) else DataParallelReplica(model)
        if not training or self.is_deepspeed_enabled or self.parallel_state.tp_size == 1:
            return super()._wrap_model(model, training, dataloader)
        if self.accelerator.unwrap_model(model, keep_torch_compile=False) is not model:
            return model  # already wrapped by an earlier train() call
        model = self.accelerator.prepare_model(model, evaluation_mode=True)  # placement and autocast, no DDP
        kwargs = self.accelerator.ddp_handler.to_kwargs() if self.accelerator.ddp_handler is not None else {}
        kwargs["find_unused_parameters"] = bool(self.args.ddp_find_unused_parameters)
        device_ids = [self.args.device.index] if self.args.device.type == "cuda" else None
        dp_group = self.parallel_state.mesh.get_group("dp")
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids, process_group=dp_group, **kwargs)

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        hooks = contextlib.nullcontext()
        if self.is_deepspeed_enabled:
            mpu = ModelParallelUnit(self.parallel_state) if self.parallel_state.mesh is not None else None
            saved = read_training_layout(resume_from_checkpoint) if resume_from_checkpoint else None  # another tp x dp:
            hooks = deepspeed_initialize_hooks(mpu, universal_resume(resume_from_checkpoint, self.args.output_dir, saved, self.training_layout()))
        with hooks:
            return super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)

    # ------------------------------------------------------------------ data
    def get_train_dataloader(self) -> DataLoader | StreamLoader:
        state, args = self.parallel_state, self.args
        dataset = self.train_dataset
        if isinstance(dataset, datasets.IterableDataset):  # blocks streamed as they are
            dataset = BlockStream(dataset, None, len(next(iter(dataset))["input_ids"]))
        if isinstance(dataset, BlockStream):
            self.train_loader = StreamLoader(dataset, state, micro_batch=self._train_batch_size, accumulation=args.gradient_accumulation_steps,
                                             drop_last=args.dataloader_drop_last, collate=self.data_collator, device=args.device)
        else:
            self.train_loader = shard_by_data_parallel_rank(super().get_train_dataloader(), state)
        if self.data_resume_from is not None:
            restore_data_position(self.data_resume_from, dataset, self.train_loader, args)
        return self.train_loader

    def get_eval_dataloader(self, eval_dataset=None) -> DataLoader:
        if isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset[eval_dataset]
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")
        if hasattr(dataset, "column_names"):
            dataset = self._remove_unused_columns(dataset, description="Evaluation")
        state = self.parallel_state
        return DataLoader(
            EvalShard(dataset, state.dp_size, state.dp_rank),
            batch_size=self.args.eval_batch_size,
            collate_fn=self.data_collator,
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
        )

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None, metric_key_prefix="eval"):
        """Mean next-token loss over every target token of the evaluation set, its perplexity and bits per byte,
        then ``compute_metrics`` if given.

        Each DP rank sums its tokens' losses (``num_items_in_batch=1`` makes the model return the sum), tokens and
        bytes; one all-reduce of ``[sum, tokens, bytes]`` in the DP group (TP peers hold the same values).
        """
        deepspeed_engine = self.is_deepspeed_enabled and self.model_wrapped is not self.model
        model = self.model_wrapped if deepspeed_engine else self.model
        model.eval()
        totals = torch.zeros(3, dtype=torch.float64, device=self.args.device)  # [nll sum, tokens, bytes]
        wants_predictions = self.compute_metrics is not None
        full_logits = {"return_logits": True} if hasattr(self.model, "plan") else {}  # TP: gather the vocabulary shards
        predictions, label_ids = [], []
        pipeline = pipeline_of(self.model)
        collecting = last_stage_logits(pipeline) if pipeline is not None and wants_predictions else contextlib.nullcontext()
        with torch.no_grad(), collecting as last_stage_outputs, self.autocast_smart_context_manager():
            for batch in dataloader:
                batch = self._prepare_inputs(batch)
                if pipeline is not None:  # summed over DP already
                    totals += pipeline_evaluation_sums(pipeline, batch, self.processing_class)
                    if last_stage_outputs is None:  # no compute_metrics, or not the last stage: no logits here
                        continue
                    rows = batch["labels"].shape[0]  # without the rows that padded it to whole micro-batches
                    logits = self.model.lm_head.gather_logits(torch.cat(last_stage_outputs)[:rows])
                    last_stage_outputs.clear()
                elif not wants_predictions:
                    totals += sums_of_batch(model, batch, self.processing_class)
                    continue
                else:
                    outputs = model(**batch, num_items_in_batch=1, **full_logits)
                    totals += batch_sums(outputs.loss, batch["labels"], self.processing_class)
                    logits = outputs.logits
                logits = logits.float()  # as accelerate hands them over (bf16 has no numpy type)
                if self.preprocess_logits_for_metrics is not None:
                    logits = self.preprocess_logits_for_metrics(logits, batch["labels"])
                predictions.append(logits.cpu())
                label_ids.append(batch["labels"].cpu())
        if self.parallel_state.dp_group is not None and pipeline is None:
            dist.all_reduce(totals, group=self.parallel_state.dp_group)
        metrics = metrics_from_sums(totals.cpu(), metric_key_prefix)
        if wants_predictions:
            metrics.update(self.user_metrics(predictions, label_ids, metric_key_prefix))
        return EvalLoopOutput(predictions=None, label_ids=None, metrics=metrics, num_samples=len(dataloader.dataset.dataset))

    def user_metrics(self, predictions: list, label_ids: list, prefix: str) -> dict:
        """``compute_metrics(EvalPrediction)`` on the predictions and labels of every DP rank (in DP-rank order,
        gathered as objects over the DP group); keys get ``prefix``. The fully masked rows that pad the DP shards
        to equal length (:class:`~boost_hf.training.data.EvalShard`) are dropped. Under pipeline parallelism the
        last stage's ranks compute it (they alone hold predictions) and broadcast the metrics over the PP group."""
        pipeline = pipeline_of(self.model)
        computed = None
        if pipeline is None or pipeline.holds_last_stage:
            labels = torch.cat(label_ids)
            real = (labels != -100).flatten(1).any(-1)
            local = (torch.cat(predictions)[real].numpy(), labels[real].numpy())
            if self.parallel_state.dp_group is not None:
                shards = [None] * self.parallel_state.dp_size
                dist.all_gather_object(shards, local, group=self.parallel_state.dp_group)
                local = tuple(np.concatenate([shard[i] for shard in shards]) for i in range(2))
            computed = self.compute_metrics(EvalPrediction(predictions=local[0], label_ids=local[1]))
        if pipeline is not None:
            computed = from_last_stage(pipeline, computed)
        return {key if key.startswith(f"{prefix}_") else f"{prefix}_{key}": value for key, value in computed.items()}

    # ------------------------------------------------------------------ steps, gradients, metrics
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The Trainer's loss, times NaN if it is not finite: its gradients then carry it to every rank's grad norm."""
        result = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        if return_outputs:
            return poison_nonfinite_loss(result[0]), result[1]
        return poison_nonfinite_loss(result)

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.metrics.count_micro_batch(inputs["input_ids"])
        if self.hang_watchdog is not None:
            self.hang_watchdog.step = self.state.global_step + 1
        self.trained_context = inputs["input_ids"].shape[-1]
        bos = getattr(self.processing_class, "bos_token_id", None)
        if bos is not None:
            self._bos_seen = (inputs["input_ids"] == bos).any() | self._bos_seen
        pipeline = pipeline_of(self.model)
        if self.master_parameters is not None:  # backward passes reaching each parameter before the optimizer step
            self.master_parameters.accumulations_per_step = (
                pipeline.parallel.microbatches if pipeline is not None else self.current_gradient_accumulation_steps
            )
        with self.metrics.comm:
            if pipeline is None:
                loss = super().training_step(model, inputs, num_items_in_batch)
            else:
                model.train()  # each stage's forward applies the precision policy (Pipeline.set_precision)
                loss = poison_nonfinite_loss(pipeline_training_step(pipeline, self._prepare_inputs(inputs)))
                self.metrics.count_p2p_bytes(boundary_bytes_per_step(pipeline, tuple(inputs["input_ids"].shape)))
        self._nonfinite_loss_logged = ~torch.isfinite(loss) | self._nonfinite_loss_logged  # no sync
        return loss

    def _gradients_ready(self) -> None:
        """bf16_params: finish the DP reduction and present the fp32 masters and gradients to clipping and the
        optimizer (until the step ends, :class:`~boost_hf.training.precision.CastAfterOptimizerStep`)."""
        if self.master_parameters is not None:
            self.master_parameters.gradients_ready()

    def _clip_grad_norm(self, model):
        if self.is_deepspeed_enabled:
            return super()._clip_grad_norm(model)
        self._gradients_ready()
        self.accelerator.unscale_gradients()
        state = self.parallel_state
        return clip_grad_norm_(model.parameters(), self.args.max_grad_norm, state.tp_group, state.pp_group)

    def _get_grad_norm(self, model, grad_norm=None):
        """The global grad norm, checked on every step (the same value on every rank, see
        :mod:`boost_hf.training.health`): ``--nonfinite stop`` raises, ``skip_step`` drops the gradients."""
        self._gradients_ready()
        if grad_norm is None and not self.is_deepspeed_enabled:
            grad_norm = global_grad_norm(model.parameters(), self.parallel_state.tp_group, self.parallel_state.pp_group)
        grad_norm = super()._get_grad_norm(model, grad_norm)
        if not is_finite(grad_norm):
            if getattr(self.args, "nonfinite", "stop") == "stop":
                checkpoints = completed_checkpoints(self.args.output_dir)
                raise nonfinite_error(self.state.global_step + 1, grad_norm, checkpoints[-1] if checkpoints else None)
            self.optimizer.zero_grad(set_to_none=True)  # torch optimizers skip parameters without a gradient
            self.nonfinite_skipped_steps += 1
            self.nonfinite_consecutive_skips += 1
            limit = getattr(self.args, "nonfinite_max_consecutive_skips", 0)
            if limit and self.nonfinite_consecutive_skips >= limit:
                checkpoints = completed_checkpoints(self.args.output_dir)
                raise nonfinite_error(self.state.global_step + 1, grad_norm, checkpoints[-1] if checkpoints else None,
                                      consecutive_skips=self.nonfinite_consecutive_skips)
        else:
            self.nonfinite_consecutive_skips = 0
        return grad_norm

    def _track_num_input_tokens(self, inputs) -> None:
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)  # gathered over all processes: TP and PP peers counted tp x pp times
        state = self.parallel_state
        self.state.num_input_tokens_seen = before + (self.state.num_input_tokens_seen - before) // (state.tp_size * state.pp_size)

    def floating_point_ops(self, inputs) -> int:
        """Analytic training FLOPs of this rank's share of the micro-batch (its TP group and pipeline stages split the
        work)."""
        input_ids = inputs["input_ids"]
        per_token = training_flops_per_token(self.model.config, input_ids.shape[-1])
        return input_ids.numel() * per_token // (self.parallel_state.tp_size * self.parallel_state.pp_size)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:
            logs.update(self.metrics.pop_logs())
            logs["nonfinite_skipped_steps"] = self.nonfinite_skipped_steps
            if bool(self._nonfinite_loss_logged):  # the Trainer averages non-finite losses away (logging_nan_inf_filter)
                logs["loss"] = float("nan")
            self._nonfinite_loss_logged = False
        super().log(logs, start_time)

    # ------------------------------------------------------------------ saving and resuming
    @contextlib.contextmanager
    def publishing(self):
        """During the block the model's config is as published: ``use_cache`` on, the tokenizer's special tokens
        (:mod:`boost_hf.training.publish`)."""
        tokenizer = self.processing_class if hasattr(self.processing_class, "save_pretrained") else None
        tokens = publish_special_tokens(self.model, tokenizer, self.trained_with_bos) if tokenizer is not None else contextlib.nullcontext()
        with inference_settings(self.model), tokens:
            yield

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write the Hugging Face folder: canonical safetensors files of at most ``--save_max_shard_size``, written
        from every rank's shards (no rank holds the whole model), config, remote code, tokenizer and model card.
        Collective: call on every rank. Under ``bf16_params`` the weights written are the fp32 masters
        (:func:`~boost_hf.training.precision.full_precision_parameters`)."""
        output_dir = output_dir or self.args.output_dir
        with full_precision_parameters(self.model), full_parameters(self.model, self._zero_stage), self.publishing():
            self.model.save_pretrained(output_dir, is_main_process=self.args.should_save,
                                       max_shard_size=getattr(self.args, "save_max_shard_size", "5GB"))
        if self.args.should_save:
            self.save_publishing_files(output_dir)

    def save_publishing_files(self, output_dir: str) -> None:
        """The files of a published folder beside the weights and config: the tokenizer, the model card and the
        training arguments. One process."""
        tokenizer = self.processing_class if hasattr(self.processing_class, "save_pretrained") else None
        if tokenizer is not None:
            save_tokenizer(tokenizer, output_dir, context=self.context_length(), used_bos=self.trained_with_bos)
        self.write_model_card(output_dir)
        torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

    @property
    def trained_with_bos(self) -> bool:
        """Whether training put the tokenizer's BOS anywhere in this rank's micro-batches (the writer's view decides
        whether the published tokenizer declares a BOS)."""
        return bool(self._bos_seen)

    def context_length(self) -> int:
        """The trained context: the micro-batches' sequence length (``max_position_embeddings`` before training)."""
        return self.trained_context or self.model.config.max_position_embeddings

    def write_model_card(self, output_dir: str) -> None:
        """``<output_dir>/README.md``: the model card (:func:`~boost_hf.training.publish.model_card`) with this run's
        layout, recipe and last held-out metrics. ``card_metadata`` sets its ``license`` and ``datasets``."""
        state, args = self.parallel_state, self.args
        layout = args.to_parallel_config(self.model.config) if hasattr(args, "to_parallel_config") else None
        parallel = {"pp_size": state.pp_size, "tp_size": state.tp_size, "dp_size": state.dp_size}
        if layout is not None:
            parallel.update(tp_style=layout.tp_style, rmsnorm=layout.rmsnorm, group_linears=layout.group_linears,
                            activation_checkpointing=layout.activation_checkpointing)
        parallel["deepspeed_zero_stage"] = self._zero_stage if self.is_deepspeed_enabled else None
        global_batch = args.per_device_train_batch_size * state.dp_size * args.gradient_accumulation_steps
        recipe = {"optimizer steps": self.state.global_step, "global batch (sequences)": global_batch,
                  "sequence length": self.context_length(),
                  "training tokens": self.state.global_step * global_batch * self.context_length(),
                  "peak learning rate": args.learning_rate, "schedule": self.schedule_name(),
                  "weight decay": args.weight_decay, "gradient clipping": args.max_grad_norm, "seed": args.seed,
                  "precision": self.precision.describe()}
        evaluations = [log for log in self.state.log_history if "eval_perplexity" in log]
        card = model_card(self.model.config, seq_len=self.context_length(), parallel=parallel, recipe=recipe,
                          metrics=evaluations[-1] if evaluations else None, used_bos=self.trained_with_bos,
                          repo_hint=args.hub_model_id or os.path.join(args.output_dir, "final"), **self.card_metadata)
        with open(os.path.join(output_dir, "README.md"), "w") as f:
            f.write(card)

    def schedule_name(self) -> str:
        """The learning-rate schedule this run follows, as the model card names it."""
        args = self.args
        name = getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)
        if getattr(args, "lowrank_optimizer", "adamw") != "loro":
            return name
        if args.loro_schedule == "authors":
            return (f"the LORO authors' cosine_restart (min ratio {args.lr_scheduler_kwargs['min_lr_rate']}, restart every "
                    f"{args.loro_exact_every} steps over {args.loro_restart_warmup_steps})")
        return f"{name}, restarted after each LORO exact step (every {args.loro_exact_every} steps, over {args.loro_restart_warmup_steps})"

    def create_model_card(self, *args, **kwargs) -> None:
        """Transformers' ``push_to_hub`` path writes the card here: boost-hf's card, into ``output_dir``."""
        if self.is_world_process_zero():
            os.makedirs(self.args.output_dir, exist_ok=True)
            self.write_model_card(self.args.output_dir)

    def save_final_model(self, output_dir: str | None = None) -> str:
        """Save the model (canonical) + tokenizer + manifest atomically to ``<output_dir>/final``; return that path.
        Waits for an asynchronous checkpoint in flight first."""
        self.claim_output_dir()
        self.checkpoint_saver.wait()
        target = output_dir or os.path.join(self.args.output_dir, "final")
        with in_phase("saving the final model"), atomic_directory(target, is_writer=self.args.should_save, run_id=self.run_id,
                                                                  config=self.model.config) as staging:
            self.save_model(staging)
        return target

    def _save_checkpoint(self, model, trial) -> None:
        """The Trainer's checkpoint, every rank writing its own shards: the model's parameters and the optimizer's
        state as a ``torch.distributed.checkpoint`` in ``dcp/`` (:func:`~boost_hf.parallel.sharded_state.model_state`,
        :func:`~boost_hf.training.optimizer_state.optimizer_state`; under DeepSpeed the model only, its optimizer in its
        own folder), beside the Trainer's other files (``Trainer._save_checkpoint``'s: scheduler, RNG, trainer state,
        best-model record, hub push) and the Hugging Face folder without weights. Written by
        :class:`~boost_hf.training.checkpoint.CheckpointSaver`: a staging folder, the manifest, the rename; only then
        are old checkpoints rotated out (``--save_total_limit``). ``--save_async``: the shards are copied to host
        memory and written in the background; the next save (and the final model) waits for this one."""
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        self.claim_output_dir()
        run_dir = self._get_output_dir(trial=trial)
        target = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        self.checkpoint_saver.wait()  # the previous save is complete under its name (best-model record, rotation)

        def write_files(staging: str) -> None:
            if self.args.should_save:
                with self.publishing():
                    save_model_files(self.model, staging)
                self.save_publishing_files(staging)
            if self.args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST) and self.state.best_global_step:
                best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}")
                if best == target or os.path.exists(best):
                    self.state.best_model_checkpoint = best
            if not self.args.save_only_model:
                self._save_optimizer_and_scheduler(staging)
                self._save_scaler(staging)
                self._save_rng_state(staging)
                save_data_position(staging, self.train_dataset, self.train_loader, self.args)
            if self.args.should_save:
                for callback in self.callback_handler.callbacks + [self.control]:
                    if isinstance(callback, ExportableState):
                        name, exported = type(callback).__name__, callback.state()
                        if isinstance(self.state.stateful_callbacks[name], list):
                            self.state.stateful_callbacks[name].append(exported)
                        else:
                            self.state.stateful_callbacks[name] = exported
                self.state.save_to_json(os.path.join(staging, TRAINER_STATE_NAME))

        def rotate() -> None:
            rotate_checkpoints(output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)

        with full_precision_parameters(self.model), full_parameters(self.model, self._zero_stage):  # bf16_params: the masters
            shards = {"model": model_state(self.model)}
            if not self.args.save_only_model and not self.is_deepspeed_enabled:
                shards["optimizer"] = optimizer_state(self.model, self.optimizer)
            self.checkpoint_saver.save(target, write_files=write_files, state_dict=shards, config=self.model.config,
                                       asynchronous=getattr(self.args, "save_async", False),
                                       after_commit=rotate if self.args.should_save else None)
        if self.args.push_to_hub:
            self.checkpoint_saver.wait()
            self._push_from_checkpoint(target)

    # ------------------------------------------------------------------ the run's output folder
    def claim_output_dir(self) -> None:
        """Collective, once per run: lock ``output_dir`` on the writing rank and share the run id (which names the
        staging folders) with every rank; every rank raises the writer's error if the folder is in use."""
        if self.run_id is not None:
            return
        claim = [None, None]  # [run id, error]
        if self.args.should_save:
            claim[0] = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
            self._output_dir_lock = OutputDirLock(self.args.output_dir)
            try:
                self._output_dir_lock.acquire(claim[0])
                remove_stale_staging(self.args.output_dir, claim[0])
            except OutputDirInUseError as error:
                claim[1] = str(error)
        if dist.is_available() and dist.is_initialized():
            dist.broadcast_object_list(claim, src=0)
        if claim[1] is not None:
            raise OutputDirInUseError(claim[1])
        self.run_id = claim[0]
        self.checkpoint_saver = CheckpointSaver(is_writer=self.args.should_save, run_id=self.run_id)

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs):
        """``Trainer.train``; ``resume_from_checkpoint=True`` takes the last *complete* checkpoint. A new run
        refuses an ``output_dir`` holding an earlier run unless ``overwrite_output_dir``; the folder is locked."""
        run_dir = self.args.output_dir
        if resume_from_checkpoint is True:
            resume_from_checkpoint = newest_complete_checkpoint(run_dir)
        elif isinstance(resume_from_checkpoint, str) and not os.path.isdir(resume_from_checkpoint):
            raise FileNotFoundError(f"resume_from_checkpoint: no such file or folder: {resume_from_checkpoint!r}")
        elif not resume_from_checkpoint:
            check_fresh_output_dir(run_dir, getattr(self.args, "overwrite_output_dir", False))
        if resume_from_checkpoint and not os.path.isfile(os.path.join(resume_from_checkpoint, TRAINER_STATE_NAME)):
            raise FileNotFoundError(
                f"resume_from_checkpoint: {resume_from_checkpoint!r} has no {TRAINER_STATE_NAME}, so it is a saved model (e.g. "
                f"final/), not a training checkpoint: it holds no optimizer, schedule or data position to continue. Start a "
                f"new run from its weights with --init_from {resume_from_checkpoint}, or resume from a checkpoint-<step> folder."
            )
        if resume_from_checkpoint:  # verified here for every resume: transformers skips _load_from_checkpoint under DeepSpeed
            verify_checkpoint_once(resume_from_checkpoint, self.model.config)
            check_resume_layout(resume_from_checkpoint, self.training_layout())
        self.claim_output_dir()
        self.start_hang_watchdog()
        enter_phase(TRAINING)
        if not resume_from_checkpoint and self.args.should_save and os.path.isdir(run_dir):
            remove_earlier_run(run_dir)  # only reached with overwrite_output_dir (or nothing to remove)
        self.data_resume_from = resume_from_checkpoint or None
        if self.args.ignore_data_skip:
            self.data_resume_from = None  # the user's choice: this training set from its first batch
        with (self.stop_requests.handling(), naming_collective_timeouts(lambda: self.state.global_step + 1),
              self.data_continues_itself()):
            output = super().train(resume_from_checkpoint=resume_from_checkpoint or None, **kwargs)
            self.checkpoint_saver.wait()  # the last asynchronous checkpoint is complete when train() returns
        if self.stop_at_step_end.stopped is not None:
            reason, step = self.stop_at_step_end.stopped
            self._stop(reason, os.path.join(self._get_output_dir(None), f"{PREFIX_CHECKPOINT_DIR}-{step}"))
        return output

    def _a_peer_exited(self) -> bool:
        return self.hang_watchdog is not None and self.hang_watchdog.a_peer_exited()

    def stop_if_requested(self) -> None:
        """Collective: after training (before the final evaluation, sample and save), a signal of ``--exit_signals`` or
        the spent ``--exit_after_minutes`` budget saves a checkpoint at the current step (unless there is one) and
        raises :class:`~boost_hf.training.preemption.TrainingStopped` on every rank. During training the same is
        decided at every step's end (:class:`~boost_hf.training.preemption.StopAtStepEnd`)."""
        reason = self.stop_requests.agreed_reason(self.args.device)
        if reason is None:
            return
        checkpoint = os.path.join(self._get_output_dir(None), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if checkpoint not in completed_checkpoints(self._get_output_dir(None)):
            self._save_checkpoint(self.model_wrapped, None)
        self._stop(reason, checkpoint)

    def _stop(self, reason: str, checkpoint: str):
        self.checkpoint_saver.wait()  # the checkpoint named below is complete before any rank exits
        stopped = TrainingStopped(reason, self.state.global_step, checkpoint)
        if self.is_world_process_zero():
            print(stopped, file=sys.stderr, flush=True)
        raise stopped

    @contextlib.contextmanager
    def data_continues_itself(self):
        """A stream continues from its saved position (:func:`~boost_hf.training.data.restore_data_position`), so
        the Trainer must not skip batches on resume (``skip_first_batches`` would read and discard them):
        ``args.ignore_data_skip`` is set while training a stream, restored afterwards."""
        stream = isinstance(self.train_dataset, (BlockStream, datasets.IterableDataset))
        saved = self.args.ignore_data_skip
        self.args.ignore_data_skip = saved or stream
        try:
            yield
        finally:
            self.args.ignore_data_skip = saved

    def evaluate(self, *args, **kwargs):
        """``Trainer.evaluate``; a collective that times out is named (:func:`~boost_hf.training.watchdog.naming_collective_timeouts`)."""
        with in_phase("evaluation"), naming_collective_timeouts(lambda: self.state.global_step):
            return super().evaluate(*args, **kwargs)

    def training_layout(self, optimizer_records: list[dict] | None = None) -> dict:
        """This run's PP x TP x DP sizes, ZeRO stage, global batch, precision policy (its record: what computes,
        stores, accumulates and reduces in which dtype) and, given, the optimizer record of each pipeline rank
        (:func:`optimizer_records`; :mod:`boost_hf.training.resume`)."""
        state = self.parallel_state
        layout = training_layout(tp_size=state.tp_size, dp_size=state.dp_size, pp_size=state.pp_size, zero_stage=self._zero_stage,
                                 args=self.args, optimizer_records=optimizer_records)
        return {**layout, "precision": self.precision.record()}

    def optimizer_records(self) -> list[dict] | None:
        """:func:`~boost_hf.training.resume.optimizer_record` of every pipeline rank, in pipeline order (``None`` under
        DeepSpeed). Collective under pipeline parallelism: one ``all_gather_object`` over the PP group."""
        if self.is_deepspeed_enabled:
            return None
        own = optimizer_record(self.model, self.optimizer)
        if self.parallel_state.pp_group is None:
            return [own]
        records = [None] * self.parallel_state.pp_size
        dist.all_gather_object(records, own, group=self.parallel_state.pp_group)
        return records

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The scheduler and ``training_layout.json`` with each pipeline rank's optimizer record (which lets a run at
        another PP x TP x DP layout check and reshard the optimizer state, saved by every rank with the model's shards);
        under DeepSpeed its own checkpoint folder (ZeRO partitions per DP and TP rank). Collective."""
        records = self.optimizer_records()
        if self.is_deepspeed_enabled:
            super()._save_optimizer_and_scheduler(output_dir)
        if self.args.should_save:
            if not self.is_deepspeed_enabled:
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
            write_training_layout(output_dir, self.training_layout(records))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """The optimizer state of this rank (resharded if the checkpoint has another PP x TP x DP layout) and the
        scheduler; a missing one is an error naming it (``--init_from`` starts from the weights only)."""
        if checkpoint is None:
            return
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if self.is_deepspeed_enabled:
            if not os.path.isfile(scheduler) and type(self.lr_scheduler).__name__ != "DeepSpeedSchedulerWrapper":
                raise missing_file_error(scheduler, checkpoint, "learning-rate scheduler state")
            return super()._load_optimizer_and_scheduler(checkpoint)
        state = self.parallel_state
        pipeline = pipeline_of(self.model)
        elsewhere = pipeline.placement.absent if pipeline is not None else frozenset()
        with full_precision_parameters(self.model, loading=True):  # the state in the masters' dtype (bf16_params)
            if is_distributed_checkpoint(checkpoint):
                load_optimizer_state(self.optimizer, self.model, checkpoint, elsewhere)
            else:
                device = "cpu" if self.args.device.type == "cpu" else self.args.device  # torch cannot restore to "cpu:0"
                load_optimizer_files(self.optimizer, self.model, checkpoint, state.tp_rank, state.tp_size, device,
                                     state.pp_rank, state.pp_size, held_elsewhere=elsewhere)
        if not os.path.isfile(scheduler):
            raise missing_file_error(scheduler, checkpoint, "learning-rate scheduler state")
        self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    def start_hang_watchdog(self) -> None:
        """This rank's :class:`~boost_hf.training.watchdog.HangWatchdog` (launched runs, ``hang_timeout_s > 0``): the
        one started with the launch (:func:`~boost_hf.training.watchdog.watch_launch`), else one on the process group's
        store."""
        timeout = getattr(self.args, "hang_timeout_s", 0)
        if self.hang_watchdog is not None or not timeout or not (dist.is_available() and dist.is_initialized()):
            return
        if running_watchdog() is not None:
            self.hang_watchdog = running_watchdog()
            return
        if dist.get_world_size() == 1:
            return
        from torch.distributed.distributed_c10d import _get_default_store

        self.hang_watchdog = HangWatchdog(_get_default_store(), dist.get_rank(), dist.get_world_size(), timeout)
        self.hang_watchdog.start()

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """This rank's shards of the checkpoint's weights, saved at any layout (its ``dcp/``, resharded by DCP; a
        checkpoint of boost-hf 0.x: its canonical ``model.safetensors``); :meth:`train` verified the folder against
        its manifest and architecture record first."""
        model = self.accelerator.unwrap_model(model if model is not None else self.model)
        with full_precision_parameters(model, loading=True):  # bf16_params: into the fp32 masters
            if is_distributed_checkpoint(resume_from_checkpoint):
                load_model_state(model, os.path.join(resume_from_checkpoint, DCP_FOLDER))
            else:
                load_canonical_checkpoint(model, resolve_checkpoint_files(resume_from_checkpoint))

    # ------------------------------------------------------------------ generation
    def generate_sample(self, prompt: str | None = None, max_new_tokens: int | None = None) -> str:
        """Greedy continuation of ``prompt`` (default ``args.sample_prompt``), in the run's precision. Collective: call
        on every rank."""
        prompt = prompt if prompt is not None else getattr(self.args, "sample_prompt", "The")
        max_new_tokens = max_new_tokens if max_new_tokens is not None else getattr(self.args, "sample_max_new_tokens", 40)
        tokenizer = self.processing_class
        input_ids = tokenizer(prompt, return_tensors="pt").input_ids.to(self.args.device)

        def sample(model) -> str:
            model.eval()
            with torch.no_grad():
                output = model.generate(
                    input_ids,
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    use_cache=True,
                    pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=tokenizer.eos_token_id,
                )
            return tokenizer.decode(output[0], skip_special_tokens=True)

        with in_phase("generation"), self.autocast_smart_context_manager():
            pipeline = pipeline_of(self.model)
            if pipeline is not None:  # through the stages (each applies the precision policy): no rank holds more than its own
                self.model.eval()
                output = pipeline_greedy_generate(pipeline, input_ids, max_new_tokens, tokenizer.eos_token_id)
                return tokenizer.decode(output[0], skip_special_tokens=True)
            return sample(self.model)


__all__ = ["BoostTrainer"]

"""``BoostTrainer``: ``transformers.Trainer`` for tensor-parallel x data-parallel pre-training.

The model arrives already sharded (``BoostLlamaForCausalLM(config, parallel_config)`` inside the launched
process group); the trainer adds the data-parallel half and keeps every Trainer feature (logging,
evaluation, checkpoints, callbacks, ``report_to``). What it changes, and why:

=====================================  ======================================================================
Trainer hook                           boost-hf behaviour
=====================================  ======================================================================
``get_train_dataloader``               shard by DP rank: TP peers get the same micro-batch
                                       (:mod:`boost_hf.training.data`)
``get_eval_dataloader`` /              DP-sharded validation, exact token-weighted loss all-reduced over DP;
``evaluation_loop``                    ``eval_perplexity = exp(eval_loss)``, ``eval_bits_per_byte`` (with a
                                       tokenizer), through the local ``evaluate`` metric (:mod:`boost_hf.evaluation`);
                                       (pp > 1) forward only through the pipeline, ``compute_metrics`` on the
                                       last stage's logits, its metrics broadcast to every stage
``create_accelerator_and_postprocess``  ``--torch_compile``: each decoder layer compiled in place
                                       (:mod:`boost_hf.training.compile`), not the whole model
``create_optimizer`` /                 ``--lowrank_optimizer loro``: LORO on the factors of an svd model, AdamW on the rest,
``create_scheduler``                   the schedule restarting after each exact step (:mod:`boost_hf.optim.loro`);
                                       ``--zero1_optimizer``: the optimizer sharded over DP (:mod:`boost_hf.training.zero1`)
``get_tp_size``                        our TP size: global batch and loss scaling count DP ranks only
``_wrap_model``                        (tp > 1, no DeepSpeed) DDP over the DP group, never across TP ranks;
                                       (pp > 1) no DDP here: the pipeline wraps each stage (:mod:`.pipeline_steps`)
``_prepare_for_training``              (DeepSpeed) ``deepspeed.initialize`` gets our groups as ``mpu``: ZeRO
                                       shards over DP only; grouped projections stay stored together in its
                                       bf16 cast and flat buffers (:mod:`boost_hf.training.deepspeed`)
``_clip_grad_norm`` / ``_get_grad_norm``  (no DeepSpeed) the true global norm: TP shards summed over the TP
                                       group, replicated parameters once (DeepSpeed does the same via ``mpu``)
``training_step`` / ``log``            tokens/s, MFU, communication per step (:mod:`boost_hf.training.metrics`),
                                       skipped non-finite steps; (pp > 1) the step runs the pipeline schedule,
                                       its point-to-point bytes logged
``compute_loss`` / ``_get_grad_norm``  non-finite loss or grad norm: stop or skip the step
                                       (:mod:`boost_hf.training.health`)
``save_model`` / ``_save_checkpoint``  canonical checkpoint from every rank's shard, publishable (remote code,
                                       ``use_cache``, tokenizer context and BOS, ``README.md`` model card:
                                       :mod:`boost_hf.training.publish`); the Trainer's checkpoint files written
                                       to a staging folder, manifest, rename, then rotation
``_save_optimizer_and_scheduler``      inside a guard that writes the manifest and removes a failed save;
                                       optimizer state per (PP, TP) rank and ``training_layout.json``
                                       (:mod:`boost_hf.training.checkpoint`, :mod:`boost_hf.training.resume`)
``train``                              resume from the last *complete* checkpoint, refused at a layout it cannot
                                       resume exactly (another global batch; DeepSpeed at another tp x dp);
                                       refuse an earlier run's ``output_dir`` unless ``overwrite_output_dir``;
                                       lock ``output_dir``; start the hang watchdog; a collective that
                                       times out (``--ddp_timeout``) is named, also in ``evaluate``
                                       (:mod:`boost_hf.training.watchdog`)
``_load_from_checkpoint`` /            resume (``train`` verified manifest and architecture once, on rank 0,
                                       also under DeepSpeed), then this rank's slice of
``_load_optimizer_and_scheduler``      the canonical weights and of the optimizer state (resharded when saved
                                       at another PP x TP layout); a missing optimizer or scheduler file raises
=====================================  ======================================================================

Launch with ``accelerate launch`` (``world = dp x tp_size`` processes; TP ranks are adjacent, see
:mod:`boost_hf.parallel.state`).
"""

from __future__ import annotations

import contextlib
import os
import uuid

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from accelerate.utils import DynamoBackend
from transformers import Trainer, default_data_collator
from transformers.trainer import SCHEDULER_NAME, TRAINER_STATE_NAME
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, EvalLoopOutput, EvalPrediction, SaveStrategy, rotate_checkpoints

from ..parallel.weights_io import load_canonical_checkpoint, resolve_checkpoint_files
from ..perf.flops import training_flops_per_token
from ..optim.loro import check_loro_training, loro_optimizer, restart_schedule_at_exact_steps
from .arguments import default_peak_tflops
from .checkpoint import (
    OutputDirInUseError,
    OutputDirLock,
    atomic_directory,
    check_fresh_output_dir,
    completed_checkpoints,
    full_parameters,
    optimizer_file_name,
    remove_earlier_run,
    remove_stale_staging,
    verify_checkpoint_once,
)
from .compile import compile_decoder_layers
from .data import EvalShard, shard_by_data_parallel_rank, streaming_loader
from ..parallel.state import ParallelState
from ..evaluation import batch_sums, metrics_from_sums, sums_of_batch
from .deepspeed import ModelParallelUnit, configure_deepspeed, deepspeed_initialize_hooks, skip_shm_comm_if_requested
from .grad_norm import clip_grad_norm_, global_grad_norm
from .health import is_finite, nonfinite_error, poison_nonfinite_loss
from .metrics import TrainingMetrics
from .pipeline_steps import (
    PipelineReplica,
    boundary_bytes_per_step,
    from_last_stage,
    last_stage_logits,
    on_one_process,
    pipeline_evaluation_sums,
    pipeline_of,
    pipeline_training_step,
)
from .preflight import TokenIdCheckingCollator, check_dataset
from .resume import (
    check_resume_layout,
    load_optimizer_state,
    missing_file_error,
    optimizer_record,
    training_layout,
    write_training_layout,
)
from .watchdog import HangWatchdog, exit_with_launcher, naming_collective_timeouts
from .zero1 import sharded_over_data_parallel, zero1_class_and_kwargs
from .publish import inference_settings, model_card, publish_special_tokens, save_tokenizer


class BoostTrainer(Trainer):
    """A ``transformers.Trainer`` for :class:`~boost_hf.BoostLlamaForCausalLM` under TP x DP.

    Takes the Trainer's arguments; ``args`` is usually a
    :class:`~boost_hf.training.arguments.BoostTrainingArguments` whose ``tp_size`` must match the model's.
    Without ``data_collator``, batches are stacked as they are (``default_data_collator``: packed blocks); every
    batch's token ids are checked against the model's vocabulary. Before anything else, every rank checks the
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
        kwargs["data_collator"] = TokenIdCheckingCollator(kwargs.get("data_collator") or default_data_collator, vocab_size)
        if args is not None:
            global_batch = args.per_device_train_batch_size * self.parallel_state.dp_size * args.gradient_accumulation_steps
            check_dataset(kwargs.get("train_dataset"), vocab_size, "training", global_batch)
            eval_sets = kwargs.get("eval_dataset")
            for name, dataset in (eval_sets.items() if isinstance(eval_sets, dict) else [("validation", eval_sets)]):
                if dataset is not None:
                    check_dataset(dataset, vocab_size, name, 1)
        self.run_id: str | None = None
        self.hang_watchdog: HangWatchdog | None = None
        self.trained_context: int | None = None  # sequence length of the training micro-batches (model card, tokenizer)
        self._bos_seen: torch.Tensor | bool = False  # whether a training micro-batch held the tokenizer's BOS id (no sync)
        self.card_metadata = {"license": "apache-2.0", "datasets": []}  # Hub metadata of the model card
        self.nonfinite_skipped_steps = 0
        self.nonfinite_consecutive_skips = 0
        self._nonfinite_loss_logged: torch.Tensor | bool = False  # a non-finite micro-batch loss since the last log
        super().__init__(model=model, args=args, **kwargs)
        state = self.parallel_state
        self.metrics = TrainingMetrics(
            model.config,
            world_size=state.tp_size * state.dp_size * state.pp_size,
            dp_size=state.dp_size,
            peak_tflops=getattr(self.args, "peak_tflops", None) or default_peak_tflops(),
            dp_grad_bytes=0 if state.dp_size == 1 else sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad),
        )
        self.add_callback(self.metrics)

    # ------------------------------------------------------------------ set-up
    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        if self.args.deepspeed_plugin is not None and not self.is_deepspeed_enabled:
            raise ValueError(
                "DeepSpeed was requested but accelerate runs without it: ACCELERATE_USE_CPU is set (use_cpu: true in "
                "the accelerate config). Remove it; boost-hf selects the CPU itself when there is no GPU."
            )
        if self.is_deepspeed_enabled and getattr(self.args, "nonfinite", "stop") == "skip_step":
            raise ValueError(
                "--nonfinite skip_step is not supported with DeepSpeed (its engine applies the update inside backward): "
                "use --nonfinite stop."
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

    def create_optimizer(self, model=None):
        if self.optimizer is None and getattr(self.args, "lowrank_optimizer", "adamw") == "loro":
            model = self.model if model is None else model
            args = self.args
            self.optimizer = loro_optimizer(
                model, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
                weight_decay=args.weight_decay, exact_every=args.loro_exact_every, lr_scale=args.loro_lr_scale,
                decay_parameter_names=self.get_decay_parameter_names(model),
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
        created = self.lr_scheduler is None
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        if created and getattr(self.args, "lowrank_optimizer", "adamw") == "loro":
            restart_schedule_at_exact_steps(scheduler, self.args.loro_exact_every, self.args.loro_restart_warmup_steps)
        return scheduler

    def get_tp_size(self) -> int:
        return self.parallel_state.tp_size

    @property
    def _zero_stage(self) -> int | None:
        return self.accelerator.state.deepspeed_plugin.zero_stage if self.is_deepspeed_enabled else None

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        if pipeline_of(self.model) is not None:
            return model if isinstance(model, PipelineReplica) else PipelineReplica(model)
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
            hooks = deepspeed_initialize_hooks(mpu)
        with hooks:
            return super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)

    # ------------------------------------------------------------------ data
    def get_train_dataloader(self) -> DataLoader:
        state = self.parallel_state
        if state.tp_size * state.pp_size > 1 and isinstance(self.train_dataset, torch.utils.data.IterableDataset):
            return streaming_loader(
                self.train_dataset, state, batch_size=self._train_batch_size, collate_fn=self.data_collator,
                num_workers=self.args.dataloader_num_workers, pin_memory=self.args.dataloader_pin_memory,
            )
        return shard_by_data_parallel_rank(super().get_train_dataloader(), state)

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
        with torch.no_grad(), collecting as last_stage_outputs:
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
        with self.metrics.comm:
            pipeline = pipeline_of(self.model)
            if pipeline is None:
                loss = super().training_step(model, inputs, num_items_in_batch)
            else:
                model.train()
                with self.compute_loss_context_manager():
                    loss = poison_nonfinite_loss(pipeline_training_step(pipeline, self._prepare_inputs(inputs)))
                self.metrics.count_p2p_bytes(boundary_bytes_per_step(pipeline, tuple(inputs["input_ids"].shape)))
        self._nonfinite_loss_logged = ~torch.isfinite(loss) | self._nonfinite_loss_logged  # no sync
        return loss

    def _clip_grad_norm(self, model):
        if self.is_deepspeed_enabled:
            return super()._clip_grad_norm(model)
        self.accelerator.unscale_gradients()
        state = self.parallel_state
        return clip_grad_norm_(model.parameters(), self.args.max_grad_norm, state.tp_group, state.pp_group)

    def _get_grad_norm(self, model, grad_norm=None):
        """The global grad norm, checked on every step (the same value on every rank, see
        :mod:`boost_hf.training.health`): ``--nonfinite stop`` raises, ``skip_step`` drops the gradients."""
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
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write the canonical (unsharded) model, its config and the tokenizer. Collective: call on every rank."""
        output_dir = output_dir or self.args.output_dir
        tokenizer = self.processing_class if hasattr(self.processing_class, "save_pretrained") else None
        tokens = publish_special_tokens(self.model, tokenizer, self.trained_with_bos) if tokenizer is not None else contextlib.nullcontext()
        with full_parameters(self.model, self._zero_stage), inference_settings(self.model), tokens:
            self.model.save_pretrained(output_dir, is_main_process=self.args.should_save)
        if self.args.should_save:
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
                  "peak learning rate": args.learning_rate, "schedule": getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type),
                  "weight decay": args.weight_decay, "gradient clipping": args.max_grad_norm, "seed": args.seed}
        evaluations = [log for log in self.state.log_history if "eval_perplexity" in log]
        card = model_card(self.model.config, seq_len=self.context_length(), parallel=parallel, recipe=recipe,
                          metrics=evaluations[-1] if evaluations else None, used_bos=self.trained_with_bos,
                          repo_hint=args.hub_model_id or os.path.join(args.output_dir, "final"), **self.card_metadata)
        with open(os.path.join(output_dir, "README.md"), "w") as f:
            f.write(card)

    def create_model_card(self, *args, **kwargs) -> None:
        """Transformers' ``push_to_hub`` path writes the card here: boost-hf's card, into ``output_dir``."""
        if self.is_world_process_zero():
            os.makedirs(self.args.output_dir, exist_ok=True)
            self.write_model_card(self.args.output_dir)

    def save_final_model(self, output_dir: str | None = None) -> str:
        """Save the model (canonical) + tokenizer + manifest atomically to ``<output_dir>/final``; return that path."""
        self.claim_output_dir()
        target = output_dir or os.path.join(self.args.output_dir, "final")
        with atomic_directory(target, is_writer=self.args.should_save, run_id=self.run_id, config=self.model.config) as staging:
            self.save_model(staging)
        return target

    def _save_checkpoint(self, model, trial) -> None:
        """The Trainer's checkpoint (``Trainer._save_checkpoint``'s files, best-model record and hub push), written
        atomically: into a staging folder, then its manifest, then renamed to ``checkpoint-<step>``; only then are old
        checkpoints rotated out (``--save_total_limit``), so a complete checkpoint exists at every moment. A failed
        save leaves no partial folder (:func:`~boost_hf.training.checkpoint.atomic_directory`)."""
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        run_dir = self._get_output_dir(trial=trial)
        target = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        with atomic_directory(target, is_writer=self.args.should_save, run_id=self.run_id, config=self.model.config) as staging:
            self.save_model(staging, _internal_call=True)
            if self.args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST) and self.state.best_global_step:
                best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}")
                if best == target or os.path.exists(best):
                    self.state.best_model_checkpoint = best
            if not self.args.save_only_model:
                self._save_optimizer_and_scheduler(staging)
                self._save_scaler(staging)
                self._save_rng_state(staging)
            if self.args.should_save:
                for callback in self.callback_handler.callbacks + [self.control]:
                    if isinstance(callback, ExportableState):
                        name, exported = type(callback).__name__, callback.state()
                        if isinstance(self.state.stateful_callbacks[name], list):
                            self.state.stateful_callbacks[name].append(exported)
                        else:
                            self.state.stateful_callbacks[name] = exported
                self.state.save_to_json(os.path.join(staging, TRAINER_STATE_NAME))
        if self.args.push_to_hub:
            self._push_from_checkpoint(target)
        if self.args.should_save:
            rotate_checkpoints(output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)

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

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs):
        """``Trainer.train``; ``resume_from_checkpoint=True`` takes the last *complete* checkpoint. A new run
        refuses an ``output_dir`` holding an earlier run unless ``overwrite_output_dir``; the folder is locked."""
        run_dir = self.args.output_dir
        if resume_from_checkpoint is True:
            complete = completed_checkpoints(run_dir)
            if not complete:
                raise FileNotFoundError(f"no complete checkpoint (with a manifest.json) in output_dir {run_dir!r} to resume from.")
            resume_from_checkpoint = complete[-1]
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
        if not resume_from_checkpoint and self.args.should_save and os.path.isdir(run_dir):
            remove_earlier_run(run_dir)  # only reached with overwrite_output_dir (or nothing to remove)
        with naming_collective_timeouts(lambda: self.state.global_step + 1):
            return super().train(resume_from_checkpoint=resume_from_checkpoint or None, **kwargs)

    def evaluate(self, *args, **kwargs):
        """``Trainer.evaluate``; a collective that times out is named (:func:`~boost_hf.training.watchdog.naming_collective_timeouts`)."""
        with naming_collective_timeouts(lambda: self.state.global_step):
            return super().evaluate(*args, **kwargs)

    def training_layout(self, optimizer_records: list[dict] | None = None) -> dict:
        """This run's PP x TP x DP sizes, ZeRO stage, global batch and, given, the optimizer record of each pipeline
        rank (:func:`optimizer_records`; :mod:`boost_hf.training.resume`)."""
        state = self.parallel_state
        return training_layout(tp_size=state.tp_size, dp_size=state.dp_size, pp_size=state.pp_size, zero_stage=self._zero_stage,
                               args=self.args, optimizer_records=optimizer_records)

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
        """One optimizer file per (pipeline rank, TP rank), written by DP rank 0 (``--zero1_optimizer``: consolidated
        there first; DeepSpeed: its own folder), the scheduler and ``training_layout.json`` with the optimizer record,
        which lets a later run at another PP x TP x DP layout reshard the optimizer state. Collective."""
        state = self.parallel_state
        records = self.optimizer_records()
        if self.is_deepspeed_enabled:
            super()._save_optimizer_and_scheduler(output_dir)
        else:
            zero = sharded_over_data_parallel(self.optimizer)
            # DP replicas hold the same optimizer state; ZeRO-1 shares are gathered on DP rank 0 (collective over DP)
            whole = zero.consolidated_state_dict() if zero is not None else self.optimizer.state_dict() if state.dp_rank == 0 else None
            if state.dp_rank == 0:
                name = optimizer_file_name(state.tp_rank, state.tp_size, state.pp_rank, state.pp_size)
                torch.save(whole, os.path.join(output_dir, name))
        if self.args.should_save:
            if not self.is_deepspeed_enabled:
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
            write_training_layout(output_dir, self.training_layout(records))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """The optimizer state of this rank (resharded if the checkpoint has another PP x TP layout) and the scheduler; a
        missing file is an error naming it (``--init_from`` starts from the weights only)."""
        if checkpoint is None:
            return
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if self.is_deepspeed_enabled:
            if not os.path.isfile(scheduler) and type(self.lr_scheduler).__name__ != "DeepSpeedSchedulerWrapper":
                raise missing_file_error(scheduler, checkpoint, "learning-rate scheduler state")
            return super()._load_optimizer_and_scheduler(checkpoint)
        state = self.parallel_state
        device = "cpu" if self.args.device.type == "cpu" else self.args.device  # torch cannot restore to "cpu:0"
        pipeline = pipeline_of(self.model)
        load_optimizer_state(self.optimizer, self.model, checkpoint, state.tp_rank, state.tp_size, device, state.pp_rank, state.pp_size,
                             held_elsewhere=pipeline.placement.absent if pipeline is not None else frozenset())
        if not os.path.isfile(scheduler):
            raise missing_file_error(scheduler, checkpoint, "learning-rate scheduler state")
        self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    def start_hang_watchdog(self) -> None:
        """Start this rank's :class:`~boost_hf.training.watchdog.HangWatchdog` (launched runs, ``hang_timeout_s > 0``)."""
        timeout = getattr(self.args, "hang_timeout_s", 0)
        if self.hang_watchdog is not None or not timeout or not (dist.is_available() and dist.is_initialized()):
            return
        if dist.get_world_size() == 1:
            return
        from torch.distributed.distributed_c10d import _get_default_store

        self.hang_watchdog = HangWatchdog(_get_default_store(), dist.get_rank(), dist.get_world_size(), timeout)
        self.hang_watchdog.start()

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """This rank's slice of the checkpoint's canonical weights (any TP size wrote it); :meth:`train` verified the
        folder against its manifest and architecture record first."""
        model = self.accelerator.unwrap_model(model if model is not None else self.model)
        load_canonical_checkpoint(model, resolve_checkpoint_files(resume_from_checkpoint))

    # ------------------------------------------------------------------ generation
    def generate_sample(self, prompt: str | None = None, max_new_tokens: int | None = None) -> str:
        """Greedy continuation of ``prompt`` (default ``args.sample_prompt``). Collective: call on every rank."""
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

        if pipeline_of(self.model) is not None:
            return on_one_process(self.model, sample)
        return sample(self.model)


__all__ = ["BoostTrainer"]

"""``BoostTrainer``: ``transformers.Trainer`` for pipeline x tensor-parallel x data-parallel pre-training.

The model arrives already split (``BoostLlamaForCausalLM(config, parallel_config)`` inside the launched process
group). The trainer keeps every Trainer feature (logging, evaluation, checkpoints, callbacks, ``report_to``) and
hands what depends on how the model is split to its step engine (:mod:`boost_hf.training.engine`: the model called
as it is, or the pipeline schedule over this rank's stages), which it never asks about. What each hook adds:

* set-up: the precision policy (:mod:`.precision`, resolved once by the arguments), its autocast around every
  forward; the engine prepares each part of the model once (:func:`~boost_hf.parallel.parts.prepare_part`: compile
  per decoder layer, then data parallelism over the DP group: DDP, the fp32 masters' own reduction under
  ``bf16_params``, FSDP2 (:mod:`.data_parallel`), or DeepSpeed, whose ``deepspeed.initialize`` gets our groups as
  ``mpu``, :mod:`.deepspeed`); LORO and ZeRO-1 optimizers; ``get_tp_size``: global batch and loss count DP ranks only;
* data: TP peers get the same micro-batch, a stream is read once per DP replica and resumes from its saved position
  (:mod:`.data`); DP-sharded evaluation with exact token-weighted sums (``eval_perplexity``, ``eval_bits_per_byte``)
  and ``compute_metrics`` on the full-vocabulary logits of every DP rank;
* steps: tokens/s, MFU, communication per step (:mod:`.metrics`), the true global grad norm (TP shards summed over
  TP, stages over PP), non-finite losses and norms stopped or skipped (:mod:`.health`);
* the run (:mod:`.run`, :mod:`boost_hf.checkpoint.run_folder`): resume from the last *complete* checkpoint (refused at a layout it cannot resume
  exactly), the output folder locked, the hang watchdog, preemption by signal or time budget (:mod:`.preemption`);
* saving: checkpoints of every rank's shards (DCP, optionally asynchronous; :mod:`.checkpointing` over the
  :mod:`boost_hf.checkpoint` package) loadable at any PP x TP x DP layout; the publishable ``final/`` (:mod:`.publish`).

Launch with ``accelerate launch`` (``world = pp x dp x tp`` processes; see :mod:`boost_hf.parallel.state`).
"""

from __future__ import annotations

from .stack import check_trainer_internals, check_training_stack

check_training_stack()  # before the [train] extra's packages are imported: a missing or untested stack is named with its fix

import contextlib
import functools
import os

import datasets
import torch
from accelerate.utils import DynamoBackend
from torch.utils.data import DataLoader
from transformers import Trainer
from transformers.trainer_utils import EvalLoopOutput

from ..checkpoint.deepspeed_universal import universal_resume
from ..checkpoint.folders import atomic_directory, completed_checkpoints, full_parameters
from ..checkpoint.resume import read_training_layout
from ..data.collate import causal_lm_collator
from ..data.stream import BlockStream
from ..evaluation import metrics_from_sums
from ..optim.loro import check_loro_training, optimizer_of_arguments, restart_schedule_at_exact_steps
from ..optim.loro_schedule import schedule_of_arguments
from ..parallel.fully_shard import FullyShard
from ..parallel.parts import PartParallelism
from ..parallel.state import ParallelState
from ..perf.flops import training_flops_per_token
from .arguments import default_peak_tflops
from .checkpointing import (
    continue_complete_run, load_optimizer_and_scheduler, load_weights, restore_trained_record, run_layout, save_checkpoint,
    save_optimizer_and_scheduler,
)
from .compatibility import without_accelerate_parallelism
from .data_parallel import data_parallel_bytes, fully_shard_settings
from .data import EvalShard, StreamLoader, restore_data_position, shard_by_data_parallel_rank
from .deepspeed import (ModelParallelUnit, configure_deepspeed, deepspeed_initialize_hooks, masters_in_parameters,
                        skip_shm_comm_if_requested)
from .engine import engine_for
from .grad_norm import clip_grad_norm_, global_grad_norm
from .health import NonfiniteSteps, poison_nonfinite_loss
from .metrics import TrainingMetrics
from .arguments import BoostTrainingArguments
from .precision import DEFAULT_BUCKET_MB, CastAfterOptimizerStep, full_precision_parameters, keep_master_parameters, resolve_precision
from .preflight import TokenIdCheckingCollator, check_dataset
from .publish import publishing, save_publishing_files, write_model_card
from .run import TrainingRun
from .watchdog import exit_with_launcher, in_phase, naming_collective_timeouts
from .zero1 import zero1_class_and_kwargs


class BoostTrainer(Trainer):
    """A ``transformers.Trainer`` for :class:`~boost_hf.BoostLlamaForCausalLM` under PP x TP x DP.

    Takes the Trainer's arguments; ``args`` is usually a :class:`~boost_hf.training.arguments.BoostTrainingArguments`
    whose ``tp_size`` and ``pp_size`` must match the model's. Without ``data_collator``, batches are stacked as they
    are with ``labels`` derived from ``input_ids`` (:func:`~boost_hf.data.collate.causal_lm_collator`: packed blocks);
    every batch's token ids are checked against the model's vocabulary. Before anything else, every rank checks the
    datasets (at least one global batch of training blocks, a non-empty validation set, token ids in range).
    ``compute_metrics`` (with ``preprocess_logits_for_metrics``) gets the full-vocabulary logits of every DP rank,
    computed where the logits are and sent to every rank; the loss, perplexity and bits per byte stay the exact sums.
    """

    def __init__(self, model=None, args=None, **kwargs):
        check_trainer_internals()
        exit_with_launcher()
        self.parallel_state = state = model.plan.state if hasattr(model, "plan") else ParallelState()  # a plain model: one device
        for field in ("tp_size", "pp_size"):
            built, asked = getattr(state, field), getattr(args, field, getattr(state, field))
            if asked != built:
                raise ValueError(f"the model was built with {field}={built} but args.{field}={asked}: build it with "
                                 "args.to_parallel_config(config).")
        if getattr(args, "zero1_optimizer", False) and (kwargs.get("optimizers") or (None, None))[0] is not None:
            raise ValueError(
                "--zero1_optimizer builds the optimizer sharded over the data-parallel group, but an optimizer was passed in "
                "optimizers=(...): pass optimizer_cls_and_kwargs=(class, kwargs) instead, or drop --zero1_optimizer."
            )
        vocab_size = model.config.vocab_size
        kwargs["data_collator"] = TokenIdCheckingCollator(kwargs.get("data_collator") or causal_lm_collator, vocab_size)
        if args is not None:
            check_dataset(kwargs.get("train_dataset"), vocab_size, "training",
                          args.per_device_train_batch_size * state.dp_size * args.gradient_accumulation_steps)
            eval_sets = kwargs.get("eval_dataset")
            for name, dataset in (eval_sets.items() if isinstance(eval_sets, dict) else [("validation", eval_sets)]):
                if dataset is not None:
                    check_dataset(dataset, vocab_size, name, 1)
        self.data_resume_from: str | None = None  # the checkpoint whose data position the training data continues from
        self.train_loader: DataLoader | StreamLoader | None = None
        self.trained_context: int | None = None  # sequence length of the training micro-batches (model card, tokenizer)
        self._bos_seen: torch.Tensor | bool = False  # whether a training micro-batch held the tokenizer's BOS id (no sync)
        self.card_metadata = {"license": "apache-2.0", "datasets": []}  # Hub metadata of the model card
        self._nonfinite_loss_logged: torch.Tensor | bool = False  # a non-finite micro-batch loss since the last log
        super().__init__(model=model, args=args, **kwargs)
        # boost-hf's arguments resolved their policy once, when built; transformers' own are resolved here
        self.precision = self.args.precision if isinstance(self.args, BoostTrainingArguments) else resolve_precision(self.args)
        self.nonfinite = NonfiniteSteps(self.args)
        self.run = TrainingRun(self.args)
        self.add_callback(self.run.stop_at_step_end)
        self.master_parameters = None  # bf16_params: the fp32 masters and gradients (training/precision.py)
        if self.precision.has_masters:
            bucket = (getattr(self.args, "ddp_bucket_cap_mb", None) or DEFAULT_BUCKET_MB) << 20
            self.master_parameters = keep_master_parameters(model, self.precision, state.dp_group, state.dp_size, bucket)
            self.add_callback(CastAfterOptimizerStep(self.master_parameters))
        self.precision.apply_residual_dtype(model)
        self.engine = engine_for(model, state, self.args.device)
        self.engine.wrap(self.part_parallelism(), masters=self.master_parameters is not None,
                         deepspeed=self.is_deepspeed_enabled, boundary_dtype=self.precision.boundary_dtype)
        dp_grad_bytes, dp_param_bytes = data_parallel_bytes(model, self.engine.parts_as_run(), state, self.precision,
                                                            self.fully_shard(), self.args.gradient_accumulation_steps)
        self.metrics = TrainingMetrics(
            model.config, world_size=state.tp_size * state.dp_size * state.pp_size, dp_size=state.dp_size,
            peak_tflops=getattr(self.args, "peak_tflops", None) or default_peak_tflops(),
            dp_grad_bytes=dp_grad_bytes, dp_param_bytes=dp_param_bytes, tp_group=state.tp_group,
        )
        self.add_callback(self.metrics)

    # ------------------------------------------------------------------ set-up
    def create_accelerator_and_postprocess(self) -> None:
        with without_accelerate_parallelism():  # honoured by the arguments, not to be applied again
            super().create_accelerator_and_postprocess()
        if self.accelerator.ddp_handler is not None:
            # accelerate's DDP (an unsplit model over the whole world) as boost-hf's own (part_parallelism): transformers
            # looks for unused parameters unless its own checkpointing is on, and with boost-hf's (re-entrant) one DDP
            # then marks a parameter ready twice and the first backward fails; every parameter is used in every step
            self.accelerator.ddp_handler.find_unused_parameters = bool(self.args.ddp_find_unused_parameters)
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
        if self.args.torch_compile:  # per decoder layer, by the engine: accelerate must not compile the whole model again
            self.accelerator.state.dynamo_plugin.backend = DynamoBackend.NO
        if self.accelerator.mixed_precision == "bf16" and not self.is_deepspeed_enabled:
            # the precision policy's autocast is applied here (autocast_smart_context_manager) and around each pipeline
            # stage; accelerate would wrap the forward of the models it prepares only, and bf16_params runs none
            self.accelerator.native_amp = False

    def part_parallelism(self) -> PartParallelism:
        """What the engine applies to each part of the model after TP and activation checkpointing: compile, the
        policy's autocast (around the stages the pipeline schedule calls), DDP's settings over the DP group, or FSDP2's
        (:meth:`fully_shard`)."""
        args = self.args
        ddp = self.accelerator.ddp_handler.to_kwargs() if self.accelerator.ddp_handler is not None else {}
        ddp.update(find_unused_parameters=bool(args.ddp_find_unused_parameters),
                   device_ids=[args.device.index] if args.device.type == "cuda" else None)
        return PartParallelism(
            compile=dict(backend=args.torch_compile_backend, mode=args.torch_compile_mode) if args.torch_compile else None,
            context=functools.partial(self.precision.autocast, args.device.type), dp_group=self.parallel_state.dp_group,
            ddp_kwargs=ddp, place=functools.partial(self.accelerator.prepare_model, evaluation_mode=True),
            fully_shard=self.fully_shard(),
        )

    def fully_shard(self) -> FullyShard | None:
        """FSDP2's settings (:func:`~boost_hf.training.data_parallel.fully_shard_settings`), or ``None``."""
        return fully_shard_settings(self.args, self.parallel_state, self.precision)

    def autocast_smart_context_manager(self, cache_enabled: bool | None = True) -> contextlib.AbstractContextManager:
        """The precision policy's autocast (``torch.autocast`` to the compute dtype, or nothing) for a forward."""
        return self.precision.autocast(self.args.device.type)

    def create_optimizer(self, model=None):
        args = self.args
        if self.optimizer is None and getattr(args, "lowrank_optimizer", "adamw") == "loro":
            model = self.model if model is None else model
            self.optimizer = optimizer_of_arguments(model, args, self.get_decay_parameter_names(model))
        if self.optimizer is None and getattr(args, "zero1_optimizer", False) and self.parallel_state.dp_size > 1:
            chosen = self.optimizer_cls_and_kwargs
            optimizer_cls, kwargs = chosen or self.get_optimizer_cls_and_kwargs(args, self.model if model is None else model)
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
            self.lr_scheduler = schedule_of_arguments(args, self.optimizer if optimizer is None else optimizer, num_training_steps)
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
    def zero_stage(self) -> int | None:
        """DeepSpeed's ZeRO stage (``None`` without DeepSpeed)."""
        return self.accelerator.state.deepspeed_plugin.zero_stage if self.is_deepspeed_enabled else None

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        """What the engine prepared (:meth:`StepEngine.wrap <boost_hf.training.engine.StepEngine.wrap>`), else the
        Trainer's own wrapping (accelerate's DDP over the world, DeepSpeed's engine)."""
        return self.engine.wrapped if self.engine.wrapped is not None else super()._wrap_model(model, training, dataloader)

    def deepspeed_hooks(self, resume_from_checkpoint: str | None) -> contextlib.AbstractContextManager:
        """While the Trainer prepares DeepSpeed: our groups as its ``mpu``, and a ZeRO-1/2 checkpoint of another
        tp x dp resumed through DeepSpeed's universal one (:func:`~.deepspeed.deepspeed_initialize_hooks`)."""
        if not self.is_deepspeed_enabled:
            return contextlib.nullcontext()
        mpu = ModelParallelUnit(self.parallel_state) if self.parallel_state.mesh is not None else None
        saved = read_training_layout(resume_from_checkpoint) if resume_from_checkpoint else None
        return deepspeed_initialize_hooks(mpu, universal_resume(resume_from_checkpoint, self.args.output_dir, saved, self.training_layout()))

    # ------------------------------------------------------------------ data and evaluation
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
        dataset = self.eval_dataset[eval_dataset] if isinstance(eval_dataset, str) else eval_dataset or self.eval_dataset
        if dataset is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")
        if hasattr(dataset, "column_names"):
            dataset = self._remove_unused_columns(dataset, description="Evaluation")
        state, args = self.parallel_state, self.args
        return DataLoader(EvalShard(dataset, state.dp_size, state.dp_rank), batch_size=args.eval_batch_size,
                          collate_fn=self.data_collator, num_workers=args.dataloader_num_workers, pin_memory=args.dataloader_pin_memory)

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None, metric_key_prefix="eval"):
        """Mean next-token loss over every target token of the evaluation set, its perplexity and bits per byte (the
        engine's exact ``[nll sum, tokens, bytes]`` over every DP rank), then ``compute_metrics`` if given."""
        model = self.model_wrapped if self.is_deepspeed_enabled and self.model_wrapped is not self.model else self.model
        model.eval()
        predictions, label_ids = [], []

        def keep(logits: torch.Tensor, labels: torch.Tensor) -> None:
            logits = logits.float()  # as accelerate hands them over (bf16 has no numpy type)
            if self.preprocess_logits_for_metrics is not None:
                logits = self.preprocess_logits_for_metrics(logits, labels)
            predictions.append(logits.cpu())
            label_ids.append(labels.cpu())

        with torch.no_grad(), self.autocast_smart_context_manager():
            batches = (self._prepare_inputs(batch) for batch in dataloader)
            totals = self.engine.evaluate(model, batches, self.processing_class, keep if self.compute_metrics is not None else None)
        metrics = metrics_from_sums(totals.cpu(), metric_key_prefix)
        if self.compute_metrics is not None:
            metrics.update(self.engine.user_metrics(self.compute_metrics, predictions, label_ids, metric_key_prefix))
        return EvalLoopOutput(predictions=None, label_ids=None, metrics=metrics, num_samples=len(dataloader.dataset.dataset))

    def evaluate(self, *args, **kwargs):
        """``Trainer.evaluate``; a collective that times out is named (:func:`~boost_hf.training.watchdog.naming_collective_timeouts`)."""
        with in_phase("evaluation"), naming_collective_timeouts(lambda: self.state.global_step):
            return super().evaluate(*args, **kwargs)

    # ------------------------------------------------------------------ steps
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The Trainer's loss, times NaN if it is not finite: its gradients then carry it to every rank's grad norm."""
        result = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        return (poison_nonfinite_loss(result[0]), result[1]) if return_outputs else poison_nonfinite_loss(result)

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.metrics.count_micro_batch(inputs["input_ids"])
        if self.run.hang_watchdog is not None:
            self.run.hang_watchdog.step = self.state.global_step + 1
        self.trained_context = inputs["input_ids"].shape[-1]
        bos = getattr(self.processing_class, "bos_token_id", None)
        if bos is not None:
            self._bos_seen = (inputs["input_ids"] == bos).any() | self._bos_seen
        if self.master_parameters is not None:  # backward passes reaching each parameter before the optimizer step
            self.master_parameters.accumulations_per_step = self.engine.backward_passes_per_step(self.current_gradient_accumulation_steps)
        with self.metrics.comm:
            loss = self.engine.train_step(model, inputs, functools.partial(super().training_step, model, inputs, num_items_in_batch))
        self.metrics.count_p2p_bytes(self.engine.p2p_bytes_per_step(tuple(inputs["input_ids"].shape)))
        self._nonfinite_loss_logged = ~torch.isfinite(loss) | self._nonfinite_loss_logged  # no sync
        return loss

    def _clip_grad_norm(self, model):
        if self.is_deepspeed_enabled:
            return super()._clip_grad_norm(model)
        if self.master_parameters is not None:  # the DP reduction done, the fp32 masters and gradients presented
            self.master_parameters.gradients_ready()
        self.accelerator.unscale_gradients()
        state = self.parallel_state
        return clip_grad_norm_(model.parameters(), self.args.max_grad_norm, state.tp_group, state.pp_group)

    def _get_grad_norm(self, model, grad_norm=None):
        """The global grad norm, checked on every step (the same value on every rank, :mod:`boost_hf.training.health`)."""
        if self.master_parameters is not None:
            self.master_parameters.gradients_ready()
        if grad_norm is None and not self.is_deepspeed_enabled:
            grad_norm = global_grad_norm(model.parameters(), self.parallel_state.tp_group, self.parallel_state.pp_group)
        grad_norm = super()._get_grad_norm(model, grad_norm)
        last_checkpoint = lambda: (completed_checkpoints(self.args.output_dir) or [None])[-1]  # noqa: E731
        self.nonfinite.check(grad_norm, self.state.global_step + 1, self.optimizer, last_checkpoint)
        return grad_norm

    def _track_num_input_tokens(self, inputs) -> None:
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)  # gathered over all processes: TP and PP peers counted tp x pp times
        state = self.parallel_state
        self.state.num_input_tokens_seen = before + (self.state.num_input_tokens_seen - before) // (state.tp_size * state.pp_size)

    def floating_point_ops(self, inputs) -> int:
        """Analytic training FLOPs of this rank's share of the micro-batch (its TP group and stages split the work)."""
        input_ids = inputs["input_ids"]
        per_token = training_flops_per_token(self.model.config, input_ids.shape[-1])
        return input_ids.numel() * per_token // (self.parallel_state.tp_size * self.parallel_state.pp_size)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:
            logs.update(self.metrics.pop_logs())
            logs["nonfinite_skipped_steps"] = self.nonfinite.skipped
            if bool(self._nonfinite_loss_logged):  # the Trainer averages non-finite losses away (logging_nan_inf_filter)
                logs["loss"] = float("nan")
            self._nonfinite_loss_logged = False
        super().log(logs, start_time)

    # ------------------------------------------------------------------ the run
    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs):
        """``Trainer.train`` in this run's folder (:class:`~boost_hf.checkpoint.run_folder.RunFolder`):
        ``resume_from_checkpoint=True`` takes the last *complete* checkpoint; a new run refuses an ``output_dir``
        holding an earlier run unless ``overwrite_output_dir``; the folder is locked."""
        resume = self.resume_point(resume_from_checkpoint)
        self.run.start(resumed=resume is not None)
        if resume is not None:
            restore_trained_record(self, resume)
        if self.run.training_is_complete(resume):  # saved at max_steps: a requeue trains no step more
            return continue_complete_run(self, resume)
        self.data_resume_from = None if self.args.ignore_data_skip else resume  # (the user's choice: from the first batch)
        with self.run.running(lambda: self.state.global_step + 1), self.data_continues_itself(), self.deepspeed_hooks(resume):
            output = super().train(resume_from_checkpoint=resume, **kwargs)
            self.run.saver.wait()  # the last asynchronous checkpoint is complete when train() returns
        self.run.stop_after_training()
        return output

    def resume_point(self, resume_from_checkpoint: str | bool | None) -> str | None:
        """The checkpoint :meth:`train` continues from, decided once per run, after the output folder is claimed
        (:meth:`~boost_hf.checkpoint.run_folder.RunFolder.resume_point`: verified, resumable at this layout, the
        checkpoints of later steps set aside). Collective."""
        return self.run.resume_point(resume_from_checkpoint, self.model.config, self.training_layout())

    def stop_if_requested(self) -> None:
        """Collective: after training (before the final evaluation, sample and save), a signal of ``--exit_signals`` or
        the spent ``--exit_after_minutes`` budget saves a checkpoint at the current step (unless there is one) and
        raises :class:`~boost_hf.training.preemption.TrainingStopped` on every rank."""
        self.run.stop_if_requested(self.state.global_step, lambda: self._save_checkpoint(self.model_wrapped, None))

    @contextlib.contextmanager
    def data_continues_itself(self):
        """A stream continues from its saved position (:func:`~boost_hf.training.data.restore_data_position`), so the
        Trainer must not skip batches on resume: ``args.ignore_data_skip`` is set while training a stream."""
        saved = self.args.ignore_data_skip
        self.args.ignore_data_skip = saved or isinstance(self.train_dataset, (BlockStream, datasets.IterableDataset))
        try:
            yield
        finally:
            self.args.ignore_data_skip = saved

    def generate_sample(self, prompt: str | None = None, max_new_tokens: int | None = None) -> str:
        """Greedy continuation of ``prompt`` (default ``args.sample_prompt``), in the run's precision. Collective."""
        prompt = prompt if prompt is not None else getattr(self.args, "sample_prompt", "The")
        max_new_tokens = max_new_tokens if max_new_tokens is not None else getattr(self.args, "sample_max_new_tokens", 40)
        tokenizer = self.processing_class
        input_ids = tokenizer(prompt, return_tensors="pt").input_ids.to(self.args.device)
        with in_phase("generation"), self.autocast_smart_context_manager():
            output = self.engine.generate(self.model, input_ids, max_new_tokens, tokenizer)
        return tokenizer.decode(output[0], skip_special_tokens=True)

    # ------------------------------------------------------------------ saving and resuming
    @property
    def trained_with_bos(self) -> bool:
        """Whether training put the tokenizer's BOS in this rank's micro-batches (the published tokenizer declares one)."""
        return bool(self._bos_seen)

    def context_length(self) -> int:
        """The trained context: the micro-batches' sequence length (``max_position_embeddings`` before training)."""
        return self.trained_context or self.model.config.max_position_embeddings

    def create_model_card(self, *args, **kwargs) -> None:
        """Transformers' ``push_to_hub`` path writes the card here: boost-hf's card, into ``output_dir``."""
        if self.is_world_process_zero():
            os.makedirs(self.args.output_dir, exist_ok=True)
            write_model_card(self, self.args.output_dir)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write the Hugging Face folder (weights streamed from every rank's shards in files of at most
        ``--save_max_shard_size``, config, remote code, tokenizer, model card). Collective; under ``bf16_params`` the
        weights written are the fp32 masters (boost-hf's, FSDP2's or DeepSpeed's)."""
        output_dir = output_dir or self.args.output_dir
        deepspeed_masters = self.is_deepspeed_enabled and self.precision.param_dtype != torch.float32
        with full_precision_parameters(self.model), full_parameters(self.model, self.zero_stage), \
                masters_in_parameters(self.model) if deepspeed_masters else contextlib.nullcontext(), publishing(self):
            self.model.save_pretrained(output_dir, is_main_process=self.args.should_save,
                                       max_shard_size=getattr(self.args, "save_max_shard_size", "5GB"))
        if self.args.should_save:
            save_publishing_files(self, output_dir)

    def save_final_model(self, output_dir: str | None = None) -> str:
        """Save the model (canonical) + tokenizer + manifest atomically to ``<output_dir>/final``; return that path.
        Waits for an asynchronous checkpoint in flight first."""
        self.run.claim()
        self.run.saver.wait()
        target = output_dir or os.path.join(self.args.output_dir, "final")
        with in_phase("saving the final model"), atomic_directory(target, is_writer=self.args.should_save,
                                                                  run_id=self.run.run_id, config=self.model.config) as staging:
            self.save_model(staging)
        return target

    def _save_checkpoint(self, model, trial) -> None:
        """The Trainer's checkpoint, every rank writing its own shards (:func:`~.checkpointing.save_checkpoint`)."""
        save_checkpoint(self, trial)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        save_optimizer_and_scheduler(self, output_dir)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """This rank's shards of the checkpoint's weights, saved at any layout (:func:`~.checkpointing.load_weights`)."""
        load_weights(self, resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """This rank's optimizer state (resharded at another layout) and the scheduler
        (:func:`~.checkpointing.load_optimizer_and_scheduler`)."""
        load_optimizer_and_scheduler(self, checkpoint)

    def training_layout(self, optimizer_records: list[dict] | None = None) -> dict:
        """This run's layout record (:func:`~.checkpointing.run_layout`)."""
        return run_layout(self, optimizer_records)


__all__ = ["BoostTrainer"]

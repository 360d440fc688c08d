"""``BoostTrainingArguments``: ``transformers.TrainingArguments`` plus the tensor-parallel layout.

The defaults are the CoLA pre-training recipe (BOOST.md section 1): AdamW, weight decay 0.01, gradient
clipping at 0.5, linear warm-up over 10 % of the steps, then cosine decay to 0.1 x the peak learning
rate. ``per_device_train_batch_size`` is per *process*: with ``tp_size`` ranks sharing each batch the
global batch is ``per_device_train_batch_size x dp x gradient_accumulation_steps``,
``dp = world_size / (tp_size x pp_size)``. Under pipeline parallelism it is the batch one pipeline replica
trains per step, split into ``pp_microbatches`` micro-batches.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.distributed as dist
from transformers import TrainingArguments

from ..parallel.config import ParallelConfig
from ..optim.loro import LORO_WITHOUT_DEEPSPEED, LOWRANK_OPTIMIZERS
from .health import NONFINITE_POLICIES
from .precision import resolve_precision
from .zero1 import check_zero1

logger = logging.getLogger(__name__)

CPU_PEAK_TFLOPS = 0.1
"""Rough dense fp32 peak of one CPU process (a few AVX2/AVX-512 cores), for MFU on CPU runs only."""


def default_peak_tflops() -> float:
    """Dense bf16 peak of this machine's GPU when it is a known preset (A100, H100, H200), else a CPU guess."""
    if torch.cuda.is_available():
        from ..perf.hardware import HARDWARE_PRESETS

        name = torch.cuda.get_device_name().lower()
        for key in ("h200", "h100", "a100"):
            if key in name:
                return HARDWARE_PRESETS[key].peak_tflops
        logger.warning("unknown GPU %r: pass --peak_tflops for a meaningful MFU", name)
    return CPU_PEAK_TFLOPS


def check_lowrank_optimizer(args) -> None:
    """Raise ``ValueError`` naming the field to change for an unknown optimizer, bad LORO settings, or LORO with
    DeepSpeed (ZeRO's flat partitions cut through the factors' rows that LORO's exact step rebuilds)."""
    if args.lowrank_optimizer not in LOWRANK_OPTIMIZERS:
        raise ValueError(f"lowrank_optimizer must be one of {', '.join(LOWRANK_OPTIMIZERS)}, got {args.lowrank_optimizer!r}.")
    if args.lowrank_optimizer != "loro":
        return
    if args.loro_exact_every < 1:
        raise ValueError(f"loro_exact_every must be >= 1 (optimizer steps between exact steps), got {args.loro_exact_every}.")
    if args.loro_lr_scale is not None and not args.loro_lr_scale > 0:
        raise ValueError(f"loro_lr_scale must be > 0 (or unset for r/d), got {args.loro_lr_scale}.")
    if args.loro_restart_warmup_steps < 0:
        raise ValueError(f"loro_restart_warmup_steps must be >= 0, got {args.loro_restart_warmup_steps}.")
    if args.deepspeed:
        raise ValueError(LORO_WITHOUT_DEEPSPEED)




@dataclass(kw_only=True)
class BoostTrainingArguments(TrainingArguments):
    """Training arguments of boost-hf (see :class:`~boost_hf.parallel.config.ParallelConfig` for the layout).

    Args:
        tp_size: ranks per tensor-parallel group; the launched world is ``dp x tp_size`` processes.
        tp_style: ``"btp"`` (bottleneck-aware), ``"vanilla"`` (naive low-rank TP), ``"megatron"`` (full-rank
            models), or ``"auto"``: btp for low-rank models, megatron for full rank.
        rmsnorm: BTP norm statistics, ``"online"`` (default, exact), ``"sync"`` (exact) or ``"local"``
            (approximate).
        group_linears: one GEMM and one collective for the A's sharing an input.
        activation_checkpointing_mode: ``"none"``, ``"full"`` (recompute each decoder layer) or ``"lowrank"``
            (BOOST's low-rank checkpointing; no collective recomputed under BTP). It replaces the Trainer's
            ``activation_checkpointing`` flag, which boost-hf models do not use: passing that flag selects
            ``"full"``.
        sequence_parallel: sequence parallelism over the tensor-parallel group (megatron: Megatron-LM's, the
            residual on ``N/p`` tokens; btp: latent sequence parallelism); vanilla has none. Needs ``block_size``
            divisible by ``tp_size``, ``pp_size=1`` and ``sample_max_new_tokens=0`` (generation runs one token
            per step, which cannot be split over the ranks).
        pp_size: pipeline stages' ranks (the world is ``pp_size x dp x tp_size``; PP outermost, TP adjacent).
        pp_schedule: ``1f1b`` (default), ``gpipe``, ``interleaved-1f1b``, ``looped-bfs`` (zero-bubble ones refused).
        pp_microbatches: micro-batches per pipeline step (default: the number of stages).
        pp_stages_per_rank: model chunks per pipeline rank of the interleaved schedules (default 2).
        peak_tflops: dense peak TFLOP/s of one device, the denominator of MFU (default: the GPU preset of
            :mod:`boost_hf.perf.hardware`, or a rough CPU guess).
        sample_prompt / sample_max_new_tokens: the greedy sample printed at the end of training.
        nonfinite: what a non-finite loss or gradient norm does: ``"stop"`` (default, an error naming the step)
            or ``"skip_step"`` (the update is not applied; counted in the logs). See :mod:`boost_hf.training.health`.
        nonfinite_max_consecutive_skips: under ``skip_step``, this many skipped steps in a row (default 10) stop the run
            with the ``NonFiniteError`` (0: never).
        hang_timeout_s: seconds after which a rank that stopped responding (frozen, SIGSTOPped, its machine hung) stops
            the run with an error naming it (default 300; 0: no watchdog). See :mod:`boost_hf.training.watchdog`.
        overwrite_output_dir: let a new (not resumed) run replace the checkpoints and final model of an earlier
            run in ``output_dir`` (transformers 5 dropped this Trainer flag; without it such a run is refused).
        lowrank_optimizer: ``"adamw"`` (default) or ``"loro"``: LORO (:mod:`boost_hf.optim.loro`) on the factors of a
            ``bottleneck="svd"`` model, AdamW on the other parameters; not with DeepSpeed.
        loro_exact_every: LORO's exact step every this many optimizer steps (the authors: 500 up to 350M, 200 at 1B);
            the Adam moments are reset and the learning rate warms up again after each.
        loro_lr_scale: the factors' learning rate on lazy steps, relative to ``learning_rate`` (default ``r / d``).
        loro_restart_warmup_steps: steps of the linear warm-up after each exact step (the authors: 5; 0: none).
        zero1_optimizer: ZeRO-1 without DeepSpeed: each data-parallel rank keeps the optimizer state of a share of the
            parameters (torch's ``ZeroRedundancyOptimizer`` over the DP group; :mod:`boost_hf.training.zero1`), at any
            layout including ``pp_size > 1``; checkpoints hold the consolidated state (resumable at any layout, with or
            without it). At dp 1 there is nothing to shard: the plain optimizer. Not with DeepSpeed or LORO.
        precision_policy: how bf16 (``--bf16``, or accelerate's ``mixed_precision``) trains
            (:mod:`boost_hf.training.precision`): ``"autocast"`` (the default: fp32 parameters, the forward under bf16
            autocast) or ``"bf16_params"`` (bf16 parameters, fp32 master weights, gradients accumulated and all-reduced
            over DP in fp32, checkpoints in fp32). With DeepSpeed's bf16 mode the policy is DeepSpeed's own
            ``bf16_params``. Refused without bf16.
        grad_reduce_dtype: ``bf16_params`` only: the dtype of the data-parallel gradient all-reduce, ``"fp32"``
            (default) or ``"bf16"`` (half the bytes; each bucket rounded to bf16 for the sum, then accumulated back in fp32).
        fp32_residual: ``bf16_params`` only: keep the residual stream in fp32 while the layers compute in bf16
            (Megatron-LM's ``fp32_residual_connection``; off by default, as there).

    Without CUDA, ``use_cpu`` is set (and ``ddp_backend="gloo"`` when launched on several processes), so
    ``accelerate launch`` runs on CPU processes with or without DeepSpeed. ``ddp_timeout`` bounds every collective
    on CPU as on GPU (transformers passes it to the process group on GPU only; boost-hf's TP and DP groups take it
    from the default group, :func:`~boost_hf.parallel.state.new_group_with_timeout`).
    """

    tp_size: int = field(default=1, metadata={"help": "Ranks per tensor-parallel group (the world is dp x tp_size)."})
    tp_style: str = field(
        default="auto", metadata={"help": "btp, vanilla, megatron, or auto (btp for low-rank models, megatron for full rank)."}
    )
    rmsnorm: str = field(default="online", metadata={"help": "BTP RMSNorm statistics: online, sync (both exact) or local (approximate)."})
    group_linears: bool = field(default=True, metadata={"help": "Fuse the A's sharing an input into one GEMM and one collective."})
    activation_checkpointing_mode: str = field(
        default="none", metadata={"help": "none, full (recompute each layer) or lowrank (recompute between r-dim latents)."}
    )
    sequence_parallel: bool = field(
        default=False, metadata={"help": "Sequence parallelism over the TP group (megatron, btp); needs block_size divisible "
                                         "by tp_size and --sample_max_new_tokens 0."}
    )
    pp_size: int = field(default=1, metadata={"help": "Pipeline ranks (the world is pp_size x dp x tp_size)."})
    pp_schedule: str = field(
        default="1f1b", metadata={"help": "Pipeline schedule: 1f1b, gpipe, interleaved-1f1b or looped-bfs."}
    )
    pp_microbatches: int | None = field(default=None, metadata={"help": "Micro-batches per pipeline step (default: stages)."})
    pp_stages_per_rank: int | None = field(
        default=None, metadata={"help": "Model chunks per pipeline rank (interleaved schedules; default 2)."}
    )
    peak_tflops: float | None = field(
        default=None, metadata={"help": "Dense peak TFLOP/s per device for MFU (default: GPU preset or a CPU guess)."}
    )
    sample_prompt: str = field(default="The history of", metadata={"help": "Prompt of the sample generated after training."})
    sample_max_new_tokens: int = field(default=40, metadata={"help": "Tokens generated for the final sample (0: none)."})
    nonfinite: str = field(default="stop", metadata={"help": "On a non-finite loss or grad norm: stop (error) or skip_step."})
    nonfinite_max_consecutive_skips: int = field(
        default=10, metadata={"help": "With --nonfinite skip_step, stop (NonFiniteError) after this many skipped steps in a row (0: never)."}
    )
    hang_timeout_s: float = field(
        default=300.0, metadata={"help": "Stop the run when a rank has not responded for this many seconds (0: never)."}
    )
    overwrite_output_dir: bool = field(
        default=False, metadata={"help": "Let a new run replace an earlier run's checkpoints and final model in output_dir."}
    )
    lowrank_optimizer: str = field(default="adamw", metadata={"help": "adamw, or loro (svd models: LORO on the factors)."})
    loro_exact_every: int = field(default=500, metadata={"help": "LORO: an exact step every this many optimizer steps."})
    loro_lr_scale: float | None = field(
        default=None, metadata={"help": "LORO: the factors' lazy-step learning rate relative to learning_rate (default r/d)."}
    )
    loro_restart_warmup_steps: int = field(default=5, metadata={"help": "LORO: warm-up steps after each exact step."})
    zero1_optimizer: bool = field(
        default=False,
        metadata={"help": "ZeRO-1 without DeepSpeed: the optimizer state sharded over the data-parallel group (any pp_size)."},
    )
    # precision (issue 26): boost_hf/training/precision.py
    precision_policy: str | None = field(
        default=None,
        metadata={"help": "With bf16: autocast (default; fp32 parameters under bf16 autocast) or bf16_params (bf16 "
                          "parameters, fp32 masters and gradient accumulation/reduction). DeepSpeed bf16 is bf16_params."},
    )
    grad_reduce_dtype: str | None = field(
        default=None, metadata={"help": "bf16_params: dtype of the data-parallel gradient all-reduce, fp32 (default) or bf16."}
    )
    fp32_residual: bool = field(
        default=False, metadata={"help": "bf16_params: keep the residual stream in fp32 (Megatron's fp32_residual_connection)."}
    )

    # CoLA recipe defaults (BOOST.md section 1)
    weight_decay: float = 0.01
    max_grad_norm: float = 0.5
    lr_scheduler_type: str = "cosine_with_min_lr"
    lr_scheduler_kwargs: dict | str | None = field(default_factory=lambda: {"min_lr_rate": 0.1})
    warmup_steps: float = 0.1
    # every data-parallel rank takes whole batches: no sample repeated to pad the epoch's last batch
    dataloader_drop_last: bool = True

    def __post_init__(self) -> None:
        if not torch.cuda.is_available():
            self.use_cpu = True
            if int(os.environ.get("WORLD_SIZE", "1")) > 1:
                self.ddp_backend = self.ddp_backend or "gloo"
        if self.activation_checkpointing or self.gradient_checkpointing:
            if self.activation_checkpointing_mode == "none":
                self.activation_checkpointing_mode = "full"
            logger.warning(
                "boost-hf models checkpoint activations through activation_checkpointing_mode (now %r); "
                "the Trainer's activation_checkpointing flag is turned off.",
                self.activation_checkpointing_mode,
            )
            self.activation_checkpointing = self.gradient_checkpointing = False
        check_lowrank_optimizer(self)
        check_zero1(self)
        super().__post_init__()
        if self.peak_tflops is None:
            self.peak_tflops = default_peak_tflops()
        if self.nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite must be one of {', '.join(NONFINITE_POLICIES)}, got {self.nonfinite!r}.")
        for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}: each optimizer step needs at least one "
                                 "sample per process and one micro-batch.")
        if self.nonfinite_max_consecutive_skips < 0:
            raise ValueError(f"nonfinite_max_consecutive_skips must be >= 0 (0: never stop), got {self.nonfinite_max_consecutive_skips}.")
        if self.max_steps < -1 or (self.max_steps <= 0 and self.num_train_epochs <= 0):
            raise ValueError(
                f"this run would train no step (max_steps={self.max_steps}, num_train_epochs={self.num_train_epochs}): set "
                "--max_steps to a positive number of optimizer steps, or --max_steps -1 and --num_train_epochs > 0."
            )
        if self.hang_timeout_s < 0:
            raise ValueError(f"hang_timeout_s must be >= 0 (0 disables the watchdog), got {self.hang_timeout_s}.")
        if self.peak_tflops <= 0:
            raise ValueError(f"peak_tflops must be > 0, got {self.peak_tflops}.")
        self.to_parallel_config()  # validate the layout fields now, not after the model is built
        resolve_precision(self)  # validate the precision fields (--bf16, accelerate's mixed precision, DeepSpeed's bf16)
        if self.sequence_parallel and self.tp_size > 1 and self.sample_max_new_tokens > 0:
            raise ValueError(
                f"sequence_parallel=True cannot generate the end-of-training sample (sample_max_new_tokens="
                f"{self.sample_max_new_tokens}): generation feeds one token per step, which does not split over "
                f"tp_size={self.tp_size} ranks. Pass --sample_max_new_tokens 0, or generate from the saved final model "
                "(it loads at any TP size, without sequence parallelism)."
            )
        if self.pp_size > 1 and self.gradient_accumulation_steps != 1:
            raise ValueError(
                f"gradient_accumulation_steps={self.gradient_accumulation_steps} with pp_size={self.pp_size}: a pipeline "
                "step already accumulates the gradients of its micro-batches. Use gradient_accumulation_steps=1 and raise "
                "per_device_train_batch_size (split into pp_microbatches micro-batches) instead."
            )
        if self.pp_size > 1 and self.deepspeed:
            raise ValueError(
                f"DeepSpeed cannot run with pp_size={self.pp_size}: the pipeline schedule runs each micro-batch's backward "
                "itself, which DeepSpeed's engine must own (DeepSpeed's own pipeline engine refuses ZeRO-2/3 for the same "
                "reason). Drop --deepspeed: boost-hf trains pipelines with DDP over the data-parallel group, and "
                "--zero1_optimizer shards the optimizer state over it (ZeRO-1 with torch's ZeroRedundancyOptimizer)."
            )

    @cached_property
    def _setup_devices(self) -> torch.device:
        """transformers initialises the process group with ``ddp_timeout`` on GPU but, with ``use_cpu``, without it
        (gloo's 30-minute default). Launched on CPU, the group is initialised here first, through accelerate as
        transformers would, with the timeout; transformers then finds it initialised."""
        if self.use_cpu and int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
            from accelerate import PartialState

            PartialState(cpu=True, backend=self.ddp_backend, timeout=self.ddp_timeout_delta)
        return TrainingArguments._setup_devices.func(self)

    def to_parallel_config(self, model_config=None) -> ParallelConfig:
        """The :class:`ParallelConfig` of these arguments; ``tp_style="auto"`` resolves with ``model_config``
        (btp for a low-rank model, megatron for a full-rank one; btp without a config)."""
        style = self.tp_style
        if style == "auto":
            style = "megatron" if model_config is not None and model_config.bottleneck is None else "btp"
        return ParallelConfig(
            tp_size=self.tp_size,
            tp_style=style,
            rmsnorm=self.rmsnorm,
            group_linears=self.group_linears,
            activation_checkpointing=self.activation_checkpointing_mode,
            sequence_parallel=self.sequence_parallel,
            pp_size=self.pp_size,
            pp_schedule=self.pp_schedule,
            pp_microbatches=self.pp_microbatches,
            pp_stages_per_rank=self.pp_stages_per_rank,
        )


__all__ = ["BoostTrainingArguments", "default_peak_tflops", "CPU_PEAK_TFLOPS"]

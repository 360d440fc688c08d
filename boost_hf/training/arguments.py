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
from dataclasses import dataclass, field, make_dataclass
from functools import cached_property

import torch
import torch.distributed as dist
from transformers import TrainingArguments

from ..parallel.config import ParallelConfig
from ..parallel.settings import config_of_training_arguments, parse_layer_split, training_fields
from ..data_parallel_config import data_parallel_training_fields
from ..precision_config import precision_training_fields
from ..optim.loro import EPSILON_PLACEMENTS, LOWRANK_OPTIMIZERS
from ..optim.loro_schedule import authors_schedule_shift, check_authors_schedule
from .stack import check_training_stack
from .compatibility import check_deepspeed_sources, check_settings, resolve_torch_compile, settings_from_accelerate
from .health import NONFINITE_POLICIES
from .preemption import DEFAULT_EXIT_SIGNALS, parse_exit_signals
from .precision import PrecisionPolicy, resolve_precision
from .watchdog import enter_phase, exit_with_launcher, ranks_never_started, watch_launch

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


LORO_SCHEDULES = ("restarted", "authors")
"""``--loro_schedule``: ``restarted`` (``lr_scheduler_type``, warmed up again after each exact step) or ``authors`` (the
LORO authors' ``cosine_restart``, :mod:`boost_hf.optim.loro_schedule`)."""


def check_lowrank_optimizer(args) -> None:
    """Raise ``ValueError`` naming the field to change for an unknown optimizer or bad LORO settings (LORO with
    DeepSpeed: :mod:`boost_hf.training.compatibility`)."""
    if args.lowrank_optimizer not in LOWRANK_OPTIMIZERS:
        raise ValueError(f"lowrank_optimizer must be one of {', '.join(LOWRANK_OPTIMIZERS)}, got {args.lowrank_optimizer!r}.")
    if args.loro_schedule not in LORO_SCHEDULES:
        raise ValueError(f"loro_schedule must be one of {', '.join(LORO_SCHEDULES)}, got {args.loro_schedule!r}.")
    if args.adam_epsilon_placement not in EPSILON_PLACEMENTS:
        raise ValueError(f"adam_epsilon_placement must be one of {', '.join(EPSILON_PLACEMENTS)}, got {args.adam_epsilon_placement!r}.")
    if args.lowrank_optimizer != "loro":
        for name, default, what in (("loro_schedule", "restarted", "restarts at LORO's exact steps"),
                                    ("adam_epsilon_placement", "torch", "is implemented by LORO's optimizer (AdamW is torch's)")):
            if getattr(args, name) != default:
                raise ValueError(f"{name}={getattr(args, name)!r} {what}: use it with --lowrank_optimizer loro, or drop it.")
        return
    if args.loro_schedule_shift is not None and args.loro_schedule != "authors":
        raise ValueError(
            f"loro_schedule_shift={args.loro_schedule_shift} shifts the LORO authors' schedule only: add --loro_schedule authors, "
            "or drop it."
        )
    if args.loro_exact_every < 1:
        raise ValueError(f"loro_exact_every must be >= 1 (optimizer steps between exact steps), got {args.loro_exact_every}.")
    if args.loro_lr_scale is not None and not args.loro_lr_scale > 0:
        raise ValueError(f"loro_lr_scale must be > 0 (or unset for r/d), got {args.loro_lr_scale}.")
    if args.loro_restart_warmup_steps < 0:
        raise ValueError(f"loro_restart_warmup_steps must be >= 0, got {args.loro_restart_warmup_steps}.")


def check_authors_loro_schedule(args) -> None:
    """With ``--loro_schedule authors``: ``lr_scheduler_type`` must be ``cosine_with_min_lr`` with only ``min_lr_rate``
    (the authors' ``min_lr_ratio``: every other setting would be silently unused) and, when ``max_steps`` is known,
    the schedule's own checks (:func:`~boost_hf.optim.loro_schedule.check_authors_schedule`). After
    ``TrainingArguments.__post_init__`` (which parses ``lr_scheduler_kwargs``)."""
    if args.lowrank_optimizer != "loro" or args.loro_schedule != "authors":
        return
    scheduler = getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)
    kwargs = args.lr_scheduler_kwargs or {}
    if scheduler != "cosine_with_min_lr" or set(kwargs) != {"min_lr_rate"}:
        raise ValueError(
            f"--loro_schedule authors computes the LORO authors' cosine_restart from warmup_steps, loro_exact_every, "
            f"loro_restart_warmup_steps, loro_schedule_shift and lr_scheduler_kwargs' min_lr_rate alone: set "
            f"lr_scheduler_type cosine_with_min_lr with lr_scheduler_kwargs {{\"min_lr_rate\": ...}} (got {scheduler!r} with "
            f"{kwargs!r}), or use --loro_schedule restarted."
        )
    if args.max_steps > 0:
        check_authors_schedule(training_steps=args.max_steps, warmup_steps=args.get_warmup_steps(args.max_steps),
                               restart_every=args.loro_exact_every, restart_warmup_steps=args.loro_restart_warmup_steps,
                               min_ratio=kwargs["min_lr_rate"], shift=authors_schedule_shift(args, args.max_steps))


LayoutArguments = make_dataclass("LayoutArguments", training_fields(), kw_only=True)
LayoutArguments.__doc__ = """The layout fields of :class:`BoostTrainingArguments`: :class:`ParallelConfig`'s, generated from its
declaration (names, types, defaults, help) with the differences :mod:`boost_hf.parallel.settings` states
(``activation_checkpointing_mode``, ``tp_style="auto"``, ``pp_layer_split`` as a comma-separated list)."""
LayoutArguments.__module__ = __name__
PrecisionArguments = make_dataclass("PrecisionArguments", precision_training_fields(), kw_only=True)
PrecisionArguments.__doc__ = """The precision fields of :class:`BoostTrainingArguments`: :class:`~boost_hf.precision_config.PrecisionConfig`'s,
generated from its declaration (names, ``Literal`` choices, defaults, help)."""
PrecisionArguments.__module__ = __name__
DataParallelArguments = make_dataclass("DataParallelArguments", data_parallel_training_fields(), kw_only=True)
DataParallelArguments.__doc__ = """The data-parallel fields of :class:`BoostTrainingArguments`:
:class:`~boost_hf.data_parallel_config.DataParallelConfig`'s, generated from its declaration (names, ``Literal`` choices,
defaults, help)."""
DataParallelArguments.__module__ = __name__


@dataclass(kw_only=True)
class BoostTrainingArguments(LayoutArguments, PrecisionArguments, DataParallelArguments, TrainingArguments):
    """Training arguments of boost-hf: ``TrainingArguments``, the layout fields of :class:`LayoutArguments` (those of
    :class:`~boost_hf.parallel.config.ParallelConfig`, whose help says what each does: ``tp_size``, ``tp_style``,
    ``rmsnorm``, ``group_linears``, ``activation_checkpointing_mode``, ``sequence_parallel``, ``pp_size``,
    ``pp_schedule``, ``pp_microbatches``, ``pp_stages_per_rank``, ``pp_layer_split``), the precision fields of
    :class:`PrecisionArguments` (those of :class:`~boost_hf.precision_config.PrecisionConfig`: ``precision_policy``,
    ``grad_reduce_dtype``, ``fp32_residual``), the data-parallel fields of :class:`DataParallelArguments` (those of
    :class:`~boost_hf.data_parallel_config.DataParallelConfig`: ``data_parallel``, ``dp_replicate_size``,
    ``fsdp_reshard_after_forward``, ``fsdp_units``; FSDP2 asked for through transformers' ``--fsdp``, an accelerate
    config or ``parallelism_config`` is written onto them, :mod:`boost_hf.training.compatibility`), and:

    Args:
        peak_tflops: dense peak TFLOP/s of one device, the denominator of MFU (default: the GPU preset of
            :mod:`boost_hf.perf.hardware`, or a rough CPU guess).
        torch_compile: compile each decoder layer and the loss (``torch.compile``, per part:
            :func:`~boost_hf.parallel.compile.compile_model`). Unset (``None``, the default): ``True`` on a CUDA device,
            ``False`` on the CPU (:func:`~boost_hf.training.compatibility.resolve_torch_compile`; after it the field is a
            ``bool`` and ``torch_compile_explicit`` says whether a flag, a recipe or accelerate's ``dynamo_backend`` set
            it). ``--torch_compile false``: eager.
        sample_prompt / sample_max_new_tokens: the greedy sample printed at the end of training.
        nonfinite: what a non-finite loss or gradient norm does: ``"stop"`` (default, an error naming the step)
            or ``"skip_step"`` (the update is not applied; counted in the logs). See :mod:`boost_hf.training.health`.
        nonfinite_max_consecutive_skips: under ``skip_step``, this many skipped steps in a row (default 10) stop the run
            with the ``NonFiniteError`` (0: never).
        hang_timeout_s: seconds after which a rank that stopped responding (frozen, SIGSTOPped, its machine hung) stops
            the run with an error naming it (default 300; 0: no watchdog). See :mod:`boost_hf.training.watchdog`.
        startup_timeout_s: the same for a rank that never started responding (frozen before it reached the process
            group, e.g. while importing): counted from each rank's own start (default ``max(hang_timeout_s, 300)``, as
            ranks start at different times). A process-group set-up that times out first (``--ddp_timeout``) names
            the ranks that never started.
        overwrite_output_dir: let a new (not resumed) run replace the checkpoints and final model of an earlier
            run in ``output_dir`` (transformers 5 dropped this Trainer flag; without it such a run is refused).
        lowrank_optimizer: ``"adamw"`` (default) or ``"loro"``: LORO (:mod:`boost_hf.optim.loro`) on the factors of a
            ``bottleneck="svd"`` model, AdamW on the other parameters; not with DeepSpeed.
        loro_exact_every: LORO's exact step every this many optimizer steps (the authors: 500 up to 350M, 200 at 1B);
            the Adam moments are reset and the learning rate warms up again after each.
        loro_lr_scale: the factors' learning rate on lazy steps, relative to ``learning_rate`` (default ``r / d``).
        loro_restart_warmup_steps: steps of the linear warm-up after each exact step (the authors: 5; 0: none).
        loro_schedule: ``"restarted"`` (default: ``lr_scheduler_type``, warmed up again over
            ``loro_restart_warmup_steps`` after each exact step) or ``"authors"`` (the LORO authors' ``cosine_restart``,
            :mod:`boost_hf.optim.loro_schedule`: warm-up from ``min_lr_rate``, a cosine shifted by ``loro_schedule_shift``,
            restarts as theirs).
        loro_schedule_shift: the authors' ``lr_adjust_steps`` (default ``-warmup steps``, their 60m/130m/1b scripts).
        adam_epsilon_placement: ``"torch"`` (default) or ``"transformers"`` (``lr sqrt(bc2)/bc1 m/(sqrt(v) + eps)``, the
            LORO authors' optimizer); LORO only.
        zero1_optimizer: ZeRO-1 without DeepSpeed: each data-parallel rank keeps the optimizer state of a share of the
            parameters (torch's ``ZeroRedundancyOptimizer`` over the DP group; :mod:`boost_hf.training.zero1`), at any
            layout including ``pp_size > 1``; each rank saves its own share (resumable at any layout, with or
            without it). At dp 1 there is nothing to shard: the plain optimizer. Not with DeepSpeed or LORO.
        exit_signals: signals (default ``"SIGTERM,SIGUSR1"``; ``""``: none) after which every rank finishes its step, the
            run saves a checkpoint and every rank exits with status 76 (:mod:`boost_hf.training.preemption`).
        exit_after_minutes: the same after this many minutes since the process started (default 0: no budget), e.g. a
            few minutes less than the job's time limit.
        save_async: write each checkpoint in the background: the model's and optimizer's shards are copied to host
            memory (this rank's own, once), training goes on, and a thread writes them, hashes them, writes the
            manifest and renames the folder; the next save, the final model and the end of ``train`` wait for it. A
            run killed meanwhile leaves only a staging folder (:mod:`boost_hf.checkpoint.folders`).
        save_max_shard_size: largest safetensors file of ``final/`` and of every parallel ``save_pretrained`` (default
            ``"5GB"``): each file is written by one rank, which holds at most that much of the model.
        resume_on_changed_data: resume at the checkpoint's data position although the training data's fingerprint
            (:mod:`boost_hf.data.fingerprint`) differs from the one the checkpoint recorded (refused without it).

    Without CUDA, ``use_cpu`` is set (and ``ddp_backend="gloo"`` when launched on several processes), so
    ``accelerate launch`` runs on CPU processes with or without DeepSpeed. ``ddp_timeout`` bounds every collective
    on CPU as on GPU (transformers passes it to the process group on GPU only; boost-hf's TP and DP groups take it
    from the default group, :func:`~boost_hf.parallel.state.new_group_with_timeout`).
    """

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
    startup_timeout_s: float | None = field(
        default=None,
        metadata={"help": "Stop the run when a rank has not started (never reached its watchdog, before the process group) "
                          "this many seconds after the others (default: max(hang_timeout_s, 300))."},
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
    # LORO as its authors train it (issue 29): their schedule and their Adam epsilon placement
    loro_schedule: str = field(
        default="restarted", metadata={"help": "LORO: restarted (lr_scheduler_type, warmed up after each exact step) or authors "
                                               "(the LORO authors' cosine_restart)."}
    )
    loro_schedule_shift: int | None = field(
        default=None, metadata={"help": "LORO authors' schedule: their lr_adjust_steps (default: minus the warm-up steps)."}
    )
    adam_epsilon_placement: str = field(
        default="torch", metadata={"help": "torch (torch's AdamW) or transformers (lr sqrt(bc2)/bc1 m/(sqrt(v)+eps), the LORO "
                                           "authors' optimizer); LORO only."}
    )
    # preemption: stop at a step boundary, save, exit with status 76 (boost_hf.training.preemption)
    exit_signals: str = field(
        default=DEFAULT_EXIT_SIGNALS,
        metadata={"help": "Signals after which every rank finishes its step, the run saves a checkpoint and exits with status "
                          "76 ('': none)."},
    )
    exit_after_minutes: float = field(
        default=0.0, metadata={"help": "Save a checkpoint and exit (status 76) after this many minutes of the process (0: never)."}
    )
    # checkpoints (issue 27): every rank writes its own shards; asynchronously if asked
    save_async: bool = field(
        default=False, metadata={"help": "Write checkpoints in the background (host copy of each rank's shards); the next save waits."}
    )
    save_max_shard_size: str = field(
        default="5GB", metadata={"help": "Largest safetensors file of final/ (each written by one rank, holding at most that)."}
    )
    resume_on_changed_data: bool = field(
        default=False,
        metadata={"help": "Resume at the checkpoint's data position although the training data's fingerprint differs from "
                          "the saved one (files added, removed or changed): the samples after it differ from the saved run's."},
    )

    # transformers' own fields that the accelerate config also sets: unset unless given (``--bf16`` alone is true), so
    # that a value given is told from none and checked against accelerate's (boost_hf.training.compatibility)
    bf16: bool | None = field(default=None, metadata={
        "help": "bf16 mixed precision (--precision_policy says how). Unset: the accelerate config's mixed_precision, else "
                "false; given both, they must agree.", "nargs": "?", "const": True})
    fp16: bool | None = field(default=None, metadata={
        "help": "fp16 autocast. Unset: the accelerate config's mixed_precision, else false; given both, they must agree.",
        "nargs": "?", "const": True})
    torch_compile: bool | None = field(default=None, metadata={
        "help": "Compile each decoder layer and the loss (--torch_compile_backend, --torch_compile_mode). Unset: the "
                "accelerate config's dynamo_backend, else compiled on a CUDA device and eager on the CPU; false: eager; "
                "given both, they must agree.", "nargs": "?", "const": True})

    # CoLA recipe defaults (BOOST.md section 1)
    weight_decay: float = 0.01
    max_grad_norm: float = 0.5
    lr_scheduler_type: str = "cosine_with_min_lr"
    lr_scheduler_kwargs: dict | str | None = field(default_factory=lambda: {"min_lr_rate": 0.1})
    warmup_steps: float = 0.1
    # every data-parallel rank takes whole batches: no sample repeated to pad the epoch's last batch
    dataloader_drop_last: bool = True

    def __post_init__(self) -> None:
        check_training_stack()
        self.pp_layer_split = parse_layer_split(self.pp_layer_split)
        if not torch.cuda.is_available():
            self.use_cpu = True
            if int(os.environ.get("WORLD_SIZE", "1")) > 1:
                self.ddp_backend = self.ddp_backend or "gloo"
        check_lowrank_optimizer(self)
        settings_from_accelerate(self)  # one source per setting: flags, recipe, accelerate config, environment
        self.torch_compile_explicit = self.torch_compile is not None  # a flag, a recipe or accelerate's dynamo backend set it
        check_settings(self)  # whatever set them
        resolve_torch_compile(self)  # unset: compiled on a CUDA device, eager on the CPU
        if self.hang_timeout_s < 0:
            raise ValueError(f"hang_timeout_s must be >= 0 (0 disables the watchdog), got {self.hang_timeout_s}.")
        if self.startup_timeout_s is not None and not self.startup_timeout_s > 0:
            raise ValueError(f"startup_timeout_s must be > 0 (unset: max(hang_timeout_s, 300)), got {self.startup_timeout_s}.")
        super().__post_init__()
        check_deepspeed_sources(self)  # its config, as transformers filled it, against the arguments and accelerate's
        check_authors_loro_schedule(self)
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
        if self.peak_tflops <= 0:
            raise ValueError(f"peak_tflops must be > 0, got {self.peak_tflops}.")
        parse_exit_signals(self.exit_signals)
        if not self.exit_after_minutes >= 0:
            raise ValueError(f"exit_after_minutes must be >= 0 (0: no time budget), got {self.exit_after_minutes}.")
        self.to_parallel_config()  # validate the layout fields now, not after the model is built
        self.precision  # resolved once, here: the precision fields (--bf16, accelerate's mixed precision, DeepSpeed's bf16)
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

    @cached_property
    def precision(self) -> PrecisionPolicy:
        """The precision policy these arguments ask for (:func:`~boost_hf.training.precision.resolve_precision`),
        resolved once, when the arguments are built: every reader (the trainer, its checkpoints' layout record) takes
        this one."""
        return resolve_precision(self)

    @cached_property
    def _setup_devices(self) -> torch.device:
        """transformers initialises the process group with ``ddp_timeout`` on GPU but, with ``use_cpu``, without it
        (gloo's 30-minute default). Launched on CPU, the group is initialised here first, through accelerate as
        transformers would, with the timeout; transformers then finds it initialised. The hang watchdog starts first
        (under ``torchrun`` / ``accelerate launch``), so a rank frozen during the set-up is named within
        ``hang_timeout_s`` (:func:`~boost_hf.training.watchdog.watch_launch`)."""
        exit_with_launcher()
        watch_launch(self.hang_timeout_s, self.startup_timeout_s)
        try:
            if self.use_cpu and int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
                from accelerate import PartialState

                PartialState(cpu=True, backend=self.ddp_backend, timeout=self.ddp_timeout_delta)
            device = TrainingArguments._setup_devices.func(self)
        except Exception as error:
            missing = ranks_never_started()
            if not missing:
                raise
            raise RuntimeError(
                f"the process group could not be set up ({type(error).__name__}: {str(error).splitlines()[0][:200]}): "
                f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} never started (no heartbeat in the "
                "launcher's store: frozen or stuck before reaching the process group, e.g. while importing, or not "
                f"launched) within --ddp_timeout {self.ddp_timeout} s. Check that rank's node and output; lower "
                "--startup_timeout_s to stop sooner."
            ) from error
        enter_phase("start-up")
        return device

    def to_parallel_config(self, model_config=None) -> ParallelConfig:
        """The :class:`ParallelConfig` of these arguments; ``tp_style="auto"`` resolves with ``model_config``
        (btp for a low-rank model, megatron for a full-rank one; btp without a config)."""
        return config_of_training_arguments(self, model_config)


__all__ = ["BoostTrainingArguments", "DataParallelArguments", "LayoutArguments", "default_peak_tflops", "CPU_PEAK_TFLOPS"]

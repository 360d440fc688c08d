"""``ParallelConfig``: how a model is laid out across the tensor-parallel group and the pipeline stages.

Plain data: it imports no other boost-hf module. Each field is declared once, here, with its type (the
``Literal`` choices are the validation source), its default and its help text (``field(metadata={"help": ...})``);
the training arguments, the command-line options and the estimator's workload are generated from these fields
(:mod:`boost_hf.parallel.settings`). All fields are validated here, once, with errors that say what to change.

The single-device model file, which cannot import boost-hf, reaches the code that builds, loads and checks a
shard through this object's model-facing methods (and a parallel model saves through :meth:`ParallelConfig.save_pretrained`);
they call the functions that :mod:`boost_hf.checkpoint.model_hooks` registers (:func:`register_model_hooks`) when
``boost_hf`` is imported.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal, get_args

TPStyle = Literal["btp", "vanilla", "megatron"]
RMSNormMode = Literal["online", "sync", "local"]
CheckpointingMode = Literal["none", "full", "lowrank"]
SEQUENCE_PARALLEL_STYLES: tuple[str, ...] = ("megatron", "btp")
PipelineSchedule = Literal["1f1b", "gpipe", "interleaved-1f1b", "looped-bfs", "interleaved-zb", "zbv"]
#: schedules running several stages per rank (``pp_stages_per_rank`` defaults to 2 for them)
MULTI_STAGE_SCHEDULES = ("interleaved-1f1b", "looped-bfs", "interleaved-zb", "zbv")
#: schedules splitting backward into input and weight parts: refused (see ``_check_pipeline``)
ZERO_BUBBLE_SCHEDULES = ("interleaved-zb", "zbv")


def _setting(default, help_text: str):
    """A field of :class:`ParallelConfig`: its default and its help text (the one declaration of both)."""
    return field(default=default, metadata={"help": help_text})


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor-parallel and pipeline layout of a :class:`~boost_hf.BoostLlamaForCausalLM`; each field's help says
    what it does (``ParallelConfig.help(name)``)."""

    tp_size: int = _setting(1, "Ranks per tensor-parallel group; tp_size x pp_size must divide the world size.")
    tp_style: TPStyle = _setting(
        "btp",
        "'btp': bottleneck-aware TP (A row-parallel, B column-parallel, residual stream sharded along d, r-dim latents "
        "replicated); 'vanilla': the paper's naive low-rank TP (each (A, B) pair a Megatron MLP: A column-split along r, B "
        "row-split, full-width all-reduce); 'megatron': classic TP of a full-rank model (a full-rank model at tp_size 1 "
        "always runs it).",
    )
    rmsnorm: RMSNormMode = _setting(
        "online",
        "BTP's RMSNorm: 'online' (exact; the norm statistics travel in the same all-reduce as the next A's partial "
        "output), 'sync' (exact; one extra all-reduce of N scalars per norm) or 'local' (APPROXIMATE: each d/p shard "
        "normalised by its own statistics, a group norm that changes the model with tp_size; never the default).",
    )
    group_linears: bool = _setting(
        True,
        "Run the A's sharing an input (A_qkv, A_gate_up; Megatron: q/k/v and gate/up) as one GEMM with one collective "
        "(under BTP the latents their B's read are also copied in one collective); the parameters read together are row "
        "blocks of one buffer (no copy per step), their names and checkpoints unchanged.",
    )
    activation_checkpointing: CheckpointingMode = _setting(
        "none",
        "'none'; 'full' (recompute each decoder layer, re-running its forward collectives); 'lowrank' (keep only the "
        "r-dim latents and the residual; under BTP the recomputation issues no collective).",
    )
    sequence_parallel: bool = _setting(
        False,
        "Sequence parallelism over the TP group. 'megatron': Megatron-LM's: the residual stream, its norms and residual "
        "adds run on this rank's N/p tokens, each all-reduce becomes a reduce-scatter over tokens plus an all-gather (the "
        "same bytes). 'btp': latent sequence parallelism: each latent all-reduce becomes a reduce-scatter over tokens, the "
        "latent element-wise work runs on N/p tokens, an all-gather feeds the B's. The sequence length of each "
        "micro-batch must be divisible by tp_size (turn it off to generate, one token per step); a no-op at tp_size 1; "
        "not supported by 'vanilla'. Under pipeline parallelism a stage sends its token shards to the next.",
    )
    pp_size: int = _setting(
        1, "Pipeline ranks; the ranks are laid out (pp, dp, tp): pipeline outermost, TP ranks adjacent."
    )
    pp_schedule: PipelineSchedule = _setting(
        "1f1b",
        "Pipeline schedule: '1f1b', 'gpipe', 'interleaved-1f1b' or 'looped-bfs' (several stages per rank); the "
        "zero-bubble schedules ('interleaved-zb', 'zbv') are refused with the reason.",
    )
    pp_microbatches: int | None = _setting(
        None, "Micro-batches a pipeline step splits its batch into (default: the number of stages; 1F1B needs at least that many)."
    )
    pp_stages_per_rank: int | None = _setting(
        None, "Model chunks each pipeline rank holds (default: 2 for the interleaved schedules, else 1)."
    )
    pp_layer_split: tuple[int, ...] | None = _setting(
        None,
        "Decoder layers of each stage, first to last (default: as even as possible, earlier stages taking the "
        "remainder); e.g. 3,5,5,3 gives the first and last stages fewer layers for the embedding and the head and loss.",
    )

    def __post_init__(self) -> None:
        if not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ValueError(f"tp_size must be a positive integer, got {self.tp_size!r}.")
        for name, kind in (("tp_style", TPStyle), ("rmsnorm", RMSNormMode), ("activation_checkpointing", CheckpointingMode)):
            if getattr(self, name) not in get_args(kind):
                raise ValueError(f"Unknown {name} {getattr(self, name)!r}: use one of {', '.join(get_args(kind))}.")
        if not isinstance(self.group_linears, bool):
            raise ValueError(f"group_linears must be True or False, got {self.group_linears!r}.")
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(f"sequence_parallel must be True or False, got {self.sequence_parallel!r}.")
        if self.sequence_parallel and self.tp_style not in SEQUENCE_PARALLEL_STYLES:
            raise ValueError(
                f"sequence_parallel=True is not supported by tp_style={self.tp_style!r} yet (only by "
                f"{', '.join(map(repr, SEQUENCE_PARALLEL_STYLES))}): set sequence_parallel=False."
            )
        self._check_pipeline()

    def _check_pipeline(self) -> None:
        for name in ("pp_size", "pp_microbatches", "pp_stages_per_rank"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        if self.pp_schedule not in get_args(PipelineSchedule):
            supported = [name for name in get_args(PipelineSchedule) if name not in ZERO_BUBBLE_SCHEDULES]
            raise ValueError(f"Unknown pp_schedule {self.pp_schedule!r}: use one of {', '.join(supported)}.")
        if self.pp_schedule in ZERO_BUBBLE_SCHEDULES:
            raise ValueError(
                f"pp_schedule={self.pp_schedule!r} is not supported: zero-bubble schedules split each backward into an "
                "input part (torch.autograd.grad to the stage's inputs, after which the engine detaches the stage's "
                "outputs in place) and a later weight part, and boost-hf does not follow that split yet: activation "
                "checkpointing recomputes through re-entrant torch.utils.checkpoint, which refuses autograd.grad; the weight "
                "part assigns .grad itself, past DDP's hooks, so at dp > 1 DDP does not average them (wrong gradients); "
                "LaX's shared latents leave a stage as a view, which cannot be detached in place; and 'zbv' needs a "
                "V-shaped stage placement that the pipeline does not lay out. Use pp_schedule='interleaved-1f1b' (a "
                "smaller bubble than '1f1b' with 2 stages per rank)."
            )
        if self.pp_layer_split is not None:
            split = tuple(self.pp_layer_split)
            if not all(isinstance(n, int) and n >= 1 for n in split):
                raise ValueError(f"pp_layer_split must list a positive number of layers per stage, got {self.pp_layer_split!r}.")
            object.__setattr__(self, "pp_layer_split", split)
        per_rank = self.stages_per_rank
        if self.pp_schedule not in MULTI_STAGE_SCHEDULES and per_rank != 1:
            raise ValueError(
                f"pp_schedule={self.pp_schedule!r} runs one stage per rank, got pp_stages_per_rank={per_rank}: use "
                "pp_schedule='interleaved-1f1b' for several stages per rank, or pp_stages_per_rank=1."
            )
        if self.pp_schedule == "1f1b" and self.microbatches < self.num_stages:
            raise ValueError(
                f"pp_schedule='1f1b' needs at least as many micro-batches as stages ({self.num_stages}), got "
                f"pp_microbatches={self.microbatches}: set pp_microbatches >= {self.num_stages} (more shrink the bubble)."
            )
        if self.pp_layer_split is not None and len(self.pp_layer_split) != self.num_stages:
            raise ValueError(
                f"pp_layer_split lists {len(self.pp_layer_split)} stages, but pp_size={self.pp_size} x "
                f"{per_rank} stage(s) per rank makes {self.num_stages}: give one layer count per stage."
            )

    @property
    def stages_per_rank(self) -> int:
        """Model chunks per pipeline rank (``pp_stages_per_rank`` or the schedule's default)."""
        if self.pp_stages_per_rank is not None:
            return self.pp_stages_per_rank
        return 2 if self.pp_schedule in MULTI_STAGE_SCHEDULES and self.pp_size > 1 else 1

    @property
    def num_stages(self) -> int:
        """Pipeline stages in all (``pp_size x stages_per_rank``)."""
        return self.pp_size * self.stages_per_rank

    @property
    def microbatches(self) -> int:
        """Micro-batches per pipeline step (``pp_microbatches``, default the number of stages)."""
        return self.pp_microbatches if self.pp_microbatches is not None else self.num_stages

    def stage_layers(self, num_hidden_layers: int) -> list[range]:
        """The decoder layers of each stage, first to last (``pp_layer_split`` or an even split, earlier
        stages taking the remainder)."""
        split = self.pp_layer_split
        if split is None:
            base, extra = divmod(num_hidden_layers, self.num_stages)
            split = tuple(base + (1 if stage < extra else 0) for stage in range(self.num_stages))
        starts = [sum(split[:stage]) for stage in range(len(split))]
        return [range(start, start + count) for start, count in zip(starts, split)]

    @staticmethod
    def help(name: str) -> str:
        """The help text of field ``name``."""
        return ParallelConfig.__dataclass_fields__[name].metadata["help"]

    # The single-device model file reaches boost-hf through the last three (it never imports boost-hf itself);
    # check_model is the same check for callers holding a model config. Each calls the function of the same name in
    # boost_hf.checkpoint.model_hooks.
    def check_model(self, config) -> None:
        """Raise ``ValueError`` naming the field to change if this layout cannot hold ``config``."""
        _hooks().check_model(config, self)

    def single_device_skeleton(self):
        """Context in which the single-device modules are built on the meta device, uninitialised."""
        return _hooks().single_device_skeleton()

    def parallelize(self, model):
        """Shard ``model`` in place for this rank (see :func:`boost_hf.parallel.parallelize`)."""
        return _hooks().parallelize(model, self)

    def load_pretrained(self, model_class, pretrained_model_name_or_path, *model_args, **kwargs):
        """``model_class.from_pretrained(..., parallel_config=self)``: this rank's shard, reading only this
        rank's slices (see :func:`boost_hf.checkpoint.model_hooks.load_pretrained`)."""
        return _hooks().load_pretrained(model_class, pretrained_model_name_or_path, self, *model_args, **kwargs)

    def save_pretrained(self, model, save_directory: str, *, is_main_process: bool, max_shard_size=None) -> None:
        """Collective: the single-device model's folder written from every rank's shards of ``model`` (see
        :func:`boost_hf.checkpoint.export.save_sharded_pretrained`)."""
        _hooks().save_pretrained(model, save_directory, is_main_process=is_main_process, max_shard_size=max_shard_size)

    def to_dict(self) -> dict:
        return asdict(self)


_model_hooks = None


def register_model_hooks(hooks) -> None:
    """Install what :class:`ParallelConfig`'s model-facing methods call: an object with ``check_model(config,
    parallel)``, ``single_device_skeleton()``, ``parallelize(model, parallel)``, ``load_pretrained(model_class,
    path, parallel, *args, **kwargs)`` and ``save_pretrained(model, save_directory, *, is_main_process,
    max_shard_size)`` (:mod:`boost_hf.checkpoint.model_hooks` registers itself when imported)."""
    global _model_hooks
    _model_hooks = hooks


def _hooks():
    if _model_hooks is None:
        raise RuntimeError("boost-hf's model hooks are not loaded: import boost_hf (which loads boost_hf.checkpoint.model_hooks).")
    return _model_hooks


__all__ = ["ParallelConfig", "register_model_hooks", "TPStyle", "RMSNormMode", "CheckpointingMode", "PipelineSchedule", "MULTI_STAGE_SCHEDULES", "ZERO_BUBBLE_SCHEDULES"]

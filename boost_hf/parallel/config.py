"""``ParallelConfig``: how a model is laid out across the tensor-parallel group and the pipeline stages.

All fields are validated here, once, with errors that say what to change.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
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


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor-parallel layout of a :class:`~boost_hf.BoostLlamaForCausalLM`.

    Args:
        tp_size: ranks per tensor-parallel group (must divide the world size).
        tp_style: ``"btp"`` bottleneck-aware TP (A row-parallel, B column-parallel, residual stream
            sharded along d, r-dim latents replicated); ``"vanilla"`` the paper's naive low-rank TP (each
            (A, B) pair a Megatron MLP: A column-split along r, B row-split, full-width all-reduce);
            ``"megatron"`` classic TP of a full-rank model. Default: ``"btp"`` for low-rank models.
        rmsnorm: BTP only. ``"online"`` (exact; the norm statistics travel in the same all-reduce as the
            next A's partial output), ``"sync"`` (exact; one extra all-reduce of N scalars per norm) or
            ``"local"`` (APPROXIMATE: normalises each d/p shard by its own statistics, a group norm that
            changes the model with tp_size; never the default).
        group_linears: low-rank layouts run the A's that share an input (A_qkv, A_gate_up) as one GEMM
            with one collective (and, under BTP, copy the latents their B's read in one collective);
            Megatron runs q/k/v and gate/up as one GEMM each (one collective either way). The parameters a
            group reads together are stored as row blocks of one buffer (no copy per step); checkpoint names
            and parameters are unchanged.
        activation_checkpointing: ``"none"``; ``"full"`` (recompute each decoder layer, re-running its
            forward collectives); ``"lowrank"`` (save only r-dim latents and the residual; under BTP the
            recomputation issues no collective).
        sequence_parallel: ``"megatron"``: Megatron-LM's sequence parallelism: the residual stream, its norms
            and residual adds run on this rank's ``N/p`` tokens; each all-reduce of a layer becomes a
            reduce-scatter over tokens (after o and down) plus an all-gather (before q/k/v and gate/up): the
            same bytes, ``1/p`` of the element-wise work and of the residual kept for backward. ``"btp"``:
            latent sequence parallelism: each latent all-reduce becomes a
            reduce-scatter over tokens, the latent element-wise work runs on ``N/p`` tokens, and an all-gather
            feeds the B's (the residual stays sharded along ``d``). The sequence length of each micro-batch
            must be divisible by ``tp_size`` (checked at each forward); for generation (one new token per
            step) turn it off. A no-op at ``tp_size=1``; not supported by ``"vanilla"``. Under pipeline
            parallelism a stage sends its token shards to the next (:mod:`boost_hf.parallel.pipeline`).
        pp_size: pipeline ranks (``tp_size x pp_size`` must divide the world size; the ranks are laid out as
            ``("pp", "dp", "tp")``, pipeline outermost, TP ranks adjacent). See :mod:`boost_hf.parallel.pipeline`.
        pp_schedule: ``"1f1b"`` (default), ``"gpipe"``, ``"interleaved-1f1b"``, ``"looped-bfs"`` (several stages
            per rank). The zero-bubble schedules (``"interleaved-zb"``, ``"zbv"``) are refused with the reason.
        pp_microbatches: micro-batches a pipeline step splits its batch into (default: the number of stages;
            1F1B needs at least that many).
        pp_stages_per_rank: model chunks each pipeline rank holds (default 2 for the interleaved schedules, else 1).
        pp_layer_split: decoder layers of each stage, first to last (default: as even as possible); e.g.
            ``(3, 5, 5, 3)`` gives the first and last stages fewer layers for the embedding and the head and loss.
    """

    tp_size: int = 1
    tp_style: TPStyle = "btp"
    rmsnorm: RMSNormMode = "online"
    group_linears: bool = True
    activation_checkpointing: CheckpointingMode = "none"
    sequence_parallel: bool = False
    pp_size: int = 1
    pp_schedule: PipelineSchedule = "1f1b"
    pp_microbatches: int | None = None
    pp_stages_per_rank: int | None = None
    pp_layer_split: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ValueError(f"tp_size must be a positive integer, got {self.tp_size!r}.")
        for field, kind in (("tp_style", TPStyle), ("rmsnorm", RMSNormMode), ("activation_checkpointing", CheckpointingMode)):
            if getattr(self, field) not in get_args(kind):
                raise ValueError(f"Unknown {field} {getattr(self, field)!r}: use one of {', '.join(get_args(kind))}.")
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
        for field in ("pp_size", "pp_microbatches", "pp_stages_per_rank"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{field} must be a positive integer, got {value!r}.")
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

    @property
    def shards_tokens(self) -> bool:
        """Sequence parallelism is on and there is more than one rank to shard the tokens over."""
        return self.sequence_parallel and self.tp_size > 1

    def check_model(self, config) -> None:
        """Raise ``ValueError`` naming the field to change if this layout cannot hold ``config``."""
        from .parallelize import layout_for

        layout_for(config, self)
        if self.pp_size > 1:
            from .pipeline import check_pipeline_model

            check_pipeline_model(config, self)

    # The single-device model file calls these three (it never imports boost-hf itself).
    def single_device_skeleton(self):
        """Context in which the single-device modules are built on the meta device, uninitialised."""
        from .parallelize import single_device_skeleton

        return single_device_skeleton()

    def parallelize(self, model):
        """Shard ``model`` in place for this rank (see :func:`boost_hf.parallel.parallelize`)."""
        from .parallelize import parallelize

        return parallelize(model, self)

    def load_pretrained(self, model_class, pretrained_model_name_or_path, *model_args, **kwargs):
        """``model_class.from_pretrained(..., parallel_config=self)``: this rank's shard, reading only this
        rank's slices (see :func:`boost_hf.parallel.weights_io.load_pretrained`)."""
        from .weights_io import load_pretrained

        return load_pretrained(model_class, pretrained_model_name_or_path, self, *model_args, **kwargs)

    def to_dict(self) -> dict:
        return asdict(self)


__all__ = ["ParallelConfig", "TPStyle", "RMSNormMode", "CheckpointingMode", "PipelineSchedule", "MULTI_STAGE_SCHEDULES", "ZERO_BUBBLE_SCHEDULES"]

"""``DataParallelConfig``: how the data-parallel ranks hold the model, declared once.

Plain data (it imports no boost-hf module but :mod:`boost_hf.option_fields`, which generates the options), as :class:`~boost_hf.parallel.config.ParallelConfig` is for the
tensor-parallel and pipeline layout and :class:`~boost_hf.precision_config.PrecisionConfig` for the precision: each
setting is one field with its ``Literal`` choices, its default and its help. The training arguments
(``--data_parallel``, ``--dp_replicate_size``, ``--fsdp_reshard_after_forward``) and the options of ``boost-hf plan``
are generated from these fields (:func:`data_parallel_training_fields`, :func:`add_data_parallel_options`). The other
ways of asking for FSDP2 (transformers' ``--fsdp`` with ``fsdp_config``, an accelerate config with
``distributed_type: FSDP`` and ``fsdp_version: 2``, accelerate's ``parallelism_config`` ``dp_shard_size`` /
``dp_replicate_size``) are written onto the same fields (:mod:`boost_hf.training.compatibility`).

The data-parallel ranks are what is left of the world, ``dp = world / (tp_size x pp_size)``; each holds its TP and
pipeline rank's shards of the model (:mod:`boost_hf.parallel.state`), and:

* ``ddp``: a whole copy of them, the gradients all-reduced over the DP group (``DistributedDataParallel``, or the fp32
  master parameters' own reduction under ``bf16_params``); ``--zero1_optimizer`` shards the optimizer state;
* ``fsdp2``: ``1/dp`` of them (each parameter's dim 0), with torch's ``fully_shard`` over the DP group: the parameters
  are all-gathered before each decoder layer runs and the gradients reduce-scattered (parameters, gradients and
  optimizer state sharded: ZeRO-3); with ``dp_replicate_size`` R > 1, HSDP: ``R`` replicas, each sharding over
  ``dp / R`` ranks, the gradients all-reduced across the replicas (:mod:`boost_hf.parallel.fully_shard`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal, get_args

from .option_fields import add_field_options, field_types, setting, settings_of, training_fields

DataParallelName = Literal["ddp", "fsdp2"]
ReshardAfterForward = Literal["default", "always", "never"]
FullyShardUnits = Literal["decoder_layers", "model"]
#: every data-parallel backend, in the order the tools list them
DATA_PARALLEL_BACKENDS: tuple[str, ...] = get_args(DataParallelName)


@dataclass(frozen=True)
class DataParallelConfig:
    """How the data-parallel ranks hold the model (see the module docstring)."""

    data_parallel: DataParallelName = setting(
        "ddp",
        "ddp: every data-parallel rank holds its TP/pipeline rank's whole shards and the gradients are all-reduced over "
        "the DP group (--zero1_optimizer shards the optimizer state); fsdp2: torch's fully_shard over the DP group, "
        "each decoder layer's parameters all-gathered before it runs and its gradients reduce-scattered (parameters, "
        "gradients and optimizer state sharded over DP; composes with tp_size and pp_size).",
    )
    dp_replicate_size: int = setting(
        1,
        "fsdp2 only: HSDP, the data-parallel ranks as dp_replicate_size replicas each sharding the model over "
        "dp / dp_replicate_size ranks (the gradients reduce-scattered inside a replica, then all-reduced across them); "
        "1 shards over the whole DP group.",
    )
    fsdp_reshard_after_forward: ReshardAfterForward = setting(
        "default",
        "fsdp2 only: whether a decoder layer frees its gathered parameters after its forward (and gathers them again for "
        "its backward). default: torchtitan's, every layer but the last without pipeline parallelism, none under it "
        "(each micro-batch would gather again); always; never (the gathered parameters kept from forward to backward).",
    )

    fsdp_units: FullyShardUnits = setting(
        "decoder_layers",
        "fsdp2 only: what is gathered at once. decoder_layers: each decoder layer, then the rest of the model (the "
        "embedding, final norm and LM head; torchtitan's, accelerate's TRANSFORMER_BASED_WRAP); model: the whole model "
        "(or pipeline stage) as one unit (accelerate's NO_WRAP).",
    )

    def __post_init__(self) -> None:
        for name, kind in (("data_parallel", DataParallelName), ("fsdp_reshard_after_forward", ReshardAfterForward),
                           ("fsdp_units", FullyShardUnits)):
            if getattr(self, name) not in get_args(kind):
                raise ValueError(f"{name} must be one of {', '.join(get_args(kind))}, got {getattr(self, name)!r}.")
        if not isinstance(self.dp_replicate_size, int) or isinstance(self.dp_replicate_size, bool) or self.dp_replicate_size < 1:
            raise ValueError(f"dp_replicate_size must be a positive integer, got {self.dp_replicate_size!r}.")
        if self.data_parallel != "fsdp2":
            if self.dp_replicate_size != 1:
                raise ValueError(
                    f"dp_replicate_size={self.dp_replicate_size} is HSDP's (replicas of a model sharded with FSDP2): add "
                    "--data_parallel fsdp2, or drop it (under ddp every data-parallel rank is a replica already)."
                )
            for name, default in (("fsdp_reshard_after_forward", "default"), ("fsdp_units", "decoder_layers")):
                if getattr(self, name) != default:
                    raise ValueError(f"{name}={getattr(self, name)!r} sets how FSDP2 shards: add --data_parallel fsdp2, or "
                                     "drop it.")

    @property
    def fully_sharded(self) -> bool:
        return self.data_parallel == "fsdp2"

    def shard_size(self, dp_size: int) -> int:
        """Ranks each parameter is sharded over (``fsdp2``): ``dp / dp_replicate_size``; ``ValueError`` naming the fix
        when ``dp_replicate_size`` does not divide ``dp_size``."""
        if dp_size % self.dp_replicate_size:
            raise ValueError(
                f"dp_replicate_size={self.dp_replicate_size} does not divide the data-parallel size {dp_size} (world / "
                "(tp_size x pp_size)): choose replicas that divide it, or launch a multiple of them."
            )
        return dp_size // self.dp_replicate_size

    @classmethod
    def of(cls, args) -> DataParallelConfig:
        """The data-parallel settings that ``args`` (training arguments, an ``argparse`` namespace) holds."""
        return settings_of(cls, args)


def data_parallel_training_fields() -> list[tuple[str, object, object]]:
    """``BoostTrainingArguments``' data-parallel fields, for ``dataclasses.make_dataclass``: ``(name, type, field)``,
    each unset (``None``) unless given, so that a value given (``ddp`` and 1 included) is told from none and checked
    against the other sources of the setting (an accelerate config, ``parallelism_config``, transformers' ``--fsdp``:
    :mod:`boost_hf.training.compatibility`), which then leave the declared default where none sets it."""
    kinds = field_types(DataParallelConfig)
    names = [f.name for f in fields(DataParallelConfig)]
    return training_fields(DataParallelConfig, kinds={name: kinds[name] | None for name in names},
                           defaults=dict.fromkeys(names), notes=dict.fromkeys(names, (
                               " Unset: this default, or what an accelerate config, parallelism_config or transformers' "
                               "--fsdp sets; given with them, they must agree.")))


def add_data_parallel_options(parser, *, exclude: tuple[str, ...] = (), several: bool = False,
                              defaults: dict | None = None, notes: dict | None = None) -> None:
    """Add the data-parallel fields but ``exclude`` to ``parser`` (or an argument group) under their names
    (``--data_parallel`` and ``--data-parallel``, ...); ``several``: ``--data_parallel`` takes several backends (a
    search, default all of them); ``defaults`` (e.g. ``None``: searched) and ``notes`` (appended to the help) are the
    command's own."""
    defaults = {"data_parallel": None, **(defaults or {})} if several else defaults
    add_field_options(DataParallelConfig, parser, exclude=exclude, defaults=defaults, notes=notes,
                      several=("data_parallel",) if several else ())


__all__ = [
    "DATA_PARALLEL_BACKENDS",
    "DataParallelConfig",
    "DataParallelName",
    "FullyShardUnits",
    "ReshardAfterForward",
    "add_data_parallel_options",
    "data_parallel_training_fields",
]

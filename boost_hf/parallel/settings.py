"""The layout settings as the interfaces expose them, generated from :class:`~boost_hf.parallel.config.ParallelConfig`'s
fields, the one declaration of each setting's name, type (``Literal`` choices), default and help.

* :func:`add_options` adds them to an ``argparse`` parser (``boost-hf estimate``): ``--name`` and ``--name-with-dashes``,
  plus the short spellings of :data:`SHORT_NAMES` (``--tp``, ``--pp``, ``--microbatches``, ...).
* :func:`training_fields` are ``BoostTrainingArguments``' layout fields (``HfArgumentParser`` parses them from the
  command line and from recipes); :func:`config_of_training_arguments` turns them back into a ``ParallelConfig``.

What differs from the declaration is stated here, once (a command adding the options states its own defaults):

* ``activation_checkpointing`` is ``activation_checkpointing_mode`` among the training arguments
  (:data:`TRAINING_NAMES`): the Trainer owns ``activation_checkpointing`` (passing it selects ``"full"``).
* ``tp_style`` also takes ``"auto"``, the training default: btp for a low-rank model, megatron for a full-rank one,
  resolved with the model config.
* ``tp_size`` defaults to ``None`` among the training arguments (unset: 1, or the ``tp_size`` of accelerate's
  ``parallelism_config``), so that a value given (1 included) is told from the default and checked against
  accelerate's (:func:`~boost_hf.training.compatibility.layout_from_parallelism_config`); so does
  ``activation_checkpointing_mode`` (unset: ``none``, or ``full`` where the Trainer's switch or FSDP's
  ``activation_checkpointing`` asks for it).
* ``pp_layer_split`` is a comma-separated list on the command line (``3,5,5,3``) and a YAML list in a recipe
  (:func:`parse_layer_split`).
* ``sequence_parallel`` at training time also needs ``sample_max_new_tokens=0`` (generation feeds one token per step).
"""

from __future__ import annotations

import argparse
from dataclasses import Field, fields
from typing import Literal, get_args

from ..option_fields import add_field_options, field_types
from ..option_fields import training_fields as fields_for_training
from .config import ParallelConfig, TPStyle

#: every field's type, resolved (``config.py`` writes its annotations as strings)
FIELD_TYPES: dict[str, object] = field_types(ParallelConfig)

#: command-line spellings besides the field's own name (kept from earlier releases of ``boost-hf estimate``), also
#: accepted as keywords by :class:`~boost_hf.perf.workload.Workload`
SHORT_NAMES: dict[str, tuple[str, ...]] = {
    "tp_size": ("tp",),
    "pp_size": ("pp",),
    "pp_stages_per_rank": ("stages_per_rank",),
    "pp_microbatches": ("microbatches", "num_micro_batches"),
    "activation_checkpointing": ("checkpointing", "activation_checkpointing_mode"),
}

#: field -> training-argument name, where they differ (the Trainer owns ``activation_checkpointing``)
TRAINING_NAMES: dict[str, str] = {"activation_checkpointing": "activation_checkpointing_mode"}
_TRAINING_TYPES: dict[str, object] = {
    "tp_style": Literal[("auto", *get_args(TPStyle))],
    "tp_size": int | None,  # None: unset (1, or accelerate's parallelism_config tp_size)
    "activation_checkpointing": FIELD_TYPES["activation_checkpointing"] | None,  # None: unset (none, or FSDP's or the Trainer's)
    "pp_layer_split": list[str] | None,  # what HfArgumentParser reads (nargs="+"); parse_layer_split makes it ints
}
_TRAINING_DEFAULTS: dict[str, object] = {"tp_style": "auto", "tp_size": None, "activation_checkpointing": None}
_TRAINING_NOTES: dict[str, str] = {
    "tp_size": " Unset: 1, or the tp_size of accelerate's parallelism_config; given both, they must agree (1 included).",
    "tp_style": " At training time also 'auto' (the default): btp for a low-rank model, megatron for a full-rank one.",
    "activation_checkpointing": " It replaces the Trainer's activation_checkpointing flag, which boost-hf models do not "
    "use: passing that flag selects 'full'. Unset: none, or full where the Trainer's flag or FSDP's "
    "activation_checkpointing asks for it; given with them, they must agree (lowrank agrees).",
    "sequence_parallel": " With tp_size > 1 the end-of-training sample cannot be generated: pass --sample_max_new_tokens 0.",
    "pp_layer_split": " On the command line a comma-separated list (--pp_layer_split 3,5,5,3), in a recipe a YAML list.",
}


def field_of(name: str) -> str:
    """The ``ParallelConfig`` field that ``name`` (the field itself, a short or a training name) spells."""
    for field_name, short in SHORT_NAMES.items():
        if name in short:
            return field_name
    return {training: field_name for field_name, training in TRAINING_NAMES.items()}.get(name, name)


def parse_layer_split(value) -> tuple[int, ...] | None:
    """``pp_layer_split`` from ``"3,5,5,3"``, ``["3", "5"]`` (the command line), ``[3, 5]`` (a recipe) or a tuple;
    ``ValueError`` naming the field otherwise."""
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else [part for item in value for part in str(item).split(",")]
    try:
        return tuple(int(item) for item in items if item.strip())
    except ValueError:
        raise ValueError(f"pp_layer_split must list whole numbers of layers per stage, e.g. 3,5,5,3; got {value!r}.") from None


def _layer_split(text: str) -> tuple[int, ...]:
    try:
        return parse_layer_split(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_options(parser, *, exclude: tuple[str, ...] = (), defaults: dict | None = None, notes: dict | None = None) -> None:
    """Add every ``ParallelConfig`` field but ``exclude`` to ``parser`` (or an argument group) as an option whose
    ``dest`` is the field's name, with the short spellings of :data:`SHORT_NAMES`; ``defaults`` and ``notes`` (appended
    to the help) are the command's own."""
    add_field_options(ParallelConfig, parser, exclude=exclude, defaults=defaults, notes=notes, short_names=SHORT_NAMES,
                      parsers={"pp_layer_split": _layer_split}, metavars={"pp_layer_split": "N,N,..."})


def layout_values(namespace) -> dict:
    """The layout fields that an ``argparse`` namespace holds (those :func:`add_options` added), by field name."""
    return {f.name: getattr(namespace, f.name) for f in fields(ParallelConfig) if hasattr(namespace, f.name)}


def training_fields() -> list[tuple[str, object, Field]]:
    """``BoostTrainingArguments``' layout fields, for ``dataclasses.make_dataclass``: ``(name, type, field)``."""
    return fields_for_training(ParallelConfig, names=TRAINING_NAMES, kinds=_TRAINING_TYPES, defaults=_TRAINING_DEFAULTS,
                               notes=_TRAINING_NOTES)


def config_of_training_arguments(args, model_config=None) -> ParallelConfig:
    """The :class:`ParallelConfig` of training arguments ``args``; ``tp_style="auto"`` resolves with ``model_config``
    (btp for a low-rank model, megatron for a full-rank one; btp without a config)."""
    values = {f.name: getattr(args, TRAINING_NAMES.get(f.name, f.name)) for f in fields(ParallelConfig)}
    if values["tp_style"] == "auto":
        values["tp_style"] = "megatron" if model_config is not None and model_config.bottleneck is None else "btp"
    values["pp_layer_split"] = parse_layer_split(values["pp_layer_split"])
    return ParallelConfig(**values)


__all__ = [
    "FIELD_TYPES",
    "SHORT_NAMES",
    "TRAINING_NAMES",
    "add_options",
    "config_of_training_arguments",
    "field_of",
    "layout_values",
    "parse_layer_split",
    "training_fields",
]

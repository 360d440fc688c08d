"""``PrecisionConfig``: the precision a run trains in, declared once.

Plain data (it imports no other boost-hf module), as :class:`~boost_hf.parallel.config.ParallelConfig` is for the
layout: each setting is one field with its ``Literal`` choices, its default and its help. The training arguments
(``--precision_policy``, ``--grad_reduce_dtype``, ``--fp32_residual``) and the options of ``boost-hf plan`` and
``boost-hf estimate`` are generated from these fields (:func:`add_precision_options`, :func:`precision_training_fields`);
:func:`~boost_hf.training.precision.resolve_precision` resolves them, once, with the half precision asked for
(``--bf16``, accelerate's or DeepSpeed's), into the policy a run applies; the memory model and the estimator read the
same policy names (:data:`PRECISION_POLICIES`).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field, fields
from typing import Literal, get_args

PrecisionPolicyName = Literal["fp32", "autocast", "bf16_params"]
GradReduceDtype = Literal["fp32", "bf16"]
#: every policy, in the order the tools list them
PRECISION_POLICIES: tuple[str, ...] = get_args(PrecisionPolicyName)


def _setting(default, help_text: str):
    return field(default=default, metadata={"help": help_text})


@dataclass(frozen=True)
class PrecisionConfig:
    """How a run computes, stores, accumulates and reduces (see :mod:`boost_hf.training.precision`)."""

    precision_policy: PrecisionPolicyName | None = _setting(
        None,
        "fp32 (no half precision), autocast (fp32 parameters under bf16 autocast; the default with fp16) or "
        "bf16_params (bf16 parameters, fp32 masters and gradient accumulation/reduction; the default with bf16). "
        "DeepSpeed bf16 is bf16_params.",
    )
    grad_reduce_dtype: GradReduceDtype | None = _setting(
        None, "bf16_params: dtype of the data-parallel gradient all-reduce, fp32 (default) or bf16."
    )
    fp32_residual: bool = _setting(
        False, "bf16_params: keep the residual stream in fp32 (Megatron's fp32_residual_connection)."
    )

    def __post_init__(self) -> None:
        for name, kind in (("precision_policy", PrecisionPolicyName), ("grad_reduce_dtype", GradReduceDtype)):
            value = getattr(self, name)
            if value is not None and value not in get_args(kind):
                raise ValueError(f"{name} must be one of {', '.join(get_args(kind))}, got {value!r}.")
        if not isinstance(self.fp32_residual, bool):
            raise ValueError(f"fp32_residual must be True or False, got {self.fp32_residual!r}.")

    @classmethod
    def of(cls, args) -> PrecisionConfig:
        """The precision settings that ``args`` (training arguments, an ``argparse`` namespace) holds."""
        return cls(**{f.name: getattr(args, f.name, f.default) for f in fields(cls)})

    @staticmethod
    def help(name: str) -> str:
        return PrecisionConfig.__dataclass_fields__[name].metadata["help"]


def _choices(name: str) -> tuple[str, ...] | None:
    kind = typing.get_type_hints(PrecisionConfig)[name]
    literal = next((arg for arg in get_args(kind) if typing.get_origin(arg) is Literal), None)
    return get_args(literal) if literal is not None else None


def precision_training_fields() -> list[tuple[str, object, object]]:
    """``BoostTrainingArguments``' precision fields, for ``dataclasses.make_dataclass``: ``(name, type, field)``."""
    hints = typing.get_type_hints(PrecisionConfig)
    return [(f.name, hints[f.name], field(default=f.default, metadata=dict(f.metadata))) for f in fields(PrecisionConfig)]


def add_precision_options(parser, *, exclude: tuple[str, ...] = (), several: bool = False, defaults: dict | None = None,
                          notes: dict | None = None) -> None:
    """Add the precision fields but ``exclude`` to ``parser`` (or an argument group) under their names
    (``--precision_policy`` and ``--precision-policy``, ...); ``several``: ``--precision_policy`` takes several
    policies (a search); ``defaults`` and ``notes`` (appended to the help) are the command's own."""
    defaults, notes = defaults or {}, notes or {}
    for f in fields(PrecisionConfig):
        if f.name in exclude:
            continue
        spellings = [f"--{f.name}"] + [f"--{f.name.replace('_', '-')}"]
        options = dict(dest=f.name, default=defaults.get(f.name, f.default),
                       help=(f.metadata["help"] + notes.get(f.name, "")).replace("%", "%%"))
        if f.name == "fp32_residual":
            parser.add_argument(*spellings, type=lambda text: text.lower() in ("true", "yes", "1"), nargs="?", const=True, **options)
        elif f.name == "precision_policy" and several:
            parser.add_argument(*spellings, nargs="+", choices=_choices(f.name), **options)
        else:
            parser.add_argument(*spellings, choices=_choices(f.name), **options)


__all__ = [
    "GradReduceDtype",
    "PRECISION_POLICIES",
    "PrecisionConfig",
    "PrecisionPolicyName",
    "add_precision_options",
    "precision_training_fields",
]

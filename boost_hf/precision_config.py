"""``PrecisionConfig``: the precision a run trains in, declared once.

Plain data (it imports no boost-hf module but :mod:`boost_hf.option_fields`, which generates the options), as :class:`~boost_hf.parallel.config.ParallelConfig` is for the
layout: each setting is one field with its ``Literal`` choices, its default and its help. The training arguments
(``--precision_policy``, ``--grad_reduce_dtype``, ``--fp32_residual``) and the options of ``boost-hf plan`` and
``boost-hf estimate`` are generated from these fields (:func:`add_precision_options`, :func:`precision_training_fields`);
:func:`~boost_hf.training.precision.resolve_precision` resolves them, once, with the half precision asked for
(``--bf16``, accelerate's or DeepSpeed's), into the policy a run applies; the memory model and the estimator read the
same policy names (:data:`PRECISION_POLICIES`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from .option_fields import add_field_options, setting, settings_of, training_fields

PrecisionPolicyName = Literal["fp32", "autocast", "bf16_params"]
GradReduceDtype = Literal["fp32", "bf16"]
#: every policy, in the order the tools list them
PRECISION_POLICIES: tuple[str, ...] = get_args(PrecisionPolicyName)


@dataclass(frozen=True)
class PrecisionConfig:
    """How a run computes, stores, accumulates and reduces (see :mod:`boost_hf.training.precision`)."""

    precision_policy: PrecisionPolicyName | None = setting(
        None,
        "fp32 (no half precision), autocast (fp32 parameters under bf16 autocast; the default with fp16) or "
        "bf16_params (bf16 parameters, fp32 masters and gradient accumulation/reduction; the default with bf16). "
        "DeepSpeed bf16 is bf16_params.",
    )
    grad_reduce_dtype: GradReduceDtype | None = setting(
        None, "bf16_params: dtype of the data-parallel gradient all-reduce, fp32 (default) or bf16."
    )
    fp32_residual: bool = setting(
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
        return settings_of(cls, args)


def precision_training_fields() -> list[tuple[str, object, object]]:
    """``BoostTrainingArguments``' precision fields, for ``dataclasses.make_dataclass``: ``(name, type, field)``."""
    return training_fields(PrecisionConfig)


def add_precision_options(parser, *, exclude: tuple[str, ...] = (), several: bool = False, defaults: dict | None = None,
                          notes: dict | None = None) -> None:
    """Add the precision fields but ``exclude`` to ``parser`` (or an argument group) under their names
    (``--precision_policy`` and ``--precision-policy``, ...); ``several``: ``--precision_policy`` takes several
    policies (a search); ``defaults`` and ``notes`` (appended to the help) are the command's own."""
    add_field_options(PrecisionConfig, parser, exclude=exclude, defaults=defaults, notes=notes,
                      several=("precision_policy",) if several else ())


__all__ = [
    "GradReduceDtype",
    "PRECISION_POLICIES",
    "PrecisionConfig",
    "PrecisionPolicyName",
    "add_precision_options",
    "precision_training_fields",
]

"""Type and range checks of every ``BoostLlamaConfig`` field, with errors that say what to change.

:func:`check_config_fields` is meant to run first in ``BoostLlamaConfig.validate()`` (the one place where
model configurations are validated), before any arithmetic on the fields: a ``"512"`` or ``512.0`` given
for an integer field, an unknown activation or a negative ``initializer_range`` then fails with a
``TypeError``/``ValueError`` naming the field, instead of a cryptic error deep in the model.

It reads only the fields set by ``BoostLlamaConfig.__init__`` before ``validate()``; the special token ids
(set later by ``PretrainedConfig.__init__``) are checked when present.
"""

from __future__ import annotations

import math
import numbers

INT_FIELDS_AT_LEAST_1 = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)
OPTIONAL_INT_FIELDS_AT_LEAST_1 = ("rank", "lax_kronecker_factor")
BOOL_FIELDS = ("use_cache", "tie_word_embeddings", "attention_bias", "mlp_bias", "only_lr_act", "lax_latent_norm")
ACTIVATION_FIELDS = ("hidden_act", "lr_act")
TOKEN_ID_FIELDS = ("pad_token_id", "bos_token_id", "eos_token_id")


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_int(name: str, value, minimum: int = 1) -> None:
    """``value`` must be an int (not a bool, float or str) and at least ``minimum``."""
    if not _is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}: write it without quotes or decimals.")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}.")


def check_real(name: str, value, *, positive: bool = False, low: float | None = None, high: float | None = None) -> None:
    """``value`` must be a finite real number (an int is fine), ``> 0`` if ``positive``, within ``[low, high)``."""
    if not _is_real(value):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}: write it without quotes.")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}.")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}.")
    if low is not None and high is not None and not low <= value < high:
        raise ValueError(f"{name} must be in [{low}, {high}), got {value}.")


def check_config_fields(config) -> None:
    """Raise ``TypeError`` (wrong type) or ``ValueError`` (out of range) naming the first bad field of ``config``.

    Checks integers (``>= 1``; ``rank`` and ``lax_kronecker_factor`` may be ``None``), booleans, the
    activations (``hidden_act``, ``lr_act``: names of ``transformers.activations.ACT2FN``), ``initializer_range``
    (finite, > 0), ``rms_norm_eps`` (> 0), ``attention_dropout`` (in [0, 1)), ``rope_parameters`` (a dict with a
    finite ``rope_theta`` > 0) and, when set, the special token ids (``0 <= id < vocab_size``).
    """
    for name in INT_FIELDS_AT_LEAST_1:
        check_int(name, getattr(config, name))
    for name in OPTIONAL_INT_FIELDS_AT_LEAST_1:
        if getattr(config, name, None) is not None:
            check_int(name, getattr(config, name))
    for name in BOOL_FIELDS:
        value = getattr(config, name, False)
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be true or false, got {type(value).__name__} {value!r}.")
    from transformers.activations import ACT2FN

    for name in ACTIVATION_FIELDS:
        value = getattr(config, name)
        if not isinstance(value, str) or value not in ACT2FN:
            raise ValueError(f"unknown {name} {value!r}: use an activation name of transformers' ACT2FN, e.g. 'silu' or 'gelu'.")
    check_real("initializer_range", config.initializer_range, positive=True)
    check_real("rms_norm_eps", config.rms_norm_eps, positive=True)
    check_real("attention_dropout", config.attention_dropout, low=0.0, high=1.0)
    rope = config.rope_parameters
    if not isinstance(rope, dict) or "rope_theta" not in rope:
        raise ValueError(f"rope_parameters must be a dict with a 'rope_theta' (e.g. {{'rope_type': 'default', 'rope_theta': 10000.0}}), got {rope!r}.")
    check_real("rope_theta", rope["rope_theta"], positive=True)
    for name in TOKEN_ID_FIELDS:
        value = getattr(config, name, None)
        if value is not None:
            check_int(name, value, minimum=0)
            if value >= config.vocab_size:
                raise ValueError(f"{name} ({value}) must be < vocab_size ({config.vocab_size}): raise vocab_size or fix the token id.")


__all__ = ["check_config_fields", "check_int", "check_real"]

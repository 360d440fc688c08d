"""What ``boost-hf train`` checks before any collective, run in this process on a case's arguments: whether the CLI
refuses the case, and with which message. It calls the CLI's own checks,
:func:`boost_hf.training.pretrain.checked_settings` (what :func:`~boost_hf.training.pretrain.build_trainer` runs
first: the recipe parsed, every setting settled against its other sources by
:mod:`boost_hf.training.compatibility`, the model configuration, the run's ``ParallelConfig`` and
``check_model_and_data`` with the layout's own ``check_model``), with stand-ins for the tokenizer and for the launched
world's size (:func:`~boost_hf.training.compatibility.launched_world_size`: the matrix's world, which ``WORLD_SIZE``
cannot say here without accelerate setting up a process group). What needs the process groups is not checked here,
so a case this accepts may still be refused when launched: the matrix uses this only to choose its cases
(:func:`tests.matrix.covering.build`'s ``blame``), and what a launched case does is what the matrix checks.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from functools import lru_cache
from pathlib import Path

from . import factors


class _Tokenizer:
    """What the checks read of the tokenizer (``bpe-512``: 512 tokens, its special ids), without training it."""

    bos_token_id, eos_token_id, pad_token_id = 1, 2, None

    def __len__(self) -> int:
        return 512


@contextlib.contextmanager
def _one_process_environment():
    """The arguments built as in one process, without an accelerate launch's variables, the data-parallel checks told
    the matrix's world size."""
    from boost_hf.training import compatibility

    names = [n for n in os.environ if n.startswith(("ACCELERATE_", "PARALLELISM_CONFIG_", "FSDP_"))]
    names += [n for n in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if n in os.environ]
    saved = {n: os.environ.pop(n) for n in names}
    launched_world_size = compatibility.launched_world_size
    compatibility.launched_world_size = lambda: factors.WORLD
    try:
        yield
    finally:
        compatibility.launched_world_size = launched_world_size
        os.environ.update(saved)


@lru_cache(maxsize=None)
def _deepspeed_json(stage: int) -> str:
    path = Path(tempfile.mkdtemp(prefix="matrix-ds-")) / f"zero{stage}.json"
    path.write_text(json.dumps(factors.deepspeed_config(stage)))
    return str(path)


def refusal(case: dict) -> str | None:
    """The message ``boost-hf train`` refuses ``case`` with before any collective, or ``None`` (remembered)."""
    return _refusal(tuple(sorted(case.items(), key=lambda item: item[0])))


@lru_cache(maxsize=None)
def _output_dir() -> str:
    return tempfile.mkdtemp(prefix="matrix-validation-")


@lru_cache(maxsize=None)
def _refusal(items: tuple) -> str | None:
    """The message ``boost-hf train`` refuses ``case`` with before any collective, or ``None`` (as far as one process
    can tell, see the module docstring)."""
    from boost_hf.training.pretrain import checked_settings

    case = dict(items)
    stage = factors.deepspeed_stage(case)
    argv = factors.training_arguments(case) + (["--deepspeed", _deepspeed_json(stage)] if stage is not None else [])
    try:
        with _one_process_environment():
            checked_settings(["--output_dir", _output_dir(), *argv], tokenizer=_Tokenizer())
    except (ValueError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return None


#: the words by which a refusal names each factor (its settings' names, and what they turn on)
NAMED_BY: dict[str, tuple[str, ...]] = {
    "layout": ("tp_size", "pp_size", "pipeline"),
    "dp_backend": ("DeepSpeed", "zero1_optimizer", "data_parallel", "FSDP", "fsdp2", "dp_replicate_size", "HSDP"),
    "precision_policy": ("precision_policy", "autocast", "bf16"),
    "activation_checkpointing": ("activation_checkpointing",),
}


def named_factors(message: str) -> set[str]:
    """The factors a refusal's ``message`` names."""
    return {name for name in factors.FACTOR_NAMES if name in message or any(w in message for w in NAMED_BY.get(name, ()))}


def blame(case: dict) -> set[str] | None:
    """``None`` when :func:`refusal` accepts ``case``, else the factors its message names (for the covering array's
    repairs: :func:`tests.matrix.covering.build`)."""
    message = refusal(case)
    return None if message is None else named_factors(message)


__all__ = ["NAMED_BY", "blame", "named_factors", "refusal"]

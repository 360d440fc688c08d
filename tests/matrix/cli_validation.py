"""What ``boost-hf train`` checks before any collective, run in this process on a case's arguments: whether the CLI
refuses the case, and with which message.

``boost-hf train`` has no single function for it: :func:`boost_hf.training.pretrain.build_trainer` parses the recipe
(``BoostTrainingArguments.__post_init__``: the compatibility checks, the precision, the layout fields), builds the
model configuration, the run's ``ParallelConfig`` and checks model and data (``check_model_and_data``); the layout's
own check (``ParallelConfig.check_model``: the TP style against the bottleneck, the pipeline against the model) runs
when the model is built. :func:`refusal` calls the same functions in the same order. What needs the launched world
(the world size, the process groups) is not checked here, so a case this accepts may still be refused when launched:
the matrix uses this only to choose its cases (:func:`tests.matrix.covering.build`'s ``accepted``), and what a
launched case does is what the matrix checks.
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
    """The arguments built as in one process, without an accelerate launch's variables."""
    names = [n for n in os.environ if n.startswith(("ACCELERATE_", "PARALLELISM_CONFIG_", "FSDP_"))]
    names += [n for n in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if n in os.environ]
    saved = {n: os.environ.pop(n) for n in names}
    try:
        yield
    finally:
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
def _parser():
    from boost_hf.training.recipe import recipe_parser

    return recipe_parser()


@lru_cache(maxsize=None)
def _output_dir() -> str:
    return tempfile.mkdtemp(prefix="matrix-validation-")


@lru_cache(maxsize=None)
def _refusal(items: tuple) -> str | None:
    """The message ``boost-hf train`` refuses ``case`` with before any collective, or ``None`` (as far as one process
    can tell, see the module docstring)."""
    from boost_hf.training.preflight import check_model_and_data
    from boost_hf.training.recipe import build_config

    case = dict(items)
    stage = factors.deepspeed_stage(case)
    argv = factors.training_arguments(case) + (["--deepspeed", _deepspeed_json(stage)] if stage is not None else [])
    tokenizer = _Tokenizer()
    try:
        with _one_process_environment():
            # parse_recipe without a recipe file: its parser (made once here) on the arguments
            model_args, data_args, training_args = _parser().parse_args_into_dataclasses(["--output_dir", _output_dir(), *argv])
            config = build_config(model_args, tokenizer)
            parallel = training_args.to_parallel_config(config)
            check_model_and_data(config, tokenizer, data_args.block_size, parallel)
            parallel.check_model(config)
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

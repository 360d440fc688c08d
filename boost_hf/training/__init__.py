"""Distributed pre-training: ``BoostTrainer`` / ``BoostTrainingArguments`` (TP groups x DDP or DeepSpeed ZeRO
over the data-parallel group, under ``accelerate launch``) and the YAML recipes of ``recipes/pretrain.py``.

Names are imported on first use (``transformers.Trainer`` is slow to import), so ``boost-hf demo`` starts fast.
"""

from importlib import import_module

_EXPORTS = {
    "BoostTrainer": ".trainer",
    "BoostTrainingArguments": ".arguments",
    "ModelParallelUnit": ".deepspeed",
    "ModelArguments": ".recipe",
    "DataArguments": ".recipe",
    "parse_recipe": ".recipe",
    "build_tokenizer": ".recipe",
    "build_datasets": ".recipe",
    "build_model": ".recipe",
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name], __name__), name)


__all__ = list(_EXPORTS)

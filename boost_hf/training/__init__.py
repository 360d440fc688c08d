"""Distributed pre-training: ``BoostTrainer`` / ``BoostTrainingArguments`` (TP groups x DDP or DeepSpeed ZeRO
over the data-parallel group, under ``accelerate launch``) and the YAML recipes of ``recipes/pretrain.py``."""

from .arguments import BoostTrainingArguments
from .deepspeed import ModelParallelUnit
from .recipe import DataArguments, ModelArguments, build_datasets, build_model, build_tokenizer, parse_recipe
from .trainer import BoostTrainer

__all__ = [
    "BoostTrainer",
    "BoostTrainingArguments",
    "ModelParallelUnit",
    "ModelArguments",
    "DataArguments",
    "parse_recipe",
    "build_tokenizer",
    "build_datasets",
    "build_model",
]

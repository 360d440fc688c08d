"""Pre-training recipes: a YAML file of model, data and training arguments, overridable on the command line.

A recipe has three sections whose keys are the fields of :class:`ModelArguments`, :class:`DataArguments`
and :class:`~boost_hf.training.arguments.BoostTrainingArguments`::

    model:    {preset: cola-60m, num_hidden_layers: 4}     # a preset and any BoostLlamaConfig field
    data:     {tokenizer: bpe-8192, block_size: 256}
    training: {output_dir: outputs/x, learning_rate: 6.0e-3, tp_size: 2, max_steps: 1000}

:func:`parse_recipe` turns the YAML into ``--field=value`` arguments placed *before* the command-line ones,
so ``recipes/pretrain.py recipe.yaml --learning_rate 1e-3 --hidden_size 256`` overrides any field
(``HfArgumentParser`` parses and validates both the same way). :func:`build_tokenizer`,
:func:`build_datasets` and :func:`build_model` then do the work of ``recipes/pretrain.py``.
"""

from __future__ import annotations

from .stack import check_training_stack

check_training_stack()  # before the [train] extra's packages are imported: a missing or untested stack is named with its fix

import json
import os
import typing
from dataclasses import dataclass, field, fields, make_dataclass

import yaml
from datasets import Dataset
from transformers import HfArgumentParser, set_seed

from ..checkpoint.integrity import MANIFEST_NAME
from ..configuration_boost_llama import BoostLlamaConfig, DerivedRankError
from ..data import DEFAULT_VALIDATION_PERCENT, build_lm_datasets, load_tokenizer
from ..modeling_boost_llama import BoostLlamaForCausalLM
from ..parallel.config import ParallelConfig
from .arguments import BoostTrainingArguments
from .compatibility import without_accelerate_parallelism
from ..shipped import ACCELERATE_CONFIGS_DIR, RECIPES_DIR, VOCAB_MULTIPLE, recipe_model_config, resolve_recipe, shipped_recipes
from ..checkpoint.folders import verify_checkpoint_once
from ..checkpoint.decisions import decided_on_rank_zero

# BoostLlamaConfig fields that a recipe does not set: taken from the tokenizer or the training arguments.
_NOT_RECIPE_FIELDS = {"use_cache", "pad_token_id", "bos_token_id", "eos_token_id", "rope_parameters"}


def _model_fields() -> list[tuple[str, type, object]]:
    hints = typing.get_type_hints(BoostLlamaConfig.__init__)
    return [
        (name, typing.Optional[hint], field(default=None, metadata={"help": f"BoostLlamaConfig.{name} (default: the preset's)."}))
        for name, hint in hints.items()
        if name not in _NOT_RECIPE_FIELDS and name != "return"
    ]


@dataclass
class _ModelSource:
    preset: str | None = field(
        default="cola-60m",
        metadata={"help": f"Reference configuration: one of {', '.join(BoostLlamaConfig.preset_names())}."},
    )
    init_from: str | None = field(
        default=None, metadata={"help": "Start from this checkpoint's weights and config (any TP size saved it)."}
    )


ModelArguments = make_dataclass("ModelArguments", _model_fields(), bases=(_ModelSource,))
ModelArguments.__doc__ = """The model: a ``preset`` (or ``init_from`` a checkpoint) and overrides of any scalar
``BoostLlamaConfig`` field (``None`` keeps the preset's value). ``vocab_size`` defaults to the tokenizer's,
padded to a multiple of 64."""
ModelArguments.__module__ = __name__


@dataclass
class DataArguments:
    """The data: a corpus, a tokenizer and the packing of blocks (:func:`boost_hf.data.build_lm_datasets`)."""

    dataset: str | None = field(
        default=None,
        metadata={"help": "None: the Wikipedia sample shipped with gensim; else local text/JSON files, a folder or a Hub "
                          "dataset, of text or pre-tokenized (an input_ids column, optionally attention_mask and labels)."},
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Hub dataset configuration."})
    text_column: str = field(default="text", metadata={"help": "Column holding the document text."})
    skip_records_without_text: bool = field(
        default=False, metadata={"help": "Leave out the records without the text column (counted and logged) instead of "
                                         "refusing the data."})
    tokenizer: str = field(
        default="bpe",
        metadata={"help": "bpe-<vocab> (byte-level BPE trained on the Wikipedia sample, cached), a folder or a Hub name."},
    )
    block_size: int = field(default=256, metadata={"help": "Tokens per training sequence."})
    max_train_blocks: int | None = field(default=None, metadata={"help": "Keep at most this many training blocks."})
    max_eval_blocks: int | None = field(default=None, metadata={"help": "Keep at most this many validation blocks."})
    validation_percent: float = field(
        default=DEFAULT_VALIDATION_PERCENT, metadata={"help": "Share of documents held out when the source has no validation split."}
    )
    streaming: bool = field(default=False, metadata={"help": "Stream the corpus (Hub datasets) instead of downloading it."})
    shuffle_buffer: int = field(
        default=0,
        metadata={"help": "(streaming) Blocks in the training stream's shuffle buffer, seeded by data_seed (else seed); 0: stream order."},
    )
    stream_shards: int | None = field(
        default=None,
        metadata={"help": "(streaming) Logical streams the training stream is split into: the run resumes at any DP size that "
                          "divides it (default: the DP size of the run that starts the stream)."},
    )


SECTIONS = {"model": ModelArguments, "data": DataArguments, "training": BoostTrainingArguments}

def recipe_to_argv(recipe: dict) -> list[str]:
    """``--field=value`` arguments of a parsed recipe; raise ``ValueError`` on unknown sections or keys."""
    argv = []
    for section, values in (recipe or {}).items():
        if section not in SECTIONS:
            raise ValueError(f"unknown recipe section {section!r}: use {', '.join(SECTIONS)}.")
        known = {f.name for f in fields(SECTIONS[section]) if f.init}
        for key, value in (values or {}).items():
            if key not in known:
                raise ValueError(f"unknown key {key!r} in recipe section {section!r}: see `recipes/pretrain.py --help`.")
            if value is None:
                continue
            if isinstance(value, list):
                argv += [f"--{key}", *map(str, value)]
            else:
                argv.append(f"--{key}={json.dumps(value) if isinstance(value, dict) else value}")
    return argv


def recipe_parser(*sections: type, **kwargs) -> HfArgumentParser:
    """The parser of the recipe fields, generated from the sections' dataclasses (default: model, data and
    training): what a recipe's keys and the command line's ``--field value`` are read with, and what
    ``boost-hf train --help`` lists; ``kwargs`` go to ``argparse.ArgumentParser``."""
    return HfArgumentParser(sections or tuple(SECTIONS.values()), **kwargs)


def parse_recipe(argv: list[str]) -> tuple:
    """``[RECIPE.yaml] [--field value ...]`` -> ``(ModelArguments, DataArguments, BoostTrainingArguments)``; the model
    arguments carry ``origins`` (:func:`setting_origins`), which the errors of :func:`build_config` name.
    In a launched worker, from here on the process dies with its launcher (:func:`~boost_hf.training.watchdog.exit_with_launcher`)."""
    from .watchdog import exit_with_launcher

    exit_with_launcher()
    recipe, path = {}, None
    if argv and argv[0].endswith((".yaml", ".yml")):
        path = argv[0]
        with open(path) as f:
            recipe = yaml.safe_load(f)
        argv = argv[1:]
    parsed = recipe_parser().parse_args_into_dataclasses(args=recipe_to_argv(recipe) + list(argv))
    parsed[0].origins = setting_origins(path, recipe, argv, "model")
    return parsed


def setting_origins(path: str | None, recipe: dict | None, argv: list[str], section: str) -> dict[str, str]:
    """Where each field of a recipe ``section`` that is set comes from: ``"--rank 16 on the command line"`` (which
    wins) or ``"rank: 32 in the recipe recipes/demo.yaml"``."""
    origins = {key: f"{key}: {value} in the recipe {path}" for key, value in ((recipe or {}).get(section) or {}).items()
               if value is not None}
    for i, item in enumerate(argv):
        if item.startswith("--"):
            key, _, value = item[2:].partition("=")
            value = value or (argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else "")
            origins[key] = f"--{key} {value} on the command line".replace("  ", " ")
    return origins


def build_tokenizer(data_args: DataArguments):
    return load_tokenizer(data_args.tokenizer)


def build_datasets(data_args: DataArguments, tokenizer, training_args: BoostTrainingArguments):
    """Packed ``train`` / ``validation`` blocks; the local main process builds the caches first. Streaming, the
    training set is a :class:`~boost_hf.data.stream.BlockStream` and the validation split is read once, by global
    rank 0 (``max_eval_blocks`` blocks), and sent to every rank (:func:`read_on_rank_zero`)."""
    if data_args.streaming and data_args.max_eval_blocks is None:
        raise ValueError("streaming=True needs max_eval_blocks: the validation blocks are kept in memory.")
    seed = training_args.data_seed if training_args.data_seed is not None else training_args.seed
    with training_args.main_process_first(local=True, desc="building the datasets"):
        datasets = build_lm_datasets(
            data_args.dataset,
            tokenizer,
            data_args.block_size,
            text_column=data_args.text_column,
            validation_percent=data_args.validation_percent,
            config=data_args.dataset_config,
            streaming=data_args.streaming,
            max_train_blocks=data_args.max_train_blocks,
            max_eval_blocks=data_args.max_eval_blocks,
            shuffle_buffer=data_args.shuffle_buffer,
            seed=seed,
            stream_shards=data_args.stream_shards,
            skip_records_without_text=data_args.skip_records_without_text,
        )
    if data_args.streaming:
        validation = datasets["validation"]
        rows = read_on_rank_zero(lambda: [{name: ids.tolist() for name, ids in block.items()} for block in validation])
        datasets["validation"] = Dataset.from_list(rows)
    return datasets


def read_on_rank_zero(read):
    """``read()`` on global rank 0, its result (or its error, raised on every rank) sent to every rank: one
    ``broadcast_object_list`` when launched (:func:`~boost_hf.checkpoint.decisions.decided_on_rank_zero`)."""
    return decided_on_rank_zero(read)


DEFAULT_CORPUS_HUB_NAME = "wikimedia/wikipedia"
"""Hub name of the corpus the default Wikipedia sample comes from (the model card's ``datasets``)."""


def card_datasets(data_args: DataArguments) -> list[str]:
    """The model card's ``datasets``: the Hub dataset trained on (none for local files)."""
    if data_args.dataset is None:
        return [DEFAULT_CORPUS_HUB_NAME]
    return [] if os.path.exists(data_args.dataset) else [data_args.dataset]


def build_config(model_args, tokenizer) -> BoostLlamaConfig:
    """The model configuration: ``init_from``'s or the preset's, with the recipe's overrides and the
    tokenizer's vocabulary (padded to a multiple of :data:`VOCAB_MULTIPLE`) and special tokens."""
    overrides = {f.name: getattr(model_args, f.name) for f in fields(ModelArguments) if f.name not in ("preset", "init_from")}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    tokens = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    try:
        if model_args.init_from:
            check_checkpoint_folder(model_args.init_from)
            return BoostLlamaConfig.from_pretrained(model_args.init_from, **overrides)
        overrides.setdefault("vocab_size", -(-len(tokenizer) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE)
        return recipe_model_config(model_args.preset, overrides, **tokens)
    except DerivedRankError as error:
        origins = getattr(model_args, "origins", {})
        source = model_args.init_from or f"the preset {model_args.preset}"
        rank_from = origins.get("rank", f"the saved config {model_args.init_from}" if model_args.init_from else source)
        tt_rank_from = origins.get("tt_rank", source)
        raise ValueError(
            f"rank={error.rank} ({rank_from}) and tt_rank={error.tt_rank} ({tt_rank_from}) disagree: with bottleneck='tt' "
            f"the rank is the middle rank of the tensor trains ({error.derivation}). Pass --rank {error.derived} to keep "
            f"tt_rank={error.tt_rank}{' (or remove rank from the recipe)' if 'in the recipe' in rank_from else ''}, or "
            f"choose the tt_rank that gives rank {error.rank}."
        ) from None


def check_checkpoint_folder(path: str) -> None:
    """``path`` is a local folder with a ``config.json`` (``init_from``), else ``FileNotFoundError`` saying so."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"init_from: no such file or folder: {path!r}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(
            f"init_from: {path!r} has no config.json, so it is not a saved model: point it at a checkpoint-<step> or "
            "final folder of a boost-hf run."
        )


def build_model(model_args, training_args: BoostTrainingArguments, tokenizer, *, config=None,
                parallel_config: ParallelConfig | None = None) -> BoostLlamaForCausalLM:
    """This rank's shard of the model (call inside the launched process group, i.e. after parsing the
    training arguments), of ``config`` under ``parallel_config`` (default: built from the arguments, as
    :func:`~boost_hf.training.pretrain.build_trainer` builds them once for the run). Weights depend only on
    ``training_args.seed``, whatever the TP size. A checkpoint given as ``init_from`` is verified against its
    manifest and architecture record (when it has a manifest)."""
    config = config if config is not None else build_config(model_args, tokenizer)
    parallel_config = parallel_config if parallel_config is not None else training_args.to_parallel_config(config)
    if model_args.init_from:
        if os.path.isfile(os.path.join(model_args.init_from, MANIFEST_NAME)):
            verify_checkpoint_once(model_args.init_from, config)
        with without_accelerate_parallelism():  # each rank reads its own slices, whatever an FSDP config says
            return BoostLlamaForCausalLM.from_pretrained(model_args.init_from, config=config, parallel_config=parallel_config)
    set_seed(training_args.seed)
    return BoostLlamaForCausalLM(config, parallel_config)


__all__ = [
    "ModelArguments",
    "DataArguments",
    "parse_recipe",
    "recipe_to_argv",
    "build_tokenizer",
    "build_datasets",
    "read_on_rank_zero",
    "build_config",
    "build_model",
    "setting_origins",
    "check_checkpoint_folder",
    "RECIPES_DIR",
    "ACCELERATE_CONFIGS_DIR",
    "shipped_recipes",
    "resolve_recipe",
    "card_datasets",
]

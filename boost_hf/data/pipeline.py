"""Causal-LM datasets: tokenize documents and pack them into fixed-length blocks.

Every document becomes its token ids followed by ``eos`` (optionally preceded by
``bos``); documents are concatenated in order and cut into blocks of exactly
``block_size`` tokens, the incomplete tail of each packing batch being dropped.
``labels`` equal ``input_ids`` (the model shifts them), so blocks can be batched with
``transformers.default_data_collator``. The result depends only on the data, the
tokenizer and the arguments: two builds give identical blocks.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from itertools import chain
from typing import Any

from datasets import Dataset, DatasetDict, IterableDataset, IterableDatasetDict
from transformers import PreTrainedTokenizerBase

from .corpus import DEFAULT_VALIDATION_PERCENT
from .sources import AnyDatasetDict, PathLike, Source, load_text_splits
from .tokenizer import load_tokenizer


DEFAULT_BLOCK_SIZE = 256
PACK_BATCH_SIZE = 1000
"""Documents concatenated together before cutting blocks (the tail of each group is dropped)."""


def _fingerprint(*parts: Any) -> str:
    """Stable fingerprint for ``datasets`` caching, from JSON-serialisable parts."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode("utf-8")).hexdigest()[:32]


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """Hash of the tokenizer's full definition (vocabulary, merges, normalisation, specials)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    payload = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    extra = [tokenizer.bos_token_id, tokenizer.eos_token_id, type(tokenizer).__name__]
    return _fingerprint(payload, extra)


def tokenize_documents(
    dataset: Dataset | IterableDataset,
    tokenizer: PreTrainedTokenizerBase,
    *,
    text_column: str = "text",
    add_bos: bool = False,
    num_proc: int | None = None,
) -> Dataset | IterableDataset:
    """Map documents to ``input_ids`` (one row per non-blank document, ``eos`` appended).

    All other columns are removed. Blank documents (e.g. empty lines of a text file) are dropped.
    """
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos token; set tokenizer.eos_token first")
    if add_bos and tokenizer.bos_token_id is None:
        raise ValueError("add_bos=True but the tokenizer has no bos token")
    eos, bos = tokenizer.eos_token_id, tokenizer.bos_token_id

    def tokenize(batch: dict[str, list[Any]]) -> dict[str, list[list[int]]]:
        texts = [text for text in batch[text_column] if text is not None and text.strip()]
        if not texts:
            return {"input_ids": []}
        encoded = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
        prefix = [bos] if add_bos else []
        return {"input_ids": [prefix + list(ids) + [eos] for ids in encoded]}

    # Selecting the text column first also works for streams whose columns are unknown.
    dataset = dataset.select_columns([text_column])
    kwargs: dict[str, Any] = {"batched": True, "remove_columns": [text_column]}
    if isinstance(dataset, Dataset):
        kwargs.update(
            num_proc=num_proc,
            desc="Tokenizing",
            new_fingerprint=_fingerprint(
                "tokenize-v1", dataset._fingerprint, tokenizer_fingerprint(tokenizer), text_column, add_bos
            ),
        )
    return dataset.map(tokenize, **kwargs)


def pack_blocks(
    dataset: Dataset | IterableDataset,
    block_size: int,
    *,
    num_proc: int | None = None,
) -> Dataset | IterableDataset:
    """Concatenate tokenized documents and cut them into ``block_size`` blocks with ``labels``.

    Groups of :data:`PACK_BATCH_SIZE` documents are concatenated; each group's remainder
    shorter than ``block_size`` is dropped.
    """
    if block_size < 2:
        raise ValueError(f"block_size must be at least 2, got {block_size}")

    def pack(batch: dict[str, list[list[int]]]) -> dict[str, list[list[int]]]:
        tokens = list(chain.from_iterable(batch["input_ids"]))
        usable = len(tokens) - len(tokens) % block_size
        blocks = [tokens[start : start + block_size] for start in range(0, usable, block_size)]
        return {"input_ids": blocks, "labels": [list(block) for block in blocks]}

    kwargs: dict[str, Any] = {"batched": True, "batch_size": PACK_BATCH_SIZE, "remove_columns": ["input_ids"]}
    if isinstance(dataset, Dataset):
        kwargs.update(
            num_proc=num_proc,
            desc=f"Packing into blocks of {block_size}",
            new_fingerprint=_fingerprint("pack-v1", dataset._fingerprint, block_size, PACK_BATCH_SIZE),
        )
    return dataset.map(pack, **kwargs)


def _cap(dataset: Dataset | IterableDataset, limit: int | None) -> Dataset | IterableDataset:
    if limit is None:
        return dataset
    if limit < 0:
        raise ValueError(f"block caps must be >= 0, got {limit}")
    if isinstance(dataset, IterableDataset):
        return dataset.take(limit)
    return dataset.select(range(min(limit, len(dataset))))


def build_lm_datasets(
    source: Source = None,
    tokenizer: PreTrainedTokenizerBase | str | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    text_column: str = "text",
    validation_percent: float = DEFAULT_VALIDATION_PERCENT,
    config: str | None = None,
    streaming: bool = False,
    max_train_blocks: int | None = None,
    max_eval_blocks: int | None = None,
    add_bos: bool = False,
    num_proc: int | None = None,
    cache_dir: PathLike | None = None,
    datasets_cache_dir: PathLike | None = None,
    load_kwargs: Mapping[str, Any] | None = None,
) -> AnyDatasetDict:
    """Build packed causal-LM ``train`` and ``validation`` datasets.

    Args:
        source: the data (see :mod:`boost_hf.data.sources`): ``None`` for the Wikipedia sample,
            local text/JSON(L)/CSV/Parquet files, a ``save_to_disk`` folder, or a Hub dataset name.
        tokenizer: a tokenizer, or a name for :func:`boost_hf.data.tokenizer.load_tokenizer`
            (``None``: the default BPE trained on the Wikipedia sample's train split).
        block_size: tokens per block.
        text_column: column holding the document text.
        validation_percent: share of documents held out when the source has no validation split.
        config: Hub dataset configuration.
        streaming: build lazily from an iterable dataset (Hub sources are not downloaded whole).
        max_train_blocks: keep at most this many (leading) train blocks.
        max_eval_blocks: keep at most this many (leading) validation blocks.
        add_bos: also put ``bos`` in front of every document.
        num_proc: worker processes for ``datasets.map`` (``None``: in-process).
        cache_dir: boost_hf cache root (corpus and tokenizer caches).
        datasets_cache_dir: ``datasets`` cache folder for ``load_dataset``.
        load_kwargs: extra ``load_dataset`` keyword arguments.

    Returns:
        ``DatasetDict`` (``IterableDatasetDict`` when streaming) with ``train`` and
        ``validation``, each with ``input_ids`` and ``labels`` columns of ``block_size`` ints.
    """
    if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_tokenizer(tokenizer, cache_dir=cache_dir)
    splits = load_text_splits(
        source,
        text_column=text_column,
        validation_percent=validation_percent,
        config=config,
        streaming=streaming,
        cache_dir=cache_dir,
        datasets_cache_dir=datasets_cache_dir,
        load_kwargs=load_kwargs,
    )
    caps = {"train": max_train_blocks, "validation": max_eval_blocks}
    built: dict[str, Dataset | IterableDataset] = {}
    for name, split in splits.items():
        if isinstance(split, Dataset) and len(split) == 0:
            raise ValueError(
                f"the {name} split of {source!r} has no documents (validation_percent={validation_percent} of "
                f"{sum(len(s) for s in splits.values())} documents): add documents or give the split its own files, "
                "e.g. {'train': 'train.txt', 'validation': 'valid.txt'}."
            )
        tokens = tokenize_documents(split, tokenizer, text_column=text_column, add_bos=add_bos, num_proc=num_proc)
        built[name] = _cap(pack_blocks(tokens, block_size, num_proc=num_proc), caps[name])
        if isinstance(built[name], Dataset) and len(built[name]) == 0 and caps[name] != 0:
            raise ValueError(
                f"the {name} split of {source!r} has no complete block of {block_size} tokens: add text or lower block_size."
            )
    if streaming:
        return IterableDatasetDict(built)
    return DatasetDict(built)

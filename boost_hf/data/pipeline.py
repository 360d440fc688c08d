"""Causal-LM datasets: documents become token ids, token ids are packed into fixed-length blocks.

A document is text (tokenized without special tokens) or pre-tokenized ids (an ``input_ids`` column, optionally
``attention_mask``, whose 0 positions are dropped, and ``labels``). Either way ``eos`` follows its ids (unless they
already end with it) and, with ``add_bos``, ``bos`` precedes them (:func:`document_token_ids`). Documents are
concatenated in order and cut into blocks of exactly ``block_size`` tokens.

Blocks hold ``input_ids`` only (``labels`` too when the documents had their own): the labels of a causal LM are its
``input_ids`` (the model shifts them), derived when a batch is collated
(:func:`~boost_hf.data.collate.causal_lm_collator`), not stored. A map-style build is one ``datasets.map`` (tokenize
and pack together, one cache file), its ids stored as ``uint16`` when the tokenizer has at most 65,536 tokens (else
``int32``): about 2 bytes per token, against 12 when ``int64`` labels were stored beside ``int32`` ids. The
incomplete tail of each packing batch of :data:`PACK_BATCH_SIZE` documents is dropped. A streamed build is a
:class:`~boost_hf.data.stream.BlockStream`: the remainder is carried to the next document, and its position
resumes without re-reading. The result depends only on the data, the tokenizer and the arguments.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from datasets import Dataset, DatasetDict, Features, IterableDataset, List, Value
from transformers import PreTrainedTokenizerBase

from .checks import token_id_range
from .corpus import DEFAULT_VALIDATION_PERCENT
from .fingerprint import attach_sources
from .sources import (
    PathLike,
    Source,
    first_record_not_text,
    load_text_splits,
    local_data_files,
    training_sources,
    unreadable_file_error,
)
from .stream import BlockStream
from .tokenizer import load_tokenizer


logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 256
PACK_BATCH_SIZE = 1000
"""Documents concatenated together before cutting blocks (the tail of each group is dropped)."""
TOKEN_COLUMNS = ("input_ids", "attention_mask", "labels")
"""The columns of a pre-tokenized dataset that the pipeline reads."""
IGNORE_INDEX = -100

DocumentIds = Callable[[dict[str, list]], dict[str, list[np.ndarray]]]


def _fingerprint(*parts: Any) -> str:
    """Stable fingerprint for ``datasets`` caching, from JSON-serialisable parts."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode("utf-8")).hexdigest()[:32]


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """Hash of the tokenizer's full definition (vocabulary, merges, normalisation, specials)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    payload = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    extra = [tokenizer.bos_token_id, tokenizer.eos_token_id, type(tokenizer).__name__]
    return _fingerprint(payload, extra)


def token_dtype(vocab_size: int) -> str:
    """The Arrow type that stores ids below ``vocab_size``: ``uint16`` up to 65,536 tokens, else ``int32``."""
    return "uint16" if vocab_size <= 1 << 16 else "int32"


def is_pre_tokenized(columns: list[str] | None) -> bool:
    """Whether documents with these columns are token ids (an ``input_ids`` column) rather than text."""
    return columns is not None and "input_ids" in columns


def document_token_ids(tokenizer: PreTrainedTokenizerBase, *, text_column: str = "text", add_bos: bool = False,
                       skip_records_without_text: bool = False, locate_not_text=None) -> DocumentIds:
    """The batched function ``{column: [value per document]} -> {"input_ids": [ids per document]}`` (and ``"labels"``
    when the documents carry them), each an ``int64`` array.

    A batch with an ``input_ids`` column is pre-tokenized: ids outside the tokenizer's vocabulary are an error, the
    positions where ``attention_mask`` is 0 are dropped (from ``labels`` too). Otherwise ``text_column`` is
    tokenized. Either way ``eos`` is appended unless the ids end with it and, with ``add_bos``, ``bos`` put first
    unless they start with it (their label is the token itself). Blank texts and empty documents are dropped. A record
    without text in ``text_column`` (the field missing or null, or another type: a number, a list) is an error naming
    it (its type; ``locate_not_text()``, given, says where the first such record is: its file and line), or with
    ``skip_records_without_text`` left out and counted (``records_without_text`` of the returned function, logged at
    the 1st, 10th, 100th, ... one)."""
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos token; set tokenizer.eos_token first")
    if add_bos and tokenizer.bos_token_id is None:
        raise ValueError("add_bos=True but the tokenizer has no bos token")
    eos, bos, vocab = tokenizer.eos_token_id, tokenizer.bos_token_id, len(tokenizer)

    def framed(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``ids`` with bos / eos added where missing, and the index of each output token in ``ids`` (-1: added)."""
        source = np.arange(len(ids))
        if add_bos and ids[0] != bos:
            ids, source = np.concatenate([[bos], ids]), np.concatenate([[-1], source])
        if ids[-1] != eos:
            ids, source = np.concatenate([ids, [eos]]), np.concatenate([source, [-1]])
        return ids, source

    def from_ids(batch: dict[str, list]) -> dict[str, list[np.ndarray]]:
        out: dict[str, list[np.ndarray]] = {"input_ids": []}
        labels_in = batch.get("labels")
        if labels_in is not None:
            out["labels"] = []
        masks = batch.get("attention_mask")
        for i, row in enumerate(batch["input_ids"]):
            ids = np.asarray(row, dtype=np.int64)
            if ids.ndim != 1:
                raise ValueError(f"pre-tokenized input_ids must hold one list of ids per document, got shape {ids.shape}")
            keep = np.asarray(masks[i], dtype=bool) if masks is not None else slice(None)
            ids = ids[keep]
            if len(ids) == 0:
                continue
            if ids.min() < 0 or ids.max() >= vocab:
                bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
                raise ValueError(
                    f"a pre-tokenized document holds token id {bad}, outside the tokenizer's vocabulary [0, {vocab}): "
                    "tokenize the data with the tokenizer given to the recipe (--tokenizer), or give that tokenizer."
                )
            ids, source = framed(ids)
            out["input_ids"].append(ids)
            if labels_in is not None:
                labels = np.asarray(labels_in[i], dtype=np.int64)[keep]
                out["labels"].append(np.where(source >= 0, labels[np.maximum(source, 0)], ids))
        return out

    def from_text(batch: dict[str, list]) -> dict[str, list[np.ndarray]]:
        missing = sum(not isinstance(text, str) for text in batch[text_column])
        if missing:
            count_missing(missing, next((text for text in batch[text_column] if text is not None and not isinstance(text, str)), None))
        texts = [text for text in batch[text_column] if isinstance(text, str) and text.strip()]
        if not texts:
            return {"input_ids": []}
        encoded = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
        return {"input_ids": [framed(np.asarray(ids, dtype=np.int64))[0] for ids in encoded if ids]}

    def count_missing(missing: int, other) -> None:
        if not skip_records_without_text:
            if other is not None:
                from .sources import not_text

                where = locate_not_text() if locate_not_text is not None else None
                what = (f"a record read ({where}) " if where else "a record read ") + (
                    f"holds {not_text(other)} in its {text_column!r} field, not text")
            else:
                what = f"{missing} record(s) read have no {text_column!r} field (or a null one)"
            raise ValueError(
                f"{what}: such records would be left out of the data. Give every record its text (a string), set "
                "text_column to the field that holds it, or pass --skip_records_without_text true "
                "(skip_records_without_text=True) to leave them out."
            )
        before = to_ids.records_without_text
        to_ids.records_without_text += missing
        if len(str(to_ids.records_without_text)) > len(str(before)) or before == 0:
            logger.warning("skipped %d record(s) without a %r field (or whose %r is null or not text) so far "
                           "(skip_records_without_text)", to_ids.records_without_text, text_column, text_column)

    def to_ids(batch: dict[str, list]) -> dict[str, list[np.ndarray]]:
        if "input_ids" in batch:
            return from_ids(batch)
        if text_column not in batch:
            raise ValueError(f"a document has neither the text column {text_column!r} nor input_ids (columns: {sorted(batch)})")
        return from_text(batch)

    to_ids.records_without_text = 0
    return to_ids


def cut_blocks(tokens: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``tokens [n]`` -> ``(blocks [n // block_size, block_size], remainder [n % block_size])``."""
    usable = len(tokens) - len(tokens) % block_size
    return tokens[:usable].reshape(-1, block_size), tokens[usable:]


def _pack(documents: dict[str, list[np.ndarray]], block_size: int) -> dict[str, np.ndarray]:
    """Concatenated documents cut into blocks; the incomplete tail is dropped."""
    packed = {}
    for name, rows in documents.items():
        tokens = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
        packed[name] = cut_blocks(tokens, block_size)[0]
    return packed


def _check_block_size(block_size: int) -> None:
    if block_size < 2:
        raise ValueError(f"block_size must be at least 2, got {block_size}")


def _selected_columns(columns: list[str] | None, text_column: str) -> list[str] | None:
    """The columns the pipeline reads from documents with ``columns`` (``None``: unknown, read whatever comes)."""
    if columns is None:
        return None
    if is_pre_tokenized(columns):
        return [name for name in TOKEN_COLUMNS if name in columns]
    if text_column not in columns:
        raise ValueError(f"text column {text_column!r} not found, and no input_ids column; columns are {columns}")
    return [text_column]


def block_features(vocab_size: int, with_labels: bool) -> Features:
    """The Arrow schema of packed blocks: ids in :func:`token_dtype`, labels (when stored) in ``int32``."""
    features = {"input_ids": List(Value(token_dtype(vocab_size)))}
    if with_labels:
        features["labels"] = List(Value("int32"))
    return Features(features)


def tokenize_documents(
    dataset: Dataset | IterableDataset,
    tokenizer: PreTrainedTokenizerBase,
    *,
    text_column: str = "text",
    add_bos: bool = False,
    num_proc: int | None = None,
    skip_records_without_text: bool = False,
) -> Dataset | IterableDataset:
    """Map documents to their ids (:func:`document_token_ids`: one row per non-blank document, ``eos`` appended).
    All other columns are removed."""
    to_ids = document_token_ids(tokenizer, text_column=text_column, add_bos=add_bos,
                                skip_records_without_text=skip_records_without_text)
    columns = _selected_columns(dataset.column_names, text_column) or [text_column]  # unknown columns: text
    dataset = dataset.select_columns(columns)
    kwargs: dict[str, Any] = {"batched": True, "remove_columns": columns}
    if isinstance(dataset, Dataset):
        kwargs.update(num_proc=num_proc, desc="Tokenizing", new_fingerprint=_fingerprint(
            "tokenize-v2", dataset._fingerprint, tokenizer_fingerprint(tokenizer), text_column, add_bos))
    return dataset.map(to_ids, **kwargs)


def pack_blocks(dataset: Dataset | IterableDataset, block_size: int, *, num_proc: int | None = None) -> Dataset | IterableDataset:
    """Concatenate tokenized documents (``input_ids``, and ``labels`` if present) and cut them into ``block_size``
    blocks. Groups of :data:`PACK_BATCH_SIZE` documents are concatenated; each group's remainder shorter than
    ``block_size`` is dropped."""
    _check_block_size(block_size)

    def pack(batch: dict[str, list]) -> dict[str, np.ndarray]:
        ids = {name: [np.asarray(row, dtype=np.int64) for row in batch[name]] for name in ("input_ids", "labels") if name in batch}
        return _pack(ids, block_size)

    kwargs: dict[str, Any] = {"batched": True, "batch_size": PACK_BATCH_SIZE, "remove_columns": dataset.column_names}
    if isinstance(dataset, Dataset):
        kwargs.update(num_proc=num_proc, desc=f"Packing into blocks of {block_size}",
                      new_fingerprint=_fingerprint("pack-v2", dataset._fingerprint, block_size, PACK_BATCH_SIZE))
    return dataset.map(pack, **kwargs)


def pack_documents(
    dataset: Dataset,
    tokenizer: PreTrainedTokenizerBase,
    block_size: int,
    *,
    text_column: str = "text",
    add_bos: bool = False,
    num_proc: int | None = None,
    skip_records_without_text: bool = False,
) -> Dataset:
    """Blocks of a map-style dataset of documents in one ``datasets.map`` (:func:`tokenize_documents` then
    :func:`pack_blocks`, without caching the tokenized documents), stored in :func:`block_features`."""
    _check_block_size(block_size)
    to_ids = document_token_ids(tokenizer, text_column=text_column, add_bos=add_bos,
                                skip_records_without_text=skip_records_without_text)
    columns = _selected_columns(dataset.column_names, text_column)
    with_labels = "labels" in columns
    return dataset.select_columns(columns).map(
        lambda batch: _pack(to_ids(batch), block_size),
        batched=True,
        batch_size=PACK_BATCH_SIZE,
        remove_columns=columns,
        features=block_features(len(tokenizer), with_labels),
        num_proc=num_proc,
        desc=f"Tokenizing and packing into blocks of {block_size}",
        new_fingerprint=_fingerprint("blocks-v1", dataset._fingerprint, tokenizer_fingerprint(tokenizer), text_column, add_bos,
                                     block_size, PACK_BATCH_SIZE, with_labels),
    )


def _cap(dataset: Dataset, limit: int | None) -> Dataset:
    if limit is None:
        return dataset
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
    shuffle_buffer: int = 0,
    seed: int = 0,
    stream_shards: int | None = None,
    num_proc: int | None = None,
    cache_dir: PathLike | None = None,
    datasets_cache_dir: PathLike | None = None,
    load_kwargs: Mapping[str, Any] | None = None,
    skip_records_without_text: bool = False,
) -> DatasetDict | dict[str, BlockStream]:
    """Build packed causal-LM ``train`` and ``validation`` datasets.

    Args:
        source: the data (see :mod:`boost_hf.data.sources`): ``None`` for the Wikipedia sample,
            local text/JSON(L)/CSV/Parquet files, a ``save_to_disk`` folder, or a Hub dataset name; documents are
            text (``text_column``) or pre-tokenized (an ``input_ids`` column, see :func:`document_token_ids`).
        tokenizer: a tokenizer, or a name for :func:`boost_hf.data.tokenizer.load_tokenizer`
            (``None``: the default BPE trained on the Wikipedia sample's train split).
        block_size: tokens per block.
        text_column: column holding the document text.
        validation_percent: share of documents held out when the source has no validation split.
        config: Hub dataset configuration.
        streaming: build lazily, as :class:`~boost_hf.data.stream.BlockStream` s (Hub sources are not downloaded whole).
        max_train_blocks: keep at most this many (leading) train blocks (per pass over a stream).
        max_eval_blocks: keep at most this many (leading) validation blocks.
        add_bos: also put ``bos`` in front of every document.
        shuffle_buffer: (streaming) blocks in the training stream's seeded shuffle buffer (0: stream order).
        seed: (streaming) the shuffle buffer's seed.
        stream_shards: (streaming) the logical streams the training stream is split into (``None``: the DP size of
            the run that starts it; see :mod:`boost_hf.training.data`).
        num_proc: worker processes for ``datasets.map`` (``None``: in-process).
        cache_dir: boost_hf cache root (corpus and tokenizer caches).
        datasets_cache_dir: ``datasets`` cache folder for ``load_dataset``.
        load_kwargs: extra ``load_dataset`` keyword arguments.
        skip_records_without_text: leave out the records without ``text_column`` (counted and logged) instead of
            refusing them.

    The training set carries its :class:`~boost_hf.data.fingerprint.DataSources` (:func:`training_sources`), which
    a checkpoint's data position records the fingerprint of.

    Returns:
        A ``DatasetDict`` with ``train`` and ``validation`` blocks (``input_ids`` of ``block_size`` ids, ``labels``
        only when the documents had their own), or, streaming, a dict of two :class:`BlockStream`.
    """
    _check_block_size(block_size)
    for name, limit in (("max_train_blocks", max_train_blocks), ("max_eval_blocks", max_eval_blocks)):
        if limit is not None and limit < 0:
            raise ValueError(f"{name} must be >= 0, got {limit}")
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
        skip_records_without_text=skip_records_without_text,
    )
    if streaming:
        files = local_data_files(source)
        to_ids = document_token_ids(tokenizer, text_column=text_column, add_bos=add_bos,
                                    skip_records_without_text=skip_records_without_text,
                                    locate_not_text=functools.partial(first_record_not_text, files, text_column) if files else None)
        explain = functools.partial(unreadable_file_error, files, load_kwargs) if files else None
        streams = {}
        for name, split in splits.items():
            columns = _selected_columns(split.column_names, text_column)
            training = name == "train"
            streams[name] = BlockStream(
                split.select_columns(columns) if columns is not None else split, to_ids, block_size,
                max_blocks=max_train_blocks if training else max_eval_blocks,
                shuffle_buffer=shuffle_buffer if training else 0, seed=seed,
                logical_streams=stream_shards if training else 1, explain_read_error=explain,
            )
        attach_sources(streams["train"], training_sources(source, config=config, load_kwargs=load_kwargs))
        return streams
    caps = {"train": max_train_blocks, "validation": max_eval_blocks}
    built: dict[str, Dataset] = {}
    for name, split in splits.items():
        if len(split) == 0:
            raise ValueError(
                f"the {name} split of {source!r} has no documents (validation_percent={validation_percent} of "
                f"{sum(len(s) for s in splits.values())} documents): add documents or give the split its own files, "
                "e.g. {'train': 'train.txt', 'validation': 'valid.txt'}."
            )
        blocks = pack_documents(split, tokenizer, block_size, text_column=text_column, add_bos=add_bos, num_proc=num_proc,
                                skip_records_without_text=skip_records_without_text)
        token_id_range(blocks)  # scanned once per cache file and recorded beside it
        built[name] = _cap(blocks, caps[name])
        if len(built[name]) == 0 and caps[name] != 0:
            raise ValueError(
                f"the {name} split of {source!r} has no complete block of {block_size} tokens: add text or lower block_size."
            )
    attach_sources(built["train"], training_sources(source, config=config, load_kwargs=load_kwargs))
    return DatasetDict(built)

"""Load raw text data (one document per row) from any supported source as train/validation splits.

Supported sources:

* ``None`` or ``"wikipedia-sample"``: the cleaned Wikipedia sample shipped with gensim
  (:func:`boost_hf.data.corpus.load_wikipedia_sample`);
* local files, as one path, a glob, a list of them, or a ``{split: files}`` mapping:
  ``.txt``/``.text`` go through the ``text`` builder (one row per line by default),
  ``.json``/``.jsonl`` (optionally ``.gz``/``.bz2``/``.xz``/``.zst``) through ``json``,
  ``.csv`` and ``.parquet`` through their builders;
* a folder written by ``Dataset.save_to_disk``/``DatasetDict.save_to_disk``;
* any other local folder (``datasets`` infers its format);
* otherwise a Hugging Face Hub dataset name (``config`` selects its configuration), which
  needs network access or a populated cache; ``streaming=True`` avoids downloading it whole.

If the source has no validation split (``validation``, ``valid``, ``val``, ``dev`` or
``test``), one is carved from ``train`` by a stable hash of each document's text (of its ids, pre-tokenized).

Records without text (the field missing or null, or holding another type: a number, a list) are counted and refused,
naming the count and the first of another type (its file, line and type); with ``skip_records_without_text`` they are
left out and the count is logged (a stream, which cannot be counted ahead, refuses or skips them as it reads them:
:func:`~boost_hf.data.pipeline.document_token_ids`). A local folder holding an empty data file is refused, naming and
counting them, as a single empty file is.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Union

from datasets import (
    Dataset,
    DatasetDict,
    IterableDataset,
    IterableDatasetDict,
    load_dataset,
    load_from_disk,
)
from datasets.exceptions import DatasetGenerationError

from .checks import check_text_file, require_existing_path
from .corpus import DEFAULT_VALIDATION_PERCENT, load_wikipedia_sample
from .fingerprint import DataSources, folder_files
from .splits import split_by_key

logger = logging.getLogger(__name__)

DEFAULT_SOURCE = "wikipedia-sample"
VALIDATION_SPLIT_NAMES: tuple[str, ...] = ("validation", "valid", "val", "dev", "test")

_COMPRESSION_SUFFIXES = (".gz", ".bz2", ".xz", ".zst", ".lz4")
_BUILDERS = {
    ".txt": "text",
    ".text": "text",
    ".json": "json",
    ".jsonl": "json",
    ".ndjson": "json",
    ".csv": "csv",
    ".parquet": "parquet",
}

PathLike = Union[str, os.PathLike[str]]
Source = Union[None, PathLike, Sequence[PathLike], Mapping[str, Union[PathLike, Sequence[PathLike]]]]
AnyDatasetDict = Union[DatasetDict, IterableDatasetDict]


def builder_for_file(path: PathLike) -> str:
    """Return the ``datasets`` packaged builder (``text``, ``json``, ``csv``, ``parquet``) for a file name."""
    name = os.fspath(path).lower()
    for suffix in _COMPRESSION_SUFFIXES:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    for extension, builder in _BUILDERS.items():
        if name.endswith(extension):
            return builder
    raise ValueError(f"cannot infer the file format of {os.fspath(path)!r}; supported: {sorted(_BUILDERS)}")


def _as_file_list(value: PathLike | Sequence[PathLike]) -> list[str] | None:
    """Expand a path, glob or list of them to existing files; None if nothing local matches."""
    items = [value] if isinstance(value, (str, os.PathLike)) else list(value)
    files: list[str] = []
    for item in items:
        text = os.fspath(item)
        if os.path.isfile(text):
            files.append(text)
        elif glob.has_magic(text):
            matches = sorted(path for path in glob.glob(text) if os.path.isfile(path))
            if not matches:
                raise FileNotFoundError(f"no file matches {text!r}")
            files.extend(matches)
        else:
            return None
    return files or None


def _is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def _load_files(
    data_files: dict[str, list[str]],
    *,
    streaming: bool,
    datasets_cache_dir: str | None,
    load_kwargs: Mapping[str, Any],
    text_column: str = "text",
) -> AnyDatasetDict:
    builders = {builder_for_file(path) for files in data_files.values() for path in files}
    if len(builders) != 1:
        raise ValueError(f"all data files must share one format, got {sorted(builders)}")
    paths = [path for files in data_files.values() for path in files]
    for path in paths:
        if builder_for_file(path) != "parquet" and not path.lower().endswith(_COMPRESSION_SUFFIXES):
            check_text_file(path)
    builder = builders.pop()
    if builder == "parquet":
        check_parquet_footers(paths)
    try:
        loaded = load_dataset(builder, data_files=data_files, streaming=streaming, cache_dir=datasets_cache_dir, **load_kwargs)
    except DatasetGenerationError as error:
        unreadable = unreadable_file_error(paths, load_kwargs)
        if unreadable is not None or len(data_files) == 1:
            raise unreadable or _types_differ_error(paths, text_column, error) or error
        # each file reads alone: the splits' columns differ in type (a split's 'text' field holding numbers, its
        # records refused or skipped by load_text_splits): each split read on its own
        try:
            splits = {split: load_dataset(builder, data_files={split: files}, split=split, streaming=streaming,
                                          cache_dir=datasets_cache_dir, **load_kwargs) for split, files in data_files.items()}
        except DatasetGenerationError as split_error:
            raise _types_differ_error(paths, text_column, split_error) or split_error from None
        return IterableDatasetDict(splits) if streaming else DatasetDict(splits)
    return loaded


def _types_differ_error(paths: list[str], text_column: str, error: BaseException) -> ValueError | None:
    """After files that each read alone failed to read together (their columns differ in type): the ``ValueError``
    naming the first record whose ``text_column`` is not text, if there is one, else ``None``."""
    where = first_record_not_text(paths, text_column)
    if where is None:
        return None
    return ValueError(
        f"{where}: its {text_column!r} field is not text (a string), while other files' records hold text there, so the "
        f"files cannot be read together ({type(error.__cause__ or error).__name__}). Give that record its text, or move it "
        "out of these files (--skip_records_without_text leaves such records out of a split whose files read together)."
    )


def check_parquet_footers(paths: list[str]) -> None:
    """``ValueError`` naming the first Parquet file whose footer (its schema and row groups, a few KiB at the end of
    the file) cannot be read: a truncated, damaged or not-Parquet file (pyarrow: "Parquet magic bytes not found")."""
    import pyarrow.parquet as pq

    for path in paths:
        try:
            pq.read_metadata(path)
        except Exception as error:  # noqa: BLE001 (pyarrow's ArrowInvalid, OSError: named with the file below)
            raise ValueError(_unreadable(path, "parquet", error)) from None


def _unreadable(path: str, builder: str, error: BaseException) -> str:
    reason = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
    return (f"data file {path!r} cannot be read as {builder} ({type(error).__name__}: {reason}): it is damaged, "
            "truncated or not in that format; replace it or remove it from the dataset.")


def unreadable_file_error(paths: list[str], load_kwargs: Mapping[str, Any] | None = None) -> ValueError | None:
    """After reading the data failed: the ``ValueError`` naming the first of ``paths`` that its reader cannot read, with
    the reader's error (a JSON Lines file: its first invalid line), or ``None`` if each reads on its own. Reads the
    files, one by one: for the error path only."""
    for path in paths:
        builder = builder_for_file(path)
        try:
            if builder == "json":
                check_json_lines(path)
            for _ in load_dataset(builder, data_files=[path], split="train", streaming=True, **dict(load_kwargs or {})):
                pass
        except ValueError as error:
            if str(error).startswith(f"data file {path!r}"):
                return error
            return ValueError(_unreadable(path, builder, error))
        except Exception as error:  # noqa: BLE001 (the reader's own error, named with its file)
            return ValueError(_unreadable(path, builder, error))
    return None


def check_json_lines(path: str) -> None:
    """Raise ``ValueError`` naming the first line of the JSON Lines file ``path`` that is not valid JSON (a file that
    is one JSON document passes)."""
    if path.lower().endswith(_COMPRESSION_SUFFIXES):
        return
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        json.loads(text)
        return
    except json.JSONDecodeError:
        pass
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"data file {path!r}, line {number}: not valid JSON ({error.msg} at column {error.colno}): "
                    f"{line[:80]!r}. Fix or remove that line (JSON Lines: one JSON object per line)."
                ) from None


def check_no_empty_data_files(folder: str) -> None:
    """Raise ``ValueError`` naming and counting the empty data files under ``folder`` (0 bytes, of a format
    :func:`builder_for_file` knows), as a single empty data file is refused (:func:`check_text_file`): ``datasets``
    would leave them out without a word."""
    empty = [os.path.relpath(path, folder) for path in folder_files(folder)
             if _is_data_file(path) and os.path.getsize(path) == 0]
    if empty:
        shown = ", ".join(empty[:5]) + (f", ... ({len(empty) - 5} more)" if len(empty) > 5 else "")
        raise ValueError(f"the data folder {folder!r} holds {len(empty)} empty data file{'s' if len(empty) > 1 else ''} (0 "
                         f"bytes): {shown}. Remove {'them' if len(empty) > 1 else 'it'} from the folder or fill "
                         f"{'them' if len(empty) > 1 else 'it'}, as for a single empty data file.")


def _is_data_file(path: str) -> bool:
    try:
        builder_for_file(path)
    except ValueError:
        return False
    return True


def local_data_files(source: Source) -> list[str] | None:
    """The local data files ``source`` names (a file, a glob, a list of them, a ``{split: files}`` mapping), as
    :func:`load_raw_dataset` reads them; ``None`` for the other sources (a folder, the Wikipedia sample, the Hub)."""
    if source is None or (isinstance(source, str) and source == DEFAULT_SOURCE):
        return None
    if isinstance(source, Mapping):
        found = [_as_file_list(value) for value in source.values()]
        return None if any(files is None for files in found) else [path for files in found for path in files]
    if isinstance(source, (str, os.PathLike)) and os.path.isdir(os.path.expanduser(os.fspath(source))):
        return None
    try:
        return _as_file_list(source if isinstance(source, (str, os.PathLike)) else list(source))
    except FileNotFoundError:
        return None


def split_files(source: Source) -> dict[str, list[str]]:
    """The local data files of each split of ``source`` (a ``{split: files}`` mapping's; all of them for ``train``
    when the source is files without splits); ``{}`` for the other sources."""
    if isinstance(source, Mapping):
        return {str(split): files for split, value in source.items() if (files := _as_file_list(value))}
    files = local_data_files(source)
    return {"train": files} if files else {}


def training_sources(source: Source = None, *, config: str | None = None,
                     load_kwargs: Mapping[str, Any] | None = None) -> DataSources:
    """The :class:`~boost_hf.data.fingerprint.DataSources` of ``source``'s training split: its local files (a
    ``{split: files}`` mapping: its ``train`` files; a folder: the files under it), or, for the Wikipedia sample and a
    Hub dataset, what pins it (the dump's SHA-256 and the cleaning version; the name, configuration and revision)."""
    if source is None or (isinstance(source, str) and source == DEFAULT_SOURCE):
        from .corpus import CLEANING_VERSION, WIKI_SAMPLE_SHA256

        return DataSources(f"the Wikipedia sample (sha256 {WIKI_SAMPLE_SHA256[:16]}..., cleaning version {CLEANING_VERSION})")
    if isinstance(source, Mapping) and "train" in source:
        return DataSources(f"the files {source['train']!r}", tuple(_as_file_list(source["train"]) or ()))
    files = local_data_files(source)
    if files is not None:
        return DataSources(f"the files {source!r}", tuple(files))
    path = os.path.expanduser(os.fspath(source)) if isinstance(source, (str, os.PathLike)) else None
    if path is not None and os.path.isdir(path):
        train = os.path.join(path, "train")  # a DatasetDict.save_to_disk folder: its train split
        folder = train if os.path.isfile(os.path.join(path, "dataset_dict.json")) and os.path.isdir(train) else path
        return DataSources(f"the folder {folder!r}", tuple(folder_files(folder)))
    pinned = [f"configuration {config}"] if config else []
    pinned += [f"revision {load_kwargs['revision']}"] if load_kwargs and load_kwargs.get("revision") else []
    return DataSources(f"the Hub dataset {os.fspath(source)!r}" + (f" ({', '.join(pinned)})" if pinned else ""))


def load_raw_dataset(
    source: Source = None,
    *,
    config: str | None = None,
    streaming: bool = False,
    cache_dir: PathLike | None = None,
    datasets_cache_dir: PathLike | None = None,
    validation_percent: float = DEFAULT_VALIDATION_PERCENT,
    load_kwargs: Mapping[str, Any] | None = None,
    text_column: str = "text",
) -> Dataset | IterableDataset | AnyDatasetDict:
    """Load ``source`` as ``datasets`` returns it (see the module docstring for the accepted forms).

    Args:
        config: Hub dataset configuration name.
        streaming: return iterable datasets instead of downloading/materialising everything.
        cache_dir: boost_hf cache root (used by the Wikipedia sample).
        datasets_cache_dir: ``datasets`` cache folder for ``load_dataset`` (default: its own).
        validation_percent: validation share for the Wikipedia sample.
        load_kwargs: extra keyword arguments for ``load_dataset`` (e.g. ``sample_by="paragraph"``
            for text files, ``revision`` or ``token`` for the Hub).
        text_column: the field holding the text (named when local files cannot be read together because a record's
            field is not text).
    """
    kwargs = dict(load_kwargs or {})
    hf_cache = os.fspath(datasets_cache_dir) if datasets_cache_dir is not None else None
    if source is None or (isinstance(source, str) and source == DEFAULT_SOURCE):
        wiki = load_wikipedia_sample(cache_dir, validation_percent)
        if streaming:
            return IterableDatasetDict({name: split.to_iterable_dataset() for name, split in wiki.items()})
        return wiki
    if isinstance(source, Mapping):
        data_files: dict[str, list[str]] = {}
        for split, value in source.items():
            files = _as_file_list(value)
            if files is None:
                raise FileNotFoundError(f"no data files found for split {split!r}: {value!r}")
            data_files[str(split)] = files
        return _load_files(data_files, streaming=streaming, datasets_cache_dir=hf_cache, load_kwargs=kwargs,
                           text_column=text_column)
    if not isinstance(source, (str, os.PathLike)):
        files = _as_file_list(source)
        if files is None:
            raise FileNotFoundError(f"no data files found in {source!r}")
        return _load_files({"train": files}, streaming=streaming, datasets_cache_dir=hf_cache, load_kwargs=kwargs,
                           text_column=text_column)
    require_existing_path(source, "dataset")
    path = Path(os.fspath(source)).expanduser()
    if path.is_dir():
        check_no_empty_data_files(os.fspath(path))
        if _is_saved_dataset(path):
            loaded = load_from_disk(os.fspath(path))
            if streaming:
                if isinstance(loaded, DatasetDict):
                    return IterableDatasetDict({k: v.to_iterable_dataset() for k, v in loaded.items()})
                return loaded.to_iterable_dataset()
            return loaded
        return load_dataset(os.fspath(path), config, streaming=streaming, cache_dir=hf_cache, **kwargs)
    files = _as_file_list(os.fspath(source))
    if files is not None:
        return _load_files({"train": files}, streaming=streaming, datasets_cache_dir=hf_cache, load_kwargs=kwargs,
                           text_column=text_column)
    return load_dataset(os.fspath(source), config, streaming=streaming, cache_dir=hf_cache, **kwargs)


def not_text(value) -> str:
    """How a record's text field that is not a string reads in messages: ``"an int (5)"``, ``"a list (['a', 'b'])"``."""
    import reprlib

    kind = type(value).__name__
    return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} ({reprlib.repr(value)})"


def first_record_not_text(paths: Sequence[str], text_column: str) -> str | None:
    """Where the first record of the local files ``paths`` whose ``text_column`` holds something other than a string
    (a number, a list, an object) is: ``"data file 'docs.jsonl', line 11"``, or ``None`` (not found, or not a format
    read here: JSON Lines, JSON and Parquet are). Reads the files: for the error path only."""
    for path in paths:
        builder = builder_for_file(path)
        if builder == "parquet":
            import pyarrow.parquet as pq

            column = pq.read_table(path, columns=[text_column]).column(text_column).to_pylist()
            found = next((i for i, value in enumerate(column) if value is not None and not isinstance(value, str)), None)
            if found is not None:
                return f"data file {path!r}, row {found}"
        elif builder == "json" and not path.lower().endswith(_COMPRESSION_SUFFIXES):
            with open(path, encoding="utf-8") as f:
                for number, line in enumerate(f, start=1):
                    try:
                        record = json.loads(line) if line.strip() else None
                    except json.JSONDecodeError:
                        break  # one JSON document, not JSON Lines
                    value = record.get(text_column) if isinstance(record, dict) else None
                    if value is not None and not isinstance(value, str):
                        return f"data file {path!r}, line {number}"
    return None


def without_missing_text(dataset: Dataset, text_column: str, split: str, skip: bool, files: Sequence[str] = ()) -> Dataset:
    """``dataset`` (map-style, text) if every record's ``text_column`` holds text (a string); else ``ValueError`` naming
    how many do not (the field missing or null: counted from the Arrow column's null count, no pass over the data;
    another type, a number or a list: the column is read), and the first of another type, in its file of ``files``
    and by its type; or, with ``skip``, ``dataset`` without them (a cached filter) and a warning with the count."""
    import pyarrow as pa

    column = dataset.with_format("arrow")[text_column]
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        missing, other = column.null_count, []
    else:  # numbers, lists, or a JSON column of several types: which records are not text
        values = dataset[text_column]
        missing = sum(value is None for value in values)
        other = [i for i, value in enumerate(values) if value is not None and not isinstance(value, str)]
    if not missing and not other:
        return dataset
    if not skip:
        if other:
            where = first_record_not_text(files, text_column) or f"record {other[0]} of the {split} data"
            what = (f"{missing + len(other)} of {len(dataset)} records of the {split} data have no text in their "
                    f"{text_column!r} field: {len(other)} hold{'s' if len(other) == 1 else ''} another type than text (the first, {where}: "
                    f"{not_text(values[other[0]])})" + (f", {missing} have no such field or a null one" if missing else ""))
        else:
            what = f"{missing} of {len(dataset)} records of the {split} data have no {text_column!r} field (or a null one)"
        raise ValueError(
            f"{what}: they would be left out of the {split} data. Give every record its text (a string), set text_column "
            "to the field that holds it, or pass --skip_records_without_text true (skip_records_without_text=True) to "
            "leave them out."
        )
    logger.warning("skipping %d of %d records of the %s data without a %r field (or whose %r is null or not text) "
                   "(skip_records_without_text)", missing + len(other), len(dataset), split, text_column, text_column)
    return dataset.filter(lambda batch: [isinstance(text, str) for text in batch[text_column]], batched=True,
                          desc=f"Leaving out the records without text in {text_column!r}")


def load_text_splits(
    source: Source = None,
    *,
    text_column: str = "text",
    validation_percent: float = DEFAULT_VALIDATION_PERCENT,
    config: str | None = None,
    streaming: bool = False,
    cache_dir: PathLike | None = None,
    datasets_cache_dir: PathLike | None = None,
    load_kwargs: Mapping[str, Any] | None = None,
    skip_records_without_text: bool = False,
) -> AnyDatasetDict:
    """Load ``source`` as a dict with exactly ``train`` and ``validation`` splits.

    A source with one split (or a plain dataset) is used as ``train``; a missing validation
    split is carved from ``train`` with :func:`boost_hf.data.splits.split_by_key` on
    ``text_column`` (``input_ids`` for pre-tokenized documents), so it is deterministic and disjoint by document.
    Records of a map-style source without ``text_column`` are refused (:func:`without_missing_text`).
    """
    loaded = load_raw_dataset(
        source,
        config=config,
        streaming=streaming,
        cache_dir=cache_dir,
        datasets_cache_dir=datasets_cache_dir,
        validation_percent=validation_percent,
        load_kwargs=load_kwargs,
        text_column=text_column,
    )
    if isinstance(loaded, (Dataset, IterableDataset)):
        splits: dict[str, Any] = {"train": loaded}
    else:
        splits = dict(loaded)
    if "train" in splits:
        train = splits["train"]
    elif len(splits) == 1:
        train = next(iter(splits.values()))
    else:
        raise ValueError(f"source has no 'train' split (splits: {sorted(splits)})")
    validation = next((splits[name] for name in VALIDATION_SPLIT_NAMES if name in splits), None)
    columns = train.column_names
    pre_tokenized = columns is not None and "input_ids" in columns
    if columns is not None and text_column not in columns and not pre_tokenized:
        raise ValueError(f"text column {text_column!r} not found, and no input_ids column; columns are {columns}")
    if not pre_tokenized and isinstance(train, Dataset):
        files = split_files(source)
        train = without_missing_text(train, text_column, "train", skip_records_without_text, files.get("train", ()))
        if isinstance(validation, Dataset):
            validation = without_missing_text(validation, text_column, "validation", skip_records_without_text,
                                              files.get("validation", ()))
    if validation is None:
        return split_by_key(train, "input_ids" if pre_tokenized else text_column, validation_percent)
    if isinstance(train, IterableDataset):
        return IterableDatasetDict({"train": train, "validation": validation})
    return DatasetDict({"train": train, "validation": validation})

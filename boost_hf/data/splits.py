"""Deterministic, content-keyed train/validation splitting.

A record goes to validation when a stable hash (SHA-256, never Python's salted
``hash``) of its key falls below ``validation_percent``. The split therefore
depends only on the key (an article title, the text itself, or a pre-tokenized
document's ids), not on record order, process, machine or random seed. A map-style
split is a cached ``datasets.filter`` (fingerprinted by the dataset, key and
percentage): the documents are hashed once per cache, not by every rank of every run.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from datasets import Dataset, DatasetDict, IterableDataset, IterableDatasetDict

_SALT = b"boost_hf/split/v1:"
_BUCKETS = 10_000


def split_bucket(key: str) -> int:
    """Map ``key`` to a stable bucket in ``[0, 10000)``."""
    digest = hashlib.sha256(_SALT + key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % _BUCKETS


def check_percent(validation_percent: float) -> None:
    """Raise ``ValueError`` unless ``validation_percent`` is within [0, 100]."""
    if not 0.0 <= validation_percent <= 100.0:
        raise ValueError(f"validation_percent must be in [0, 100], got {validation_percent}")


def is_validation(key: str, validation_percent: float) -> bool:
    """Return True if ``key`` belongs to the validation split for ``validation_percent`` (0-100)."""
    check_percent(validation_percent)
    return split_bucket(key) < round(validation_percent * _BUCKETS / 100)


def split_by_key(
    dataset: Dataset | IterableDataset,
    key_column: str,
    validation_percent: float,
) -> DatasetDict | IterableDatasetDict:
    """Split ``dataset`` into ``train``/``validation`` by hashing the ``key_column`` of each record (a record of a
    stream without it: its ``input_ids``).

    Works for map-style (a cached filter) and streaming datasets (a lazy filter).
    """
    check_percent(validation_percent)

    def in_validation(record: dict[str, Any]) -> bool:
        return is_validation(str(record[key_column] if key_column in record else record["input_ids"]), validation_percent)

    def in_train(record: dict[str, Any]) -> bool:
        return not in_validation(record)

    def cached(name: str) -> dict[str, Any]:
        if not isinstance(dataset, Dataset):
            return {}
        parts = json.dumps([_SALT.decode(), dataset._fingerprint, key_column, validation_percent, name])
        return {"new_fingerprint": hashlib.sha256(parts.encode()).hexdigest()[:32], "desc": f"Selecting the {name} split"}

    train = dataset.filter(in_train, **cached("train"))
    validation = dataset.filter(in_validation, **cached("validation"))
    if isinstance(dataset, IterableDataset):
        return IterableDatasetDict({"train": train, "validation": validation})
    return DatasetDict({"train": train, "validation": validation})

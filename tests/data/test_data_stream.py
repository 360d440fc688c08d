"""Streams that resume without re-reading, the seeded shuffle buffer, pre-tokenized documents, the packed cache's
size, labels derived when collating, and whole-column checks done once per cache."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pytest
import torch
from datasets import Dataset

from boost_hf.data import BlockStream, build_lm_datasets, causal_lm_collator, document_token_ids, pack_documents, splits
from boost_hf.data import checks

BLOCK = 16


class IdsTokenizer:
    """What :func:`document_token_ids` needs of a tokenizer for pre-tokenized documents: eos, bos, a vocabulary."""

    bos_token_id, eos_token_id = 1, 2

    def __len__(self) -> int:
        return 100

    def get_vocab(self) -> dict[str, int]:
        return {f"t{i}": i for i in range(100)}


def documents(count: int, seed: int = 0) -> dict[str, list]:
    """Pre-tokenized documents of 3 to 30 ids in [3, 100), each with its number in ``doc``."""
    rng = np.random.default_rng(seed)
    return {"input_ids": [rng.integers(3, 100, rng.integers(3, 31)).tolist() for _ in range(count)], "doc": list(range(count))}


def saved_and_loaded(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("shuffle_buffer", [0, 8])
@pytest.mark.parametrize("count", [1, 3])
def test_a_resumed_cursor_gives_the_rest_of_the_pass_reading_no_document_twice(shuffle_buffer, count):
    """A logical stream's cursor saved after 11 blocks (its state through ``torch.save``/``load(weights_only=True)``)
    and restored in a new cursor gives exactly the blocks the uninterrupted cursor gives next; the two cursors
    together read each of the stream's documents once. The next pass starts again (shuffled anew)."""
    source = Dataset.from_dict(documents(400)).to_iterable_dataset(num_shards=4)
    stream = BlockStream(source, document_token_ids(IdsTokenizer()), BLOCK, shuffle_buffer=shuffle_buffer, seed=3)
    for index in range(count):
        whole = stream.cursor(index, count)
        expected = [block["input_ids"] for block in whole.take(10**6)]
        first = stream.cursor(index, count)
        head = first.take(11)
        resumed = stream.cursor(index, count)
        resumed.load_state_dict(saved_and_loaded(first.state_dict()))
        tail = resumed.take(10**6)
        assert len(head) + len(tail) == len(expected) > 11
        assert all(np.array_equal(block["input_ids"], want) for block, want in zip(head + tail, expected))
        assert first.documents_read + resumed.documents_read == whole.documents_read, "a document was read twice"
        resumed.restart(1)  # the next pass: shuffled anew with a buffer, in stream order without
        again = np.stack([block["input_ids"] for block in resumed.take(4)])
        assert np.array_equal(again, np.stack(expected[:4])) == (shuffle_buffer == 0)


def test_the_shuffle_buffer_is_seeded_and_permutes_the_blocks():
    source = Dataset.from_dict(documents(300)).to_iterable_dataset()
    to_ids = document_token_ids(IdsTokenizer())

    def blocks(shuffle_buffer: int, seed: int) -> list[tuple]:
        return [tuple(block["input_ids"]) for block in BlockStream(source, to_ids, BLOCK, shuffle_buffer=shuffle_buffer, seed=seed)]

    in_order, shuffled = blocks(0, 0), blocks(16, 0)
    assert shuffled == blocks(16, 0) and shuffled != blocks(16, 1) and shuffled != in_order
    assert sorted(shuffled) == sorted(in_order)
    displacement = [abs(shuffled.index(block) - i) for i, block in enumerate(in_order)]
    assert max(displacement) > 16, "blocks stay near their place in the stream"


def test_pre_tokenized_documents_are_packed_like_text():
    """``input_ids`` (+ ``attention_mask``, ``labels``): masked positions dropped, eos appended unless present, bos put
    first with add_bos unless present, the documents' labels kept beside (the added tokens labelled by themselves);
    the map-style cache and the stream give the same blocks."""
    tokenizer = IdsTokenizer()
    rows = {"input_ids": [[5, 6, 7, 0, 0], [1, 8, 2], [9, 10]],
            "attention_mask": [[1, 1, 1, 0, 0], [1, 1, 1], [1, 1]],
            "labels": [[-100, 6, 7, -100, -100], [1, -100, 2], [9, 10]]}
    to_ids = document_token_ids(tokenizer, add_bos=True)
    out = to_ids(rows)
    assert [ids.tolist() for ids in out["input_ids"]] == [[1, 5, 6, 7, 2], [1, 8, 2], [1, 9, 10, 2]]
    assert [labels.tolist() for labels in out["labels"]] == [[1, -100, 6, 7, 2], [1, -100, 2], [1, 9, 10, 2]]
    dataset = Dataset.from_dict({name: values * 4 for name, values in rows.items()})
    packed = pack_documents(dataset, tokenizer, 4, add_bos=True)
    assert packed.column_names == ["input_ids", "labels"] and packed.features["labels"].feature.dtype == "int32"
    streamed = list(BlockStream(dataset.to_iterable_dataset(), to_ids, 4))
    assert [b["input_ids"].tolist() for b in streamed] == packed["input_ids"]
    assert [b["labels"].tolist() for b in streamed] == packed["labels"]
    with pytest.raises(ValueError, match=r"holds token id 100, outside the tokenizer's vocabulary \[0, 100\)"):
        to_ids({"input_ids": [[3, 100]]})


def test_a_pre_tokenized_source_is_accepted_by_the_builder(tmp_path):
    """A saved dataset with an ``input_ids`` column and no text: split into train/validation by its ids' hash."""
    Dataset.from_dict(documents(200)).save_to_disk(tmp_path / "ids")
    built = build_lm_datasets(str(tmp_path / "ids"), IdsTokenizer(), BLOCK, validation_percent=20)
    assert built["train"].column_names == ["input_ids"] and len(built["validation"]) > 0
    streamed = build_lm_datasets(str(tmp_path / "ids"), IdsTokenizer(), BLOCK, validation_percent=20, streaming=True)
    assert [b["input_ids"].tolist() for b in streamed["validation"]] == built["validation"]["input_ids"]


def test_labels_are_derived_when_collating():
    batch = causal_lm_collator([{"input_ids": np.array([4, 5, 6], np.uint16)}, {"input_ids": np.array([7, 8, 9], np.uint16)}])
    assert batch["input_ids"].dtype == batch["labels"].dtype == torch.int64
    assert torch.equal(batch["labels"], batch["input_ids"])
    masked = causal_lm_collator([{"input_ids": [4, 5, 0], "attention_mask": [1, 1, 0]}])
    assert masked["labels"].tolist() == [[4, 5, -100]]
    own = causal_lm_collator([{"input_ids": [4, 5], "labels": [-100, 5]}])
    assert own["labels"].tolist() == [[-100, 5]]


def write_jsonl(path: Path, count: int) -> Path:
    words = ["river", "mountain", "history", "music", "climate", "people", "language", "city"]
    lines = [json.dumps({"text": " ".join(words[(i * 7 + j) % 8] for j in range(20 + i % 30))}) for i in range(count)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_the_packed_cache_stores_about_two_bytes_per_token(small_tokenizer, tmp_path):
    """The cache is one Arrow file of ``uint16`` ids (the 512-token tokenizer fits), no labels, no tokenized copy of
    the documents: at most 2 + 4 / 64 bytes per token (the row offsets), against 12 when labels were stored."""
    built = build_lm_datasets(write_jsonl(tmp_path / "docs.jsonl", 600), small_tokenizer, 64, datasets_cache_dir=tmp_path / "hf")
    train = built["train"]
    files = {entry["filename"] for entry in train.cache_files}
    assert len(files) == 1 and train.column_names == ["input_ids"]
    size = sum(Path(name).stat().st_size for name in files)
    assert size / (len(train) * 64) <= 2 + 4 / 64 + 0.02, size / (len(train) * 64)
    arrow_files = list((tmp_path / "hf").rglob("cache-*.arrow"))
    assert len(arrow_files) == 4, "train and validation: the split's indices and the blocks, no tokenized documents"


def test_whole_column_checks_run_once_per_cache(small_tokenizer, tmp_path, monkeypatch):
    """The id range of a packed cache is scanned once (recorded beside its file) and the train/validation split of
    documents is hashed once: a second build, or the trainer's check, reads the records."""
    source = write_jsonl(tmp_path / "docs.jsonl", 300)
    scans, hashes = [], []
    min_max, split_bucket = pc.min_max, splits.split_bucket
    monkeypatch.setattr(pc, "min_max", lambda *a, **k: scans.append(1) or min_max(*a, **k))
    monkeypatch.setattr(splits, "split_bucket", lambda key: hashes.append(1) or split_bucket(key))
    first = build_lm_datasets(source, small_tokenizer, 32, datasets_cache_dir=tmp_path / "hf")
    assert len(scans) == 2 and len(hashes) == 2 * 300  # each document hashed by the train and the validation filter
    scans.clear(), hashes.clear()
    again = build_lm_datasets(source, small_tokenizer, 32, datasets_cache_dir=tmp_path / "hf")
    assert checks.token_id_range(again["train"]) == checks.token_id_range(first["train"])
    assert scans == [] and hashes == []
    from boost_hf.training.preflight import check_dataset

    check_dataset(again["train"], 512, "training", 1)
    assert scans == []
    bad = again["train"].map(lambda row: {"input_ids": [511] * 32}, features=again["train"].features)
    with pytest.raises(ValueError, match=r"token id 511 in .* is outside the model's vocabulary"):
        check_dataset(bad, 300, "training", 1)
    assert len(scans) == 1, "a new cache file is scanned"

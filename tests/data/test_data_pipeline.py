"""Tests for tokenizing and packing documents into causal-LM blocks."""

from __future__ import annotations

import json
import re
from itertools import chain
from pathlib import Path

import pytest
from datasets import Dataset, DatasetDict, IterableDataset, IterableDatasetDict

from boost_hf.data import BlockStream, build_lm_datasets, sources
from boost_hf.data.pipeline import pack_blocks, tokenize_documents
from boost_hf.data.splits import is_validation

BLOCK = 32
SENTENCES = [
    f"Document {i} talks about the {word} of the river and the mountain, numbered {i * 7}."
    for i, word in enumerate(
        ["history", "geography", "economy", "culture", "music", "climate", "people", "language"] * 5
    )
]


def _write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)), encoding="utf-8")
    return path


def _assert_blocks(ds: Dataset, block_size: int) -> None:
    """Blocks hold ids only (labels are derived when batches are collated), stored in 2 bytes."""
    assert ds.column_names == ["input_ids"]
    assert ds.features["input_ids"].feature.dtype == "uint16"
    assert len(ds) > 0
    for row in ds:
        assert len(row["input_ids"]) == block_size


def _expected_stream(texts: list[str], tokenizer) -> list[int]:
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return list(chain.from_iterable(doc + [tokenizer.eos_token_id] for doc in ids))


def test_wiki_blocks(small_tokenizer, data_cache: Path) -> None:
    built = build_lm_datasets(None, small_tokenizer, 64, cache_dir=data_cache)
    assert isinstance(built, DatasetDict) and set(built) == {"train", "validation"}
    _assert_blocks(built["train"].select(range(200)), 64)
    _assert_blocks(built["validation"], 64)
    assert len(built["train"]) > 20 * len(built["validation"]) // 2


def test_json_source_packs_exactly(small_tokenizer, tmp_path: Path) -> None:
    source = _write_jsonl(tmp_path / "docs.jsonl", SENTENCES)
    built = build_lm_datasets(
        source, small_tokenizer, BLOCK, validation_percent=25, datasets_cache_dir=tmp_path / "hf"
    )
    train_texts = [t for t in SENTENCES if not is_validation(t, 25)]
    valid_texts = [t for t in SENTENCES if is_validation(t, 25)]
    assert train_texts and valid_texts
    for name, texts in (("train", train_texts), ("validation", valid_texts)):
        stream = _expected_stream(texts, small_tokenizer)
        usable = len(stream) - len(stream) % BLOCK
        _assert_blocks(built[name], BLOCK)
        assert list(chain.from_iterable(built[name]["input_ids"])) == stream[:usable]
    again = build_lm_datasets(
        str(source), small_tokenizer, BLOCK, validation_percent=25, datasets_cache_dir=tmp_path / "hf2"
    )
    assert again["train"]["input_ids"][:] == built["train"]["input_ids"][:]
    assert again["validation"]["input_ids"][:] == built["validation"]["input_ids"][:]
    capped = build_lm_datasets(
        source,
        small_tokenizer,
        BLOCK,
        validation_percent=25,
        max_train_blocks=2,
        max_eval_blocks=1,
        datasets_cache_dir=tmp_path / "hf",
    )
    assert capped["train"]["input_ids"][:] == built["train"]["input_ids"][:2]
    assert capped["validation"]["input_ids"][:] == built["validation"]["input_ids"][:1]


def test_text_files_with_explicit_validation(small_tokenizer, tmp_path: Path) -> None:
    (tmp_path / "train.txt").write_text("\n".join(SENTENCES[:30]) + "\n\n", encoding="utf-8")
    (tmp_path / "valid.txt").write_text("\n".join(SENTENCES[30:]) + "\n", encoding="utf-8")
    built = build_lm_datasets(
        {"train": tmp_path / "train.txt", "validation": str(tmp_path / "valid.txt")},
        small_tokenizer,
        BLOCK,
        datasets_cache_dir=tmp_path / "hf",
    )
    for name, texts in (("train", SENTENCES[:30]), ("validation", SENTENCES[30:])):
        _assert_blocks(built[name], BLOCK)
        stream = _expected_stream(texts, small_tokenizer)  # the blank line is skipped
        assert list(chain.from_iterable(built[name]["input_ids"])) == stream[: len(stream) - len(stream) % BLOCK]


def test_saved_to_disk_source_and_bos(small_tokenizer, tmp_path: Path) -> None:
    DatasetDict(
        {"train": Dataset.from_dict({"text": SENTENCES[:32]}), "test": Dataset.from_dict({"text": SENTENCES[32:]})}
    ).save_to_disk(tmp_path / "saved")
    built = build_lm_datasets(tmp_path / "saved", small_tokenizer, BLOCK, add_bos=True)
    _assert_blocks(built["train"], BLOCK)
    _assert_blocks(built["validation"], BLOCK)
    stream = list(chain.from_iterable(built["train"]["input_ids"]))
    assert stream[0] == small_tokenizer.bos_token_id
    assert stream.count(small_tokenizer.bos_token_id) >= 2


def test_streaming_local_source(small_tokenizer, tmp_path: Path) -> None:
    source = _write_jsonl(tmp_path / "docs.jsonl", SENTENCES)
    eager = build_lm_datasets(source, small_tokenizer, BLOCK, validation_percent=25, datasets_cache_dir=tmp_path / "a")
    lazy = build_lm_datasets(
        source,
        small_tokenizer,
        BLOCK,
        validation_percent=25,
        streaming=True,
        max_train_blocks=3,
        datasets_cache_dir=tmp_path / "b",
    )
    assert isinstance(lazy["train"], BlockStream)
    rows = list(lazy["train"])
    assert [row["input_ids"].tolist() for row in rows] == eager["train"]["input_ids"][:3]
    assert all(list(row) == ["input_ids"] for row in rows)
    assert [row["input_ids"].tolist() for row in lazy["validation"]] == eager["validation"]["input_ids"][:]


def test_missing_text_column_is_reported(small_tokenizer, tmp_path: Path) -> None:
    source = tmp_path / "docs.jsonl"
    source.write_text(json.dumps({"body": "hello"}) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="text column"):
        build_lm_datasets(source, small_tokenizer, BLOCK, datasets_cache_dir=tmp_path / "hf")


def test_stream_with_unknown_columns(small_tokenizer) -> None:
    def documents():
        for i, text in enumerate(SENTENCES):
            yield {"text": text, "meta": {"i": i}}

    stream = IterableDataset.from_generator(documents)
    assert stream.column_names is None
    rows = list(pack_blocks(tokenize_documents(stream, small_tokenizer), BLOCK))
    expected = _expected_stream(SENTENCES, small_tokenizer)
    assert list(chain.from_iterable(row["input_ids"] for row in rows)) == expected[: len(expected) // BLOCK * BLOCK]
    assert all(list(row) == ["input_ids"] for row in rows)


def test_hub_name_is_routed_to_load_dataset(small_tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[tuple, dict]] = []

    def fake_load_dataset(*args, **kwargs):
        calls.append((args, kwargs))

        def documents():
            yield from ({"text": text} for text in SENTENCES)

        return IterableDatasetDict({"train": IterableDataset.from_generator(documents)})

    monkeypatch.setattr(sources, "load_dataset", fake_load_dataset)
    built = build_lm_datasets(
        "someone/some-corpus", small_tokenizer, BLOCK, config="en", streaming=True, validation_percent=25,
        max_eval_blocks=1,
    )
    (args, kwargs), = calls
    assert args == ("someone/some-corpus", "en") and kwargs["streaming"] is True
    assert isinstance(built["train"], BlockStream) and isinstance(built["validation"], BlockStream)
    assert len(list(built["validation"])) == 1
    assert all(len(row["input_ids"]) == BLOCK for row in built["train"])


def test_records_without_the_text_field_are_counted_and_refused_or_skipped(small_tokenizer, tmp_path: Path, caplog) -> None:
    """9 of 40 JSON lines without ``text`` (one of them ``null``): refused with the count, map-style and streamed;
    skipped on request with the count logged, the blocks then those of the file without them."""
    lines = [{"text": t} if i % 5 else ({"title": f"t{i}"} if i != 10 else {"text": None}) for i, t in enumerate(SENTENCES)]
    lines = lines[:5 * 9]
    missing = sum(line.get("text") is None for line in lines)
    with_text = [line["text"] for line in lines if line.get("text") is not None]
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    clean = tmp_path / "clean.jsonl"
    clean.write_text("".join(json.dumps({"text": text, "title": "x"}) + "\n" for text in with_text), encoding="utf-8")
    files = {"train": str(source), "validation": str(clean)}
    with pytest.raises(ValueError, match=rf"{missing} of {len(lines)} records of the train data have no 'text' field \(or a "
                                         r"null one\).*--skip_records_without_text true"):
        build_lm_datasets(files, small_tokenizer, BLOCK, datasets_cache_dir=tmp_path / "hf")
    with caplog.at_level("WARNING"):
        built = build_lm_datasets(files, small_tokenizer, BLOCK, datasets_cache_dir=tmp_path / "hf",
                                  skip_records_without_text=True)
    assert f"skipping {missing} of {len(lines)} records of the train data without a 'text' field" in caplog.text
    assert built["train"]["input_ids"] == built["validation"]["input_ids"]  # the same documents, the same blocks

    stream = build_lm_datasets(files, small_tokenizer, BLOCK, streaming=True, max_eval_blocks=1,
                               datasets_cache_dir=tmp_path / "hf-stream")["train"]
    with pytest.raises(ValueError, match=r"record\(s\) read have no 'text' field .*--skip_records_without_text true"):
        list(stream)
    stream = build_lm_datasets(files, small_tokenizer, BLOCK, streaming=True, max_eval_blocks=1,
                               datasets_cache_dir=tmp_path / "hf-stream", skip_records_without_text=True)["train"]
    caplog.clear()
    with caplog.at_level("WARNING"):
        rows = [row["input_ids"].tolist() for row in stream]
    assert rows == built["train"]["input_ids"][: len(rows)] and len(rows) >= len(built["train"])
    assert stream.to_ids.records_without_text == missing and "without a 'text' field (or whose 'text' is null or not text) so far" in caplog.text


@pytest.mark.parametrize("value, kind", [(5, "an int (5)"), (["a", "b"], "a list (['a', 'b'])"), (2.5, "a float (2.5)")],
                         ids=["number", "list", "float"])
def test_a_text_that_is_not_text_names_the_file_the_record_and_the_type(small_tokenizer, tmp_path: Path, value, kind,
                                                                        caplog) -> None:
    """A JSON line whose ``text`` is a number or a list among 40 texts (and one null): map-style, refused naming the count,
    the file, the line and the type; streamed, refused when read, naming them too; ``--skip_records_without_text``
    leaves them out (counted) and the blocks are those of the file without them. Before: ``AttributeError: 'int'
    object has no attribute 'strip'``, no file or record named."""
    lines = [{"text": t} for t in SENTENCES]
    lines[12], lines[20] = {"text": value}, {"text": None}
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    clean = _write_jsonl(tmp_path / "clean.jsonl", [t for i, t in enumerate(SENTENCES) if i not in (12, 20)])
    files = {"train": str(source), "validation": str(clean)}
    where = rf"data file '{source}', line 13"
    with pytest.raises(ValueError, match=rf"2 of 40 records of the train data have no text in their 'text' field: 1 holds "
                                         rf"another type than text \(the first, {where}: {re.escape(kind)}\), 1 have no "
                                         r"such field or a null one: .*--skip_records_without_text true"):
        build_lm_datasets(files, small_tokenizer, BLOCK, datasets_cache_dir=tmp_path / "hf")
    with caplog.at_level("WARNING"):
        built = build_lm_datasets(files, small_tokenizer, BLOCK, datasets_cache_dir=tmp_path / "hf",
                                  skip_records_without_text=True)
    assert "skipping 2 of 40 records of the train data without a 'text' field (or whose 'text' is null or not text)" in caplog.text
    assert built["train"]["input_ids"] == built["validation"]["input_ids"]
    with pytest.raises(ValueError, match=rf"{where}: its 'text' field is not text \(a string\), while other files' records "
                                         r"hold text there, so the files cannot be read together"):
        build_lm_datasets([str(source), str(clean)], small_tokenizer, BLOCK, datasets_cache_dir=tmp_path / "hf")

    stream = build_lm_datasets({"train": str(source), "validation": str(clean)}, small_tokenizer, BLOCK, streaming=True,
                               max_eval_blocks=1, datasets_cache_dir=tmp_path / "hf-stream")["train"]
    with pytest.raises(ValueError, match=rf"a record read \({where}\) holds {re.escape(kind)} in its 'text' field, not "
                                         r"text: .*--skip_records_without_text true"):
        list(stream)
    stream = build_lm_datasets(files, small_tokenizer, BLOCK, streaming=True, max_eval_blocks=1,
                               datasets_cache_dir=tmp_path / "hf-stream", skip_records_without_text=True)["train"]
    rows = [row["input_ids"].tolist() for row in stream]
    assert rows == built["train"]["input_ids"][: len(rows)] and stream.to_ids.records_without_text == 2


def test_an_empty_file_in_a_data_folder_is_refused_as_a_single_empty_file_is(small_tokenizer, tmp_path: Path) -> None:
    """A folder of JSON Lines files, two of them empty: refused, counting and naming them (a single empty file is
    refused); before, ``datasets`` left them out without a word."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    _write_jsonl(folder / "part-0.jsonl", SENTENCES[:20])
    _write_jsonl(folder / "part-2.jsonl", SENTENCES[20:])
    for name in ("part-1.jsonl", "part-3.jsonl"):
        (folder / name).write_text("")
    with pytest.raises(ValueError, match=rf"the data folder '{folder}' holds 2 empty data files \(0 bytes\): part-1.jsonl, "
                                         r"part-3.jsonl. Remove them from the folder or fill them, as for a single empty data file"):
        build_lm_datasets(str(folder), small_tokenizer, BLOCK, datasets_cache_dir=tmp_path / "hf")
    with pytest.raises(ValueError, match=r"data file '.*part-1.jsonl' is empty \(0 bytes\)"):
        build_lm_datasets(str(folder / "part-1.jsonl"), small_tokenizer, BLOCK, datasets_cache_dir=tmp_path / "hf")


def _damaged(tmp_path: Path, kind: str) -> tuple[list[str], str]:
    """Good files of one format and one damaged file among them: ``(files, the damaged file's name)``."""
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    suffix = {"parquet magic": ".parquet", "parquet truncated": ".parquet", "jsonl.gz": ".jsonl.gz", "csv": ".csv",
              "jsonl": ".jsonl"}[kind]
    files = []
    for i in range(2):
        path = tmp_path / f"good{i}{suffix}"
        texts = SENTENCES[i * 20:(i + 1) * 20]
        if suffix == ".parquet":
            pq.write_table(pa.table({"text": texts}), path)
        elif suffix == ".csv":
            path.write_text("text\n" + "".join(f'"{t}"\n' for t in texts))
        elif suffix == ".jsonl.gz":
            path.write_bytes(gzip.compress("".join(json.dumps({"text": t}) + "\n" for t in texts).encode()))
        else:
            _write_jsonl(path, texts)
        files.append(str(path))
    bad = tmp_path / f"bad{suffix}"
    if kind == "parquet magic":
        bad.write_bytes(b"not parquet at all" * 20)
    elif kind == "parquet truncated":
        bad.write_bytes(Path(files[0]).read_bytes()[:-30])
    elif kind == "jsonl.gz":
        bad.write_bytes(gzip.compress(b'{"text": "one"}\n{"text": "two"\n'))
    elif kind == "csv":
        bad.write_text('text\n"one"\n"two\n')
    else:
        _write_jsonl(bad, SENTENCES[:30])
        with bad.open("a") as f:
            f.write('{"text": "cut short"\n')
    return [files[0], str(bad), files[1]], str(bad)


@pytest.mark.parametrize("kind, reader_error", [
    ("parquet magic", r"ArrowInvalid: .*Parquet magic bytes not found"),
    ("parquet truncated", r"ArrowInvalid: "),
    ("jsonl.gz", r"ArrowInvalid: JSON parse error"),
    ("csv", r"ParserError: "),
    ("jsonl", r"not valid JSON \(Expecting"),
])
@pytest.mark.parametrize("streaming", [False, True])
def test_a_damaged_file_of_any_format_is_named_with_the_readers_error(small_tokenizer, tmp_path: Path, kind, reader_error,
                                                                      streaming) -> None:
    """One damaged file among good ones: the error names that file and says what its reader said (map-style: when the
    data is loaded; streamed: when the stream reaches it, or, for Parquet's footer, when it is loaded)."""
    files, bad = _damaged(tmp_path, kind)
    with pytest.raises(ValueError, match=rf"data file '{bad}'(, line 31:| cannot be read as \w+ \().*{reader_error}"):
        built = build_lm_datasets(files, small_tokenizer, BLOCK, streaming=streaming, max_eval_blocks=1,
                                  datasets_cache_dir=tmp_path / "hf")
        list(built["train"])

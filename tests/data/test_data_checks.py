"""Input mistakes fail before any work, naming the file or path and the fix."""

from __future__ import annotations

import pytest

import boost_hf.data.checks as checks
from boost_hf.data import build_lm_datasets, load_tokenizer
from boost_hf.data.checks import check_text_file, looks_like_local_path


def build(source, tokenizer, tmp_path, **kwargs):
    return build_lm_datasets(source, tokenizer, 16, datasets_cache_dir=tmp_path / "hf", **kwargs)


def test_non_utf8_file_is_named_with_the_byte_offset(tmp_path, small_tokenizer):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"hello world\nabc \xff def\n")
    with pytest.raises(ValueError, match=r"latin1.txt' is not UTF-8 text: byte 0xff at byte offset 16"):
        build(str(bad), small_tokenizer, tmp_path)


def test_offset_counts_a_character_split_between_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(checks, "CHUNK_BYTES", 5)
    path = tmp_path / "split.txt"
    path.write_bytes(b"abcd" + "é".encode() + b"xx\xffyy")
    with pytest.raises(ValueError, match="byte 0xff at byte offset 8"):
        check_text_file(path)
    path.write_bytes("abc é".encode()[:-1])
    with pytest.raises(ValueError, match="ends inside a multi-byte character"):
        check_text_file(path)


def test_empty_file(tmp_path, small_tokenizer):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match=r"empty.txt' is empty \(0 bytes\)"):
        build(str(tmp_path / "empty.txt"), small_tokenizer, tmp_path)


def test_one_line_file_has_no_validation_documents(tmp_path, small_tokenizer):
    (tmp_path / "one.txt").write_text("just one line of text here\n")
    with pytest.raises(ValueError, match="the validation split of .* has no documents"):
        build(str(tmp_path / "one.txt"), small_tokenizer, tmp_path)


def test_split_without_a_complete_block(tmp_path, small_tokenizer):
    (tmp_path / "train.txt").write_text("a long enough training text, repeated. " * 20 + "\n")
    (tmp_path / "valid.txt").write_text("short\n")
    files = {"train": str(tmp_path / "train.txt"), "validation": str(tmp_path / "valid.txt")}
    with pytest.raises(ValueError, match="the validation split of .* has no complete block of 16 tokens"):
        build(files, small_tokenizer, tmp_path)
    assert len(build(files, small_tokenizer, tmp_path, max_eval_blocks=0)["validation"]) == 0


def test_missing_paths_say_no_such_file_or_folder(tmp_path, small_tokenizer):
    with pytest.raises(FileNotFoundError, match="dataset: no such file or folder: '.*/missing.txt'"):
        build(str(tmp_path / "missing.txt"), small_tokenizer, tmp_path)
    with pytest.raises(FileNotFoundError, match="tokenizer: no such file or folder: './no-tokenizer'"):
        load_tokenizer("./no-tokenizer")


@pytest.mark.parametrize("name, local", [("gpt2", False), ("org/model", False), ("/abs", True), ("./rel", True),
                                         ("~/x", True), ("a/b/c", True), ("folder/", True)])
def test_what_counts_as_a_local_path(name, local):
    assert looks_like_local_path(name) is local

"""Tests for the cached deterministic byte-level BPE tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from boost_hf.data import tokenizer as tokenizer_module
from boost_hf.data.tokenizer import SPECIAL_TOKENS, load_tokenizer, train_bpe_tokenizer

SENTENCE = "The albedo of Earth is about 0.3, said Café Müller in 1969 — naïvely!"


def _model(tok: PreTrainedTokenizerFast) -> dict:
    return json.loads(tok.backend_tokenizer.to_str())["model"]


def test_special_tokens(small_tokenizer, vocab_size: int) -> None:
    assert isinstance(small_tokenizer, PreTrainedTokenizerFast)
    assert len(small_tokenizer) == vocab_size
    assert small_tokenizer.convert_ids_to_tokens([0, 1, 2, 3]) == list(SPECIAL_TOKENS)
    assert (small_tokenizer.unk_token, small_tokenizer.bos_token) == ("<unk>", "<s>")
    assert (small_tokenizer.eos_token, small_tokenizer.pad_token) == ("</s>", "<pad>")
    assert (small_tokenizer.bos_token_id, small_tokenizer.eos_token_id, small_tokenizer.pad_token_id) == (1, 2, 3)


def test_round_trip(small_tokenizer) -> None:
    ids = small_tokenizer(SENTENCE)["input_ids"]
    assert small_tokenizer.unk_token_id not in ids
    assert small_tokenizer.decode(ids) == SENTENCE
    assert small_tokenizer.decode(ids + [small_tokenizer.eos_token_id], skip_special_tokens=True) == SENTENCE
    assert len(small_tokenizer.tokenize("1969")) == 4  # digits are split individually


def test_training_is_deterministic(wiki, tmp_path: Path, vocab_size: int) -> None:
    texts = list(wiki["train"]["text"][:20])
    first = train_bpe_tokenizer(texts, vocab_size, tmp_path / "a")
    second = train_bpe_tokenizer(texts, vocab_size, tmp_path / "b")
    assert first.get_vocab() == second.get_vocab()
    assert _model(first)["merges"] == _model(second)["merges"]
    assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()
    assert first(SENTENCE)["input_ids"] == second(SENTENCE)["input_ids"]
    assert first(texts[0])["input_ids"] == second(texts[0])["input_ids"]


def test_cached_load_returns_equal_tokenizer(
    wiki, small_tokenizer, data_cache: Path, vocab_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_training(*args, **kwargs):
        raise AssertionError("the cached tokenizer should have been reused")

    monkeypatch.setattr(tokenizer_module, "build_bpe_backend", no_training)
    cached = train_bpe_tokenizer(wiki["train"], vocab_size, data_cache)
    assert cached.backend_tokenizer.to_str() == small_tokenizer.backend_tokenizer.to_str()
    named = load_tokenizer(f"bpe-{vocab_size}", cache_dir=data_cache)
    assert named.backend_tokenizer.to_str() == small_tokenizer.backend_tokenizer.to_str()
    folders = list((data_cache / "tokenizers").iterdir())
    assert [folder.name for folder in folders if folder.name.startswith(f"bpe-v1-{vocab_size}-")]
    assert not [folder for folder in folders if folder.name.startswith(".")]  # no staging leftovers


def test_saved_folder_loads_with_auto_tokenizer(small_tokenizer, tmp_path: Path) -> None:
    small_tokenizer.save_pretrained(tmp_path / "tok")
    loaded = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert loaded(SENTENCE)["input_ids"] == small_tokenizer(SENTENCE)["input_ids"]
    assert (loaded.bos_token, loaded.eos_token, loaded.pad_token) == ("<s>", "</s>", "<pad>")
    via_path = load_tokenizer(tmp_path / "tok")
    assert via_path.get_vocab() == small_tokenizer.get_vocab()


def test_rejects_too_small_vocab() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe_tokenizer(["hello world"], 100)

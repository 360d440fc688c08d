"""Shared fixtures for the data tests: one session cache, so the corpus is parsed once."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from boost_hf.data import load_wikipedia_sample, train_bpe_tokenizer  # noqa: E402

TEST_VOCAB = 512


@pytest.fixture(scope="session")
def vocab_size() -> int:
    """Vocabulary size of the test tokenizer."""
    return TEST_VOCAB


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A boost_hf cache root shared by the whole test session."""
    return tmp_path_factory.mktemp("boost_hf_cache")


@pytest.fixture(autouse=True)
def _isolated_cache_env(data_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Never let a data test write to the user's real cache."""
    monkeypatch.setenv("BOOST_HF_CACHE", str(data_cache))


@pytest.fixture(scope="session")
def wiki(data_cache: Path):
    """The cleaned Wikipedia sample (DatasetDict with train/validation)."""
    return load_wikipedia_sample(data_cache)


@pytest.fixture(scope="session")
def small_tokenizer(wiki, data_cache: Path, vocab_size: int):
    """A 512-token BPE trained on the sample's train split."""
    return train_bpe_tokenizer(wiki["train"], vocab_size, data_cache)

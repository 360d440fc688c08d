"""Fixtures of the training tests: an isolated cache with a small corpus and tokenizer."""

from __future__ import annotations

import os

import pytest

from .launcher import REPO


@pytest.fixture(scope="session")
def training_env(tmp_path_factory) -> dict[str, str]:
    """Environment for training subprocesses: offline, a session cache holding the ``bpe-512`` tokenizer,
    and ``CORPUS``, a small saved ``DatasetDict`` (fast to tokenize) for ``--dataset``."""
    from datasets import DatasetDict

    from boost_hf.data import load_tokenizer, load_wikipedia_sample

    cache = tmp_path_factory.mktemp("boost_hf_cache")
    wiki = load_wikipedia_sample(cache)
    load_tokenizer("bpe-512", cache_dir=cache)  # trained once here, read from the cache by every rank
    corpus = cache / "corpus"
    DatasetDict({"train": wiki["train"].select(range(24)), "validation": wiki["validation"]}).save_to_disk(corpus)
    return {
        **os.environ,
        "BOOST_HF_CACHE": str(cache),
        "CORPUS": str(corpus),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "BOOST_HF_DEEPSPEED_SHM_COMM": "0",
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
    }



"""Fixtures of the training tests: an isolated cache with a small corpus and tokenizer."""

from __future__ import annotations

import pytest

from .launcher import training_environment


@pytest.fixture(scope="session")
def training_env(tmp_path_factory) -> dict[str, str]:
    """Environment for training subprocesses (:func:`~tests.training.launcher.training_environment`): offline, a
    session cache holding the ``bpe-512`` tokenizer, and ``CORPUS``, a small saved ``DatasetDict`` for ``--dataset``."""
    return training_environment(tmp_path_factory.mktemp("boost_hf_cache"))

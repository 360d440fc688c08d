"""The matrix's runs use the training tests' environment (a small corpus and the ``bpe-512`` tokenizer, offline)."""

from tests.training.conftest import training_env  # noqa: F401

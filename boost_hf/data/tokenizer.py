"""Deterministic byte-level BPE tokenizer, trained with ``tokenizers`` and cached on disk.

The tokenizer mirrors LLaMA's conventions where it matters for pre-training:
ids 0-3 are ``<unk>``, ``<s>`` (bos), ``</s>`` (eos) and ``<pad>``; digits are split
individually; text is pre-tokenized byte-level (no unknown characters ever, so
``<unk>`` exists only for compatibility). Encoding adds no special tokens: the data
pipeline appends ``</s>`` after every document itself.

Cache layout: ``<cache root>/tokenizers/bpe-v<TOKENIZER_VERSION>-<vocab>-<texts sha256[:16]>/``
holding the ``save_pretrained`` files (``tokenizer.json``, ``tokenizer_config.json``, ...),
loadable with ``AutoTokenizer.from_pretrained(folder)``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from datasets import Dataset, DatasetDict
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from .cache import cache_subdir
from .checks import require_existing_path

logger = logging.getLogger(__name__)

TOKENIZER_VERSION = 1
"""Bump whenever the tokenizer recipe changes, so stale caches are not reused."""

DEFAULT_VOCAB_SIZE = 8192

UNK_TOKEN, BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<unk>", "<s>", "</s>", "<pad>"
SPECIAL_TOKENS: tuple[str, ...] = (UNK_TOKEN, BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)
"""Special tokens, in id order (0, 1, 2, 3)."""

MIN_FREQUENCY = 2
"""A pair must occur at least this often to be merged."""

_BPE_NAME = re.compile(r"^bpe-(\d+)$")
_BATCH = 1000

TextsSource = Dataset | DatasetDict | Iterable[str]


def _batch_factory(source: TextsSource, text_column: str) -> Callable[[], Iterator[list[str]]]:
    """Return a callable giving a fresh iterator of text batches (the texts are read twice)."""
    if isinstance(source, DatasetDict):
        source = source["train"]
    if isinstance(source, Dataset):
        dataset = source.select_columns([text_column])

        def dataset_batches() -> Iterator[list[str]]:
            for batch in dataset.iter(batch_size=_BATCH):
                yield list(batch[text_column])

        return dataset_batches
    if isinstance(source, str):
        raise TypeError("expected a Dataset or an iterable of strings, got a single str")
    texts = list(source)

    def list_batches() -> Iterator[list[str]]:
        for start in range(0, len(texts), _BATCH):
            yield texts[start : start + _BATCH]

    return list_batches


def texts_sha256(batches: Iterable[list[str]]) -> str:
    """Hash a stream of texts (order-sensitive, unambiguous: each text is length-prefixed)."""
    digest = hashlib.sha256()
    for batch in batches:
        for text in batch:
            data = text.encode("utf-8")
            digest.update(len(data).to_bytes(8, "little"))
            digest.update(data)
    return digest.hexdigest()


def build_bpe_backend(vocab_size: int) -> tuple[Tokenizer, trainers.BpeTrainer]:
    """Return an untrained byte-level BPE ``Tokenizer`` and its trainer."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=MIN_FREQUENCY,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    return tokenizer, trainer


def wrap_tokenizer(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    """Wrap a ``tokenizers.Tokenizer`` as a transformers fast tokenizer with bos/eos/unk/pad set."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        pad_token=PAD_TOKEN,
    )


def tokenizer_cache_path(corpus_hash: str, vocab_size: int, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Folder where the tokenizer for (corpus hash, vocab size, recipe version) is cached."""
    return cache_subdir("tokenizers", cache_dir) / f"bpe-v{TOKENIZER_VERSION}-{vocab_size}-{corpus_hash[:16]}"


def train_bpe_tokenizer(
    dataset_or_texts: TextsSource,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    text_column: str = "text",
) -> PreTrainedTokenizerFast:
    """Train (or load from cache) a byte-level BPE tokenizer on the given texts.

    Args:
        dataset_or_texts: a ``Dataset`` (its ``text_column``), a ``DatasetDict`` (its ``train``
            split) or an iterable of strings. Training is deterministic in the texts and their order.
        vocab_size: total vocabulary size, the 4 special tokens and 256 byte symbols included.
        cache_dir: cache root (default ``$BOOST_HF_CACHE`` or ``~/.cache/boost_hf``).
        text_column: column holding the text when a dataset is given.

    Returns:
        The tokenizer, loaded from its cache folder with ``AutoTokenizer.from_pretrained``.
    """
    minimum = len(SPECIAL_TOKENS) + len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < minimum:
        raise ValueError(f"vocab_size must be at least {minimum} (specials + byte alphabet), got {vocab_size}")
    batches = _batch_factory(dataset_or_texts, text_column)
    target = tokenizer_cache_path(texts_sha256(batches()), vocab_size, cache_dir)
    if not (target / "tokenizer.json").is_file():
        logger.info("Training a %d-token byte-level BPE tokenizer into %s", vocab_size, target)
        backend, trainer = build_bpe_backend(vocab_size)
        backend.train_from_iterator(batches(), trainer=trainer)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            wrap_tokenizer(backend).save_pretrained(staging)
            try:
                os.replace(staging, target)
            except OSError:
                if not (target / "tokenizer.json").is_file():  # lost a race only if the winner finished
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return load_tokenizer(target)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
"""Files of which a saved tokenizer folder holds at least one."""


def load_tokenizer(
    name_or_path: str | os.PathLike[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> PreTrainedTokenizerFast:
    """Load a tokenizer.

    Args:
        name_or_path: ``None`` or ``"bpe"`` (the default BPE with :data:`DEFAULT_VOCAB_SIZE`),
            ``"bpe-<vocab>"`` (a BPE of that size trained on the train split of the default
            Wikipedia sample, cached), a local folder saved with ``save_pretrained``, or a Hub
            model name (needs network access or a populated Hub cache).
        cache_dir: cache root for the ``bpe`` forms.
    """
    if name_or_path is None or os.fspath(name_or_path) == "bpe":
        name_or_path = f"bpe-{DEFAULT_VOCAB_SIZE}"
    name = os.fspath(name_or_path)
    match = _BPE_NAME.match(name)
    if match and not Path(name).exists():
        from .corpus import load_wikipedia_sample

        return train_bpe_tokenizer(load_wikipedia_sample(cache_dir)["train"], int(match.group(1)), cache_dir)
    require_existing_path(name, "tokenizer")
    folder = Path(name).expanduser()
    if folder.is_dir() and not any((folder / file).is_file() for file in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"tokenizer: the folder {name!r} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}): point --tokenizer at a "
            "folder saved with tokenizer.save_pretrained (e.g. a run's final/), a Hub name, or bpe-<vocab>."
        )
    return AutoTokenizer.from_pretrained(name)

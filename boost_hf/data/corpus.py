"""The default offline pre-training corpus: the English Wikipedia sample shipped with gensim.

``gensim==4.4.0`` ships a shortened dump of the first English Wikipedia articles
(``enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2``, text under
CC BY-SA 3.0). This module verifies that file against a pinned SHA-256, cleans it into
natural paragraphs (see :mod:`boost_hf.data.wikitext`), caches the result as JSONL and
returns a deterministic by-article train/validation :class:`datasets.DatasetDict`.

Cache layout: ``<cache root>/corpus/enwiki-sample-<sha256[:16]>-clean<CLEANING_VERSION>.jsonl``
with one ``{"title": ..., "text": ...}`` object per line, where the cache root is the
``cache_dir`` argument, else ``$BOOST_HF_CACHE``, else ``~/.cache/boost_hf``.
"""

from __future__ import annotations

import bz2
import hashlib
import importlib.util
import json
import logging
import os
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

from datasets import Dataset, DatasetDict

from .cache import atomic_write_text, cache_subdir
from .splits import is_validation
from .wikitext import clean_article, is_disambiguation, is_redirect

logger = logging.getLogger(__name__)

WIKI_SAMPLE_FILENAME = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
"""Name of the Wikipedia sample inside ``gensim/test/test_data``."""

WIKI_SAMPLE_SHA256 = "a53f4648dec40467ebdcbc7a1307eddb51fe6e28e9309f6ebde81ba0d04bea2d"
"""SHA-256 of :data:`WIKI_SAMPLE_FILENAME` as shipped in gensim 4.4.0."""

REQUIRED_GENSIM = "gensim==4.4.0"

CLEANING_VERSION = 1
"""Bump whenever the cleaning output changes, so stale caches are not reused."""

MIN_ARTICLE_WORDS = 100
"""Articles with fewer whitespace-separated words after cleaning are dropped."""

ARTICLE_NAMESPACES = ("0",)
"""MediaWiki namespaces kept (0 = main/article namespace)."""

DEFAULT_VALIDATION_PERCENT = 10.0
"""Default share (percent) of articles that go to the validation split."""


class CorpusIntegrityError(RuntimeError):
    """The corpus source file does not have the expected SHA-256."""


def wiki_sample_path() -> Path:
    """Return the path of the Wikipedia sample inside the installed gensim package (located without importing
    gensim: its import takes ~2 s, paid by every process that loads a ``bpe-<vocab>`` tokenizer)."""
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"the demo corpus ships with {REQUIRED_GENSIM}: pip install 'boost-hf[demo]'.")

    path = Path(spec.submodule_search_locations[0]).resolve() / "test" / "test_data" / WIKI_SAMPLE_FILENAME
    if not path.is_file():
        try:
            version = metadata.version("gensim")
        except metadata.PackageNotFoundError:
            version = "unknown"
        raise FileNotFoundError(
            f"{path} not found: the Wikipedia sample ships with {REQUIRED_GENSIM} (installed: gensim {version})."
        )
    return path


def file_sha256(path: str | os.PathLike[str]) -> str:
    """Return the hex SHA-256 of a file."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def verify_sha256(path: str | os.PathLike[str], expected: str = WIKI_SAMPLE_SHA256) -> str:
    """Check that ``path`` hashes to ``expected`` and return the hash.

    Raises:
        CorpusIntegrityError: naming the file, the expected and the actual hash.
    """
    actual = file_sha256(path)
    if actual != expected:
        raise CorpusIntegrityError(
            f"SHA-256 mismatch for corpus file {os.fspath(path)}: expected {expected}, got {actual}. "
            f"The default corpus is the Wikipedia sample shipped with {REQUIRED_GENSIM}; "
            f"reinstall that exact version (pip install '{REQUIRED_GENSIM}')."
        )
    return actual


def iter_clean_articles(path: str | os.PathLike[str]) -> Iterator[dict[str, str]]:
    """Parse a bz2 MediaWiki dump and yield cleaned ``{"title", "text"}`` articles in dump order.

    Non-article namespaces, redirects, disambiguation pages and articles shorter than
    :data:`MIN_ARTICLE_WORDS` words are skipped.
    """
    from gensim.corpora.wikicorpus import extract_pages  # the demo extra (not needed to load or run models)

    with bz2.open(path, "rb") as handle:
        for title, raw, _page_id in extract_pages(handle, filter_namespaces=ARTICLE_NAMESPACES):
            if not raw or is_redirect(raw) or is_disambiguation(raw):
                continue
            text = clean_article(raw)
            if len(text.split()) < MIN_ARTICLE_WORDS:
                continue
            yield {"title": title, "text": text}


def cleaned_corpus_path(
    cache_dir: str | os.PathLike[str] | None = None,
    source_path: str | os.PathLike[str] | None = None,
) -> Path:
    """Return the cached cleaned JSONL of the Wikipedia sample, building it on first use.

    Args:
        cache_dir: cache root (default ``$BOOST_HF_CACHE`` or ``~/.cache/boost_hf``).
        source_path: the bz2 dump to use (default: the one inside gensim); it must still
            match :data:`WIKI_SAMPLE_SHA256`.
    """
    source = Path(source_path) if source_path is not None else wiki_sample_path()
    digest = verify_sha256(source)
    target = cache_subdir("corpus", cache_dir) / f"enwiki-sample-{digest[:16]}-clean{CLEANING_VERSION}.jsonl"
    if target.is_file():
        return target
    logger.info("Cleaning %s into %s", source, target)
    lines = [json.dumps(article, ensure_ascii=False) for article in iter_clean_articles(source)]
    atomic_write_text(target, "\n".join(lines) + "\n")
    return target


def read_articles(path: str | os.PathLike[str]) -> list[dict[str, str]]:
    """Read a ``{"title", "text"}`` JSONL file."""
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def load_wikipedia_sample(
    cache_dir: str | os.PathLike[str] | None = None,
    validation_percent: float = DEFAULT_VALIDATION_PERCENT,
    source_path: str | os.PathLike[str] | None = None,
) -> DatasetDict:
    """Load the cleaned Wikipedia sample as a ``DatasetDict`` with ``train`` and ``validation``.

    Each row is one article with columns ``title`` and ``text``. Articles are assigned to a
    split by a stable hash of their title (see :func:`boost_hf.data.splits.is_validation`),
    so the split is deterministic and disjoint by article. Rows keep dump order.
    """
    articles = read_articles(cleaned_corpus_path(cache_dir, source_path))
    splits: dict[str, dict[str, list[str]]] = {
        name: {"title": [], "text": []} for name in ("train", "validation")
    }
    for article in articles:
        name = "validation" if is_validation(article["title"], validation_percent) else "train"
        splits[name]["title"].append(article["title"])
        splits[name]["text"].append(article["text"])
    return DatasetDict({name: Dataset.from_dict(columns) for name, columns in splits.items()})

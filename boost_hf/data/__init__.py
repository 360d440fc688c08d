"""Offline pre-training data: Wikipedia sample corpus, byte-level BPE tokenizer, packed LM datasets.

* :func:`load_wikipedia_sample` -- cleaned, cached, deterministically split Wikipedia sample
  shipped with ``gensim==4.4.0`` (:mod:`boost_hf.data.corpus`).
* :func:`train_bpe_tokenizer` / :func:`load_tokenizer` -- cached deterministic byte-level BPE
  (:mod:`boost_hf.data.tokenizer`).
* :func:`build_lm_datasets` -- tokenized (or pre-tokenized), packed ``input_ids`` blocks from the sample,
  local files, a saved dataset or a Hub dataset (:mod:`boost_hf.data.pipeline`); streamed as a resumable
  :class:`BlockStream` (:mod:`boost_hf.data.stream`).
* :func:`causal_lm_collator` -- batches of blocks with their ``labels`` derived (:mod:`boost_hf.data.collate`).
"""

from .cache import CACHE_ENV_VAR, resolve_cache_root
from .collate import causal_lm_collator
from .corpus import (
    CLEANING_VERSION,
    DEFAULT_VALIDATION_PERCENT,
    WIKI_SAMPLE_SHA256,
    CorpusIntegrityError,
    cleaned_corpus_path,
    load_wikipedia_sample,
    verify_sha256,
    wiki_sample_path,
)
from .pipeline import DEFAULT_BLOCK_SIZE, build_lm_datasets, document_token_ids, pack_blocks, pack_documents, tokenize_documents
from .sources import load_text_splits
from .splits import is_validation, split_by_key
from .stream import BlockStream, StreamCursor
from .tokenizer import (
    DEFAULT_VOCAB_SIZE,
    SPECIAL_TOKENS,
    TOKENIZER_VERSION,
    load_tokenizer,
    train_bpe_tokenizer,
)

__all__ = [
    "BlockStream",
    "StreamCursor",
    "causal_lm_collator",
    "document_token_ids",
    "pack_documents",
    "CACHE_ENV_VAR",
    "CLEANING_VERSION",
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_VALIDATION_PERCENT",
    "DEFAULT_VOCAB_SIZE",
    "SPECIAL_TOKENS",
    "TOKENIZER_VERSION",
    "WIKI_SAMPLE_SHA256",
    "CorpusIntegrityError",
    "build_lm_datasets",
    "cleaned_corpus_path",
    "is_validation",
    "load_text_splits",
    "load_tokenizer",
    "load_wikipedia_sample",
    "pack_blocks",
    "resolve_cache_root",
    "split_by_key",
    "tokenize_documents",
    "train_bpe_tokenizer",
    "verify_sha256",
    "wiki_sample_path",
]

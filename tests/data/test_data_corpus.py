"""Tests for the Wikipedia sample corpus: integrity, cleaning, split and cache."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from boost_hf.data import corpus
from boost_hf.data.cache import resolve_cache_root
from boost_hf.data.corpus import (
    CLEANING_VERSION,
    WIKI_SAMPLE_SHA256,
    CorpusIntegrityError,
    cleaned_corpus_path,
    load_wikipedia_sample,
    read_articles,
    verify_sha256,
    wiki_sample_path,
)
from boost_hf.data.splits import is_validation
from boost_hf.data.wikitext import clean_article, is_redirect


def test_shipped_sample_matches_pinned_hash() -> None:
    assert verify_sha256(wiki_sample_path()) == WIKI_SAMPLE_SHA256


def test_corrupted_file_gives_clear_error(tmp_path: Path) -> None:
    data = bytearray(wiki_sample_path().read_bytes())
    data[1000] ^= 0xFF
    bad = tmp_path / "corrupted.xml.bz2"
    bad.write_bytes(bytes(data))
    with pytest.raises(CorpusIntegrityError) as info:
        cleaned_corpus_path(tmp_path / "cache", source_path=bad)
    message = str(info.value)
    assert str(bad) in message
    assert WIKI_SAMPLE_SHA256 in message
    assert corpus.file_sha256(bad) in message
    assert "gensim==4.4.0" in message
    assert not list((tmp_path / "cache" / "corpus").glob("*.jsonl"))


def test_cleaning_removes_markup(wiki) -> None:
    for split in wiki.values():
        for text in split["text"]:
            for marker in ("[[", "]]", "{{", "}}", "<ref", "</ref", "'''", "\n\n\n", "  "):
                assert marker not in text
            assert text == text.strip()
    sample = " ".join(wiki["train"]["text"][:5])
    assert any(ch.isupper() for ch in sample), "text must not be lower-cased"


def test_redirects_namespaces_and_backmatter_dropped(wiki) -> None:
    titles = set(wiki["train"]["title"]) | set(wiki["validation"]["title"])
    assert "Anarchism" in titles
    assert "AccessibleComputing" not in titles  # a redirect in the dump
    assert not any(title.startswith("Wikipedia:") for title in titles)
    for split in wiki.values():
        for text in split["text"]:
            paragraphs = set(text.split("\n\n"))
            assert not paragraphs & {"References", "External links", "See also", "Further reading"}
            assert len(text.split()) >= corpus.MIN_ARTICLE_WORDS


def test_clean_article_unit() -> None:
    raw = (
        "{{Infobox thing|name=X}}'''Thing''' is a [[widget|gadget]] used in [[Paris]].<ref>{{cite web|url=x}}</ref>\n"
        "* first item\n"
        "== History ==\n"
        "It was   made in 1900.<!-- hidden -->\n"
        "{| class=\"wikitable\"\n| cell || cell\n|}\n"
        "== See also ==\n* [[Other]]\n=== Sub of see also ===\nDropped too.\n"
        "== Legacy ==\nStill here.\n"
        "[[Category:Things]]\n"
    )
    assert clean_article(raw) == (
        "Thing is a gadget used in Paris.\nfirst item\n\nHistory\n\nIt was made in 1900.\n\nLegacy\n\nStill here."
    )
    assert is_redirect("#REDIRECT [[Somewhere]]")
    assert is_redirect("  #redirect[[Somewhere]]")
    assert not is_redirect("Redirects are discussed here.")


def test_split_is_deterministic_and_disjoint(wiki, data_cache: Path) -> None:
    again = load_wikipedia_sample(data_cache)
    for name in ("train", "validation"):
        assert list(again[name]["title"]) == list(wiki[name]["title"])
        assert list(again[name]["text"]) == list(wiki[name]["text"])
    train, validation = set(wiki["train"]["title"]), set(wiki["validation"]["title"])
    assert not train & validation
    assert len(validation) >= 3
    assert len(train) >= 10 * len(validation) // 2
    everything = [article["title"] for article in read_articles(cleaned_corpus_path(data_cache))]
    assert sorted(everything) == sorted(train | validation)
    assert all(is_validation(title, 10.0) for title in validation)
    bigger = set(load_wikipedia_sample(data_cache, validation_percent=30)["validation"]["title"])
    assert validation <= bigger  # hash thresholds nest


def test_cache_is_reused(wiki, data_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = cleaned_corpus_path(data_cache)
    assert path.parent == data_cache / "corpus"
    assert WIKI_SAMPLE_SHA256[:16] in path.name and f"clean{CLEANING_VERSION}" in path.name
    first = json.loads(path.read_text(encoding="utf-8").splitlines()[0])
    assert set(first) == {"title", "text"}
    mtime = os.stat(path).st_mtime_ns

    def no_parsing(*args, **kwargs):
        raise AssertionError("the cached corpus should have been reused")

    monkeypatch.setattr(corpus, "iter_clean_articles", no_parsing)
    reloaded = load_wikipedia_sample(data_cache)
    assert list(reloaded["train"]["title"]) == list(wiki["train"]["title"])
    assert os.stat(path).st_mtime_ns == mtime
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]


def test_cache_root_resolution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BOOST_HF_CACHE", str(tmp_path / "env"))
    assert resolve_cache_root() == tmp_path / "env"
    assert resolve_cache_root(tmp_path / "arg") == tmp_path / "arg"
    monkeypatch.delenv("BOOST_HF_CACHE")
    assert resolve_cache_root() == Path("~/.cache/boost_hf").expanduser()

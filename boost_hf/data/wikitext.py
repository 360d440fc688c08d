"""Turn the MediaWiki markup of one Wikipedia article into plain, natural text.

The heavy lifting (templates, links, tags, tables, files) is done by gensim's
:func:`gensim.corpora.wikicorpus.filter_wiki`; this module adds what a language
model corpus needs on top of it: dropping back-matter sections (references,
external links, see also, ...), removing bold/italic quotes and list markers,
and collapsing whitespace while keeping paragraphs. The text is neither
lower-cased nor tokenized.
"""

from __future__ import annotations

import re


DROPPED_SECTIONS: frozenset[str] = frozenset(
    {
        "references",
        "reference",
        "notes",
        "note",
        "footnotes",
        "citations",
        "sources",
        "notes and references",
        "references and notes",
        "notes and sources",
        "sources and references",
        "works cited",
        "bibliography",
        "further reading",
        "see also",
        "external links",
        "external link",
        "links",
        "other uses",
    }
)
"""Section headings (lower-cased) whose whole section, sub-sections included, is dropped."""

_HEADING = re.compile(r"^(={2,6})[ \t]*(.+?)[ \t]*\1[ \t]*$", re.MULTILINE)
_REDIRECT = re.compile(r"^\s*#\s*redirect", re.IGNORECASE)
_DISAMBIGUATION = re.compile(r"\{\{\s*(disambig|disambiguation|dab|hndis|geodis)\s*[|}]", re.IGNORECASE)
_QUOTES = re.compile(r"'{2,}")
_SPACES = re.compile(r"[^\S\n]+")
_LIST_MARKER = re.compile(r"^[*#:;]+\s*")
_LEFTOVER_BRACES = re.compile(r"\{\{|\}\}|\{\||\|\}")
_EMPTY_PARENS = re.compile(r"\(\s*[,;:]?\s*\)")
_SPACE_BEFORE_PUNCT = re.compile(r" +(?=[,;]|\.(?:\s|$))")
_NO_LETTERS = re.compile(r"^[\W\d_]*$")
_REPEATED_COMMAS = re.compile(r",(?:\s*,)+")
_GALLERY = re.compile(r"<gallery\b.*?</gallery\s*>", re.IGNORECASE | re.DOTALL)
_COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)


def is_redirect(raw: str) -> bool:
    """Return True if the raw page text is a redirect (``#REDIRECT [[...]]``)."""
    return bool(_REDIRECT.match(raw))


def is_disambiguation(raw: str) -> bool:
    """Return True if the raw page text carries a disambiguation template."""
    return bool(_DISAMBIGUATION.search(raw))


def split_sections(raw: str) -> list[tuple[int, str, str]]:
    """Split raw wikitext into ``(level, heading, body)`` triples.

    The lead section (before the first heading) has level 1 and an empty heading;
    ``== H ==`` is level 2, ``=== H ===`` level 3, and so on.
    """
    sections: list[tuple[int, str, str]] = []
    level, heading, start = 1, "", 0
    for match in _HEADING.finditer(raw):
        sections.append((level, heading, raw[start : match.start()]))
        level, heading, start = len(match.group(1)), match.group(2), match.end()
    sections.append((level, heading, raw[start:]))
    return sections


def _is_dropped(heading: str) -> bool:
    return heading.strip().rstrip(":").strip().lower() in DROPPED_SECTIONS


def remove_tables(raw: str) -> str:
    """Remove wiki tables (``{| ... |}``, nested ones included): cells are rarely prose."""
    kept: list[str] = []
    depth = 0
    for line in raw.split("\n"):
        stripped = line.lstrip()
        if stripped.startswith("{|"):
            depth += 1
            continue
        if depth:
            if stripped.startswith("|}"):
                depth -= 1
            continue
        kept.append(line)
    return "\n".join(kept)


def strip_markup(raw: str) -> str:
    """Remove comments, galleries and tables, then the rest of the markup with gensim's ``filter_wiki``."""
    from gensim.corpora.wikicorpus import filter_wiki  # the demo extra (not needed to load or run models)

    raw = _COMMENT.sub("", raw)
    raw = _GALLERY.sub("", raw)
    return filter_wiki(remove_tables(raw))


def tidy_text(text: str) -> str:
    """Normalise text already stripped of markup by gensim.

    Removes bold/italic quotes, list/indent markers, leftover template/table braces and
    empty parentheses, collapses runs of spaces, drops lines without any letter, and
    keeps paragraphs separated by one blank line.
    """
    text = _QUOTES.sub("", text)
    text = _LEFTOVER_BRACES.sub("", text)
    paragraphs: list[str] = []
    current: list[str] = []
    for line in text.split("\n"):
        line = _SPACES.sub(" ", line).strip()
        line = _LIST_MARKER.sub("", line)
        line = _EMPTY_PARENS.sub("", _REPEATED_COMMAS.sub(",", line))
        line = _SPACE_BEFORE_PUNCT.sub("", _SPACES.sub(" ", line)).strip()
        if not line:
            if current:
                paragraphs.append("\n".join(current))
                current = []
            continue
        if _NO_LETTERS.match(line):
            continue
        current.append(line)
    if current:
        paragraphs.append("\n".join(current))
    return "\n\n".join(paragraphs)


def clean_article(raw: str) -> str:
    """Return the plain text of one article's wikitext (headings kept as their own paragraph).

    Back-matter sections listed in :data:`DROPPED_SECTIONS` and all their
    sub-sections are removed before markup stripping.
    """
    parts: list[str] = []
    drop_below: int | None = None
    for level, heading, body in split_sections(raw):
        if drop_below is not None and level > drop_below:
            continue
        drop_below = None
        if heading and _is_dropped(heading):
            drop_below = level
            continue
        body_text = tidy_text(strip_markup(body))
        if not body_text:
            continue
        heading_text = tidy_text(strip_markup(heading)) if heading else ""
        if heading_text:
            parts.append(heading_text)
        parts.append(body_text)
    return "\n\n".join(parts)

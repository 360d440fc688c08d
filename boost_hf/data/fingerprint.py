"""What a run trains on, fingerprinted cheaply enough for terabytes, so that a resumed run can tell it is the same.

A :class:`DataSources` names a training set's source: its local files (a file, a glob, a list, the training split's
files of a ``{split: files}`` mapping, every file under a folder but ``datasets``' cache files), or, for a source
that is not local files, its description (the Wikipedia sample, pinned by the SHA-256 of its dump and the cleaning
version; a Hub dataset, by its name, configuration and revision). Its :meth:`~DataSources.fingerprint` lists each
file's name (relative to the files' common folder, so that a copy elsewhere keeps it), size, modification time and
the SHA-256 of sampled blocks: the whole file up to :data:`WHOLE_FILE_BYTES`, else :data:`SAMPLES_PER_FILE` blocks of
:data:`SAMPLE_BYTES` evenly spaced from its first byte to its last, fewer per file when there are many files (about
:data:`SAMPLE_BUDGET` blocks in all, at least the first and the last of each file): at most 256 KiB per file and about
64 MiB in all up to 2,048 files (32 KiB per file beyond), read once per run. A map-style training set also records the SHA-256 of
:data:`SAMPLED_ROWS` of its packed blocks (:func:`sampled_rows_sha256`): what is trained, whatever built it. The data
is identified by its content (the sizes and sampled blocks in order, :func:`content_of`): a copy without its
modification times (to local scratch), a moved or renamed corpus is the same data; the times are only named beside a
change of content.

:func:`fingerprint_differences` says what differs between two fingerprints, :func:`describe_fingerprint` summarises
one (:mod:`boost_hf.training.data` records them in every checkpoint and compares them on resume). No ``datasets``
import: the module reads files and rows only.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field

import numpy as np

SAMPLE_BYTES = 16 << 10
"""Bytes of one sampled block."""
SAMPLES_PER_FILE = 16
"""Blocks sampled from one file (its first and last among them)."""
WHOLE_FILE_BYTES = SAMPLE_BYTES * SAMPLES_PER_FILE
"""Files up to this size are hashed whole."""
SAMPLE_BUDGET = 4096
"""About this many blocks are read over all files (at least 2 per file)."""
SAMPLED_ROWS = 64
"""Rows of a map-style training set hashed, evenly spaced."""
ATTRIBUTE = "boost_hf_sources"
"""The attribute of a built training set (a ``datasets.Dataset`` or a ``BlockStream``) that holds its sources."""
_IGNORED_PREFIXES = (".", "cache-")
"""Files under a source folder that are not the data: hidden files, ``datasets``' cache files (``cache-*.arrow``)."""
_IGNORED_SUFFIXES = (".token_range.json", ".lock")


def _sampled_sha256(path: str, size: int, samples: int) -> str:
    """SHA-256 (16 hex digits) of the whole file up to :data:`WHOLE_FILE_BYTES`, else of ``samples`` blocks of
    :data:`SAMPLE_BYTES` evenly spaced from its start to its end."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= WHOLE_FILE_BYTES:
            digest.update(f.read())
        else:
            for offset in np.linspace(0, size - SAMPLE_BYTES, max(samples, 2)).astype(np.int64):
                f.seek(int(offset))
                digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()[:16]


def files_fingerprint(paths: list[str]) -> list[dict]:
    """Per file of ``paths``: ``{"name", "size", "mtime_ns", "sampled_sha256"}``, by name (relative to the files'
    common folder)."""
    paths = [os.path.abspath(path) for path in paths]
    root = os.path.commonpath([os.path.dirname(path) for path in paths]) if paths else ""
    samples = min(SAMPLES_PER_FILE, max(2, SAMPLE_BUDGET // max(len(paths), 1)))
    entries = []
    for path in paths:
        stat = os.stat(path)
        entries.append({"name": os.path.relpath(path, root), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                        "sampled_sha256": _sampled_sha256(path, stat.st_size, samples)})
    return sorted(entries, key=lambda entry: entry["name"])


def folder_files(folder: str) -> list[str]:
    """The data files under ``folder`` (recursively, sorted), without hidden files and ``datasets``' cache files."""
    found = []
    for parent, folders, names in os.walk(folder):
        folders[:] = sorted(name for name in folders if not name.startswith("."))
        found += [os.path.join(parent, name) for name in sorted(names)
                  if not name.startswith(_IGNORED_PREFIXES) and not name.endswith(_IGNORED_SUFFIXES)]
    return found


@dataclass
class DataSources:
    """A training set's source: ``description`` (for the messages, and the identity of a source without local
    files) and its local ``files``."""

    description: str
    files: tuple[str, ...] = ()
    _fingerprint: dict | None = field(default=None, repr=False, compare=False)

    def fingerprint(self) -> dict:
        """``{"source", "files", "digest"}`` (computed once: the files are read at the first call). The digest is of
        the content (:func:`content_of`), whatever the files' names, places and times."""
        if self._fingerprint is None:
            entries = files_fingerprint(list(self.files))
            identity = content_of(entries) if self.files else self.description
            digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
            self._fingerprint = {"source": self.description, "files": entries, "digest": digest}
        return self._fingerprint


def attach_sources(dataset, sources: DataSources | None):
    """``dataset`` (a built training set) with ``sources`` recorded on it (:data:`ATTRIBUTE`); returns it."""
    if sources is not None:
        setattr(dataset, ATTRIBUTE, sources)
    return dataset


def sources_of(dataset) -> DataSources | None:
    return getattr(dataset, ATTRIBUTE, None)


def sampled_rows_sha256(dataset, column: str = "input_ids") -> str:
    """SHA-256 (16 hex digits) of :data:`SAMPLED_ROWS` rows of a sized dataset (evenly spaced, first and last
    included) and of its length: a map-style training set's content, read in a few row accesses."""
    digest = hashlib.sha256(str(len(dataset)).encode())
    for i in sorted({int(i) for i in np.linspace(0, len(dataset) - 1, SAMPLED_ROWS)} if len(dataset) else ()):
        digest.update(np.asarray(dataset[i][column], dtype=np.int64).tobytes())
    return digest.hexdigest()[:16]


def _when(mtime_ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(mtime_ns / 1e9)) + " UTC"


def describe_fingerprint(fingerprint: dict) -> str:
    """``"digest 3f2a... (2 files, 51,234 bytes, newest modified 2026-11-28 07:01:02 UTC)"``, or the source's
    description for a source without local files; with the sampled rows' digest when recorded."""
    files = fingerprint.get("files") or []
    if files:
        what = (f"{len(files)} file{'s' if len(files) > 1 else ''}, {sum(f['size'] for f in files):,} bytes, newest "
                f"modified {_when(max(f['mtime_ns'] for f in files))}")
    else:
        what = fingerprint.get("source", "unknown source")
    rows = f", sampled blocks {fingerprint['sampled_rows_sha256']}" if fingerprint.get("sampled_rows_sha256") else ""
    return f"digest {fingerprint.get('digest')} ({what}{rows})"


def content_of(entries: list[dict]) -> list[tuple[int, str]]:
    """The content of fingerprinted files (:func:`files_fingerprint`), in their order: each file's size and sampled
    SHA-256. What identifies the data: not the files' names, folder or modification times."""
    return [(entry["size"], entry["sampled_sha256"]) for entry in entries]


def fingerprint_differences(saved: dict, now: dict, limit: int = 5) -> list[str]:
    """What differs between two fingerprints (at most ``limit`` files named, then a count): files added or removed,
    each file's size and sampled content (its modification time named beside a change of content, never alone: a
    copy without its times, e.g. to local scratch, is the same data), a source without files, the sampled rows. Files
    renamed or moved (a folder of another name) with their content and order kept are the same data."""
    differences, changed = [], []
    both_known = saved.get("digest") is not None and now.get("digest") is not None  # sources known then and now
    files = [fp.get("files") or [] for fp in (saved, now)]
    before, after = ({f["name"]: f for f in entries} for entries in files) if both_known else ({}, {})
    if both_known and not before and not after and saved.get("source") != now.get("source"):
        differences.append(f"the source was {saved.get('source')}, now {now.get('source')}")
    if both_known and before.keys() != after.keys() and content_of(files[0]) == content_of(files[1]):
        before = after = {}  # renamed or moved: the same content in the same order
    for name in sorted(before.keys() | after.keys()):
        old, new = before.get(name), after.get(name)
        if old is None or new is None:
            changed.append(f"{name}: {'added' if old is None else 'removed'}")
            continue
        what = []
        if old["size"] != new["size"]:
            what.append(f"size {old['size']:,} -> {new['size']:,} bytes")
        if old["sampled_sha256"] != new["sampled_sha256"]:
            what.append(f"sampled content {old['sampled_sha256']} -> {new['sampled_sha256']}")
        if what and old["mtime_ns"] != new["mtime_ns"]:
            what.append(f"modified {_when(old['mtime_ns'])} -> {_when(new['mtime_ns'])}")
        if what:
            changed.append(f"{name}: {', '.join(what)}")
    differences += changed[:limit] + ([f"{len(changed) - limit} more files"] if len(changed) > limit else [])
    rows = saved.get("sampled_rows_sha256"), now.get("sampled_rows_sha256")
    if None not in rows and rows[0] != rows[1]:
        differences.append(f"the packed training blocks sampled differ ({rows[0]} -> {rows[1]})")
    return differences


__all__ = [
    "ATTRIBUTE",
    "DataSources",
    "attach_sources",
    "content_of",
    "describe_fingerprint",
    "files_fingerprint",
    "fingerprint_differences",
    "folder_files",
    "sampled_rows_sha256",
    "sources_of",
]

"""Input checks that fail before any work with a message naming the file and the fix.

* :func:`require_existing_path`: a name that looks like a local path (``/``, ``./``, ``~``, or more than one
  ``/``) but does not exist is reported as "no such file or folder", never sent to the Hub (whose error would
  be "Repo id must be in the form ...").
* :func:`check_text_file`: a local text/JSON/CSV file must be non-empty and UTF-8; an undecodable file is
  named with the byte offset of its first bad byte.
* :func:`token_id_range`: the smallest and largest id of a dataset's ``input_ids``, scanned once per cache file and
  recorded beside it (a packed corpus is not re-read by every rank of every run to check its ids).
"""

from __future__ import annotations

import codecs
import json
import os
from pathlib import Path

from .cache import atomic_write_text

CHUNK_BYTES = 1 << 20


def looks_like_local_path(name: str | os.PathLike) -> bool:
    """True if ``name`` cannot be a Hub id (``name`` or ``namespace/name``), so it must be a local path."""
    text = os.fspath(name)
    return text.startswith(("/", ".", "~")) or text.count("/") > 1 or os.sep in text.replace("/", "") or text.endswith("/")


def require_existing_path(name: str | os.PathLike, what: str) -> None:
    """Raise ``FileNotFoundError`` if ``name`` looks like a local path (see :func:`looks_like_local_path`) and
    does not exist; ``what`` says which argument it was (e.g. ``"tokenizer"``)."""
    if looks_like_local_path(name) and not os.path.exists(os.path.expanduser(os.fspath(name))):
        raise FileNotFoundError(f"{what}: no such file or folder: {os.fspath(name)!r}")


def check_text_file(path: str | os.PathLike) -> None:
    """Raise ``ValueError`` if the file at ``path`` is empty or not valid UTF-8 (with the offset of the first
    bad byte). Reads the file once, in 1 MiB chunks."""
    path = os.fspath(path)
    if os.path.getsize(path) == 0:
        raise ValueError(f"data file {path!r} is empty (0 bytes): remove it from the dataset or fill it.")
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            data = decoder.getstate()[0] + chunk  # bytes held back from the previous chunk come first
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as error:
                raise ValueError(
                    f"data file {path!r} is not UTF-8 text: byte 0x{data[error.start]:02x} at byte offset "
                    f"{offset - (len(data) - len(chunk)) + error.start} ({error.reason}); convert it "
                    "(e.g. `iconv -f latin1 -t utf-8`) or remove it."
                ) from None
            offset += len(chunk)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError as error:
        raise ValueError(f"data file {path!r} is not UTF-8 text: it ends inside a multi-byte character ({error.reason}).") from None


TOKEN_RANGE_SUFFIX = ".token_range.json"
"""The record of an Arrow cache file's id range: ``<file>.token_range.json``."""


def _files_identity(paths: list[str]) -> list[dict]:
    return [{"file": os.path.basename(path), "size": os.stat(path).st_size, "mtime_ns": os.stat(path).st_mtime_ns} for path in paths]


def token_id_range(dataset, column: str = "input_ids", ignore: int | None = None) -> tuple[int, int] | None:
    """``(smallest, largest)`` id of ``column`` over the whole Arrow table behind ``dataset`` (a ``datasets.Dataset``;
    a ``select`` of it checks the whole table), entries equal to ``ignore`` left out (labels' ignore index), ``None``
    if it holds no id.

    A table backed by cache files is scanned once: the result is recorded beside its first file
    (:data:`TOKEN_RANGE_SUFFIX`, with each file's size and modification time, so a rewritten file is scanned again)
    and read back afterwards; where the record cannot be written (a read-only cache) the scan is repeated. An
    in-memory table is scanned each time."""
    import pyarrow.compute as pc

    files = sorted({entry["filename"] for entry in dataset.cache_files})
    record_path = files[0] + TOKEN_RANGE_SUFFIX if files else None
    identity = {"files": _files_identity(files), "column": column, "ignore": ignore} if files else None
    if record_path is not None and os.path.isfile(record_path):
        with open(record_path) as f:
            record = json.load(f)
        if {key: record.get(key) for key in identity} == identity:
            return None if record["min"] is None else (record["min"], record["max"])
    ids = pc.list_flatten(dataset.data.column(column))
    if ignore is not None:
        ids = pc.filter(ids, pc.not_equal(ids, ignore))
    bounds = pc.min_max(ids) if len(ids) else None
    found = None if bounds is None else (bounds["min"].as_py(), bounds["max"].as_py())
    if record_path is not None:
        low, high = found if found is not None else (None, None)
        try:
            atomic_write_text(Path(record_path), json.dumps({**identity, "min": low, "max": high}))
        except OSError:
            pass
    return found


__all__ = ["looks_like_local_path", "require_existing_path", "check_text_file", "token_id_range"]

"""Cache-directory resolution and atomic file writes shared by the data modules."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

CACHE_ENV_VAR = "BOOST_HF_CACHE"
"""Environment variable that overrides the default cache root."""

DEFAULT_CACHE_ROOT = Path("~/.cache/boost_hf")
"""Cache root used when neither an argument nor :data:`CACHE_ENV_VAR` is given."""


def resolve_cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Return the cache root: ``cache_dir``, else ``$BOOST_HF_CACHE``, else ``~/.cache/boost_hf``."""
    if cache_dir is None:
        cache_dir = os.environ.get(CACHE_ENV_VAR) or DEFAULT_CACHE_ROOT
    return Path(cache_dir).expanduser()


def cache_subdir(name: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Return (and create) the sub-folder ``name`` of the cache root."""
    path = resolve_cache_root(cache_dir) / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (temporary file in the same folder, then ``os.replace``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        raise

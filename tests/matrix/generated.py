"""The matrix's covering array (:func:`array`), built once per version of what it depends on and kept in the system's
temporary folder: building it asks ``boost-hf train``'s checks about ~2,000 candidate cases (about a minute on 2
cores), so each collection of the tests does not build it again. The key is a SHA-256 of every source file of
boost-hf and of the generator (this module, ``covering.py``, ``factors.py``, ``cli_validation.py``) and the versions of torch, transformers, accelerate and DeepSpeed: any change to a
declaration, a check or the generator builds it anew."""

from __future__ import annotations

import hashlib
import json
import tempfile
from importlib import metadata
from pathlib import Path

from . import cli_validation, covering, factors

REPO = Path(__file__).resolve().parents[2]
SEED = 0


def _digest() -> str:
    digest = hashlib.sha256()
    generator = [Path(__file__).parent / f"{name}.py" for name in ("covering", "factors", "cli_validation", "generated")]
    for path in sorted([*(REPO / "boost_hf").rglob("*.py"), *generator]):
        digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    for package in ("torch", "transformers", "accelerate", "deepspeed"):
        try:
            digest.update(f"{package}={metadata.version(package)}".encode())
        except metadata.PackageNotFoundError:
            digest.update(f"{package} absent".encode())
    return digest.hexdigest()[:24]


def _as_json(array: covering.CoveringArray) -> dict:
    return {"cases": array.cases, "required": sorted(map(list, array.required), key=repr),
            "refused_only": sorted(map(list, array.refused_only), key=repr), "accepted": array.accepted}


def _tuples(items) -> set:
    return {tuple(tuple(member) for member in t) for t in items}


def array() -> covering.CoveringArray:
    """The matrix's covering array: every pair and triple of :mod:`tests.matrix.factors`, each in an accepted case
    where one exists (``boost-hf train``'s checks, :func:`tests.matrix.cli_validation.blame`)."""
    path = Path(tempfile.gettempdir()) / "boost-hf-matrix" / f"{_digest()}.json"
    if path.exists():
        saved = json.loads(path.read_text())
    else:
        built = covering.build(factors.FACTORS, factors.CONSTRAINTS, triples=factors.TRIPLES, seed=SEED,
                               blame=cli_validation.blame)
        saved = _as_json(built)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".tmp")
        partial.write_text(json.dumps(saved))
        partial.replace(path)
    return covering.CoveringArray(factors.FACTORS, saved["cases"], _tuples(saved["required"]),
                                  refused_only=_tuples(saved["refused_only"]), accepted=saved["accepted"])


__all__ = ["SEED", "array"]

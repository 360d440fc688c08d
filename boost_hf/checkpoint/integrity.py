"""Checkpoints that cannot be confused or corrupted: a manifest of every file, and the architecture record.

``manifest.json`` (written last, so it also marks a folder as complete) holds, for every other file of a
checkpoint folder (sub-folders included, e.g. DeepSpeed's ``global_step<N>/``), its size and SHA-256, and
the model's *architecture record*: the configuration fields that change the function computed by the same
tensor names (bottleneck, rank, activations, LaX options, sizes, ...). A cola checkpoint therefore cannot be
loaded as svd, ``only_lr_act`` cannot be flipped on load, and a flipped byte is reported by file name.

Pure functions, no collectives: call them on the process that writes or reads the folder. A launched run spreads
the work: each rank hashes its share of the files (:func:`hashing_shares`: the files it wrote itself, then the
others balanced by size), the shares' digests are gathered into one manifest (:func:`write_manifest` with
``files=``), and a resume verifies each rank's share (:func:`check_files`); see :mod:`boost_hf.checkpoint.folders`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor

from ..configuration_boost_llama import BoostLlamaConfig

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1
ARCHITECTURE_METADATA_KEY = "boost_hf_architecture"
"""Key of the JSON architecture record in a safetensors header's ``metadata`` (see :func:`architecture_metadata`)."""
HASH_CHUNK_BYTES = 1 << 22
HASH_THREADS = 8
"""Files hashed at the same time when writing or verifying a manifest."""

ARCHITECTURE_FIELDS = BoostLlamaConfig.ARCHITECTURE_FIELDS
"""Fields that change what the same weights compute (:meth:`BoostLlamaConfig.architecture_record`)."""


class CheckpointIntegrityError(ValueError):
    """A checkpoint folder is incomplete, corrupted, or was saved from another architecture."""


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _sha256_all(paths: list[str]) -> list[str]:
    """SHA-256 of each file, several files at a time (hashlib releases the interpreter lock on large chunks)."""
    if len(paths) < 2:
        return [_sha256(path) for path in paths]
    with ThreadPoolExecutor(max_workers=min(HASH_THREADS, len(paths))) as pool:
        return list(pool.map(_sha256, paths))


def _files(folder: str) -> list[str]:
    """Relative paths of every file under ``folder`` but the manifest, sorted."""
    found = []
    for root, _, names in os.walk(folder):
        for name in names:
            relative = os.path.relpath(os.path.join(root, name), folder)
            if relative != MANIFEST_NAME:
                found.append(relative)
    return sorted(found)


def architecture_record(config) -> dict:
    """The fields of ``config`` (a ``BoostLlamaConfig``) that change the function, JSON-serialisable (options of an
    unused bottleneck are ``None``): :meth:`BoostLlamaConfig.architecture_record`."""
    return config.architecture_record()


def architecture_metadata(config) -> dict[str, str]:
    """The architecture record as safetensors header metadata (``save_file(..., metadata=...)``)."""
    return {ARCHITECTURE_METADATA_KEY: json.dumps(architecture_record(config), sort_keys=True)}


def check_architecture(record: dict, config) -> None:
    """Raise :class:`CheckpointIntegrityError` listing every field where ``config`` differs from ``record``."""
    different = config.architecture_differences(record)
    if different:
        raise CheckpointIntegrityError(
            "the checkpoint was saved from another architecture than this config ("
            + "; ".join(different)
            + "): load it with its own config.json, or start a new run from a matching config."
        )


def file_digests(folder: str, names: list[str]) -> dict[str, dict]:
    """``{name: {"size", "sha256"}}`` of the files ``names`` of ``folder`` (several at a time)."""
    digests = _sha256_all([os.path.join(folder, name) for name in names])
    return {name: {"size": os.path.getsize(os.path.join(folder, name)), "sha256": digest} for name, digest in zip(names, digests)}


def file_sizes(folder: str) -> dict[str, int]:
    """``{relative path: size}`` of every file under ``folder`` but the manifest."""
    return {name: os.path.getsize(os.path.join(folder, name)) for name in _files(folder)}


_RANK_FILE = re.compile(r"(?:^|/)(?:__(\d+)_\d+\.distcp|rng_state_(\d+)\.pth)$")
"""Files named after the rank that writes them: DCP's ``__<rank>_<n>.distcp``, the Trainer's ``rng_state_<rank>.pth``."""


def hashing_shares(files: dict[str, int], world: int) -> list[list[str]]:
    """Which files each of ``world`` ranks hashes (or verifies): a file named after a rank (:data:`_RANK_FILE`) goes
    to that rank (it wrote it), the others, largest first, to the rank with the fewest bytes so far. The same answer
    on every rank for the same ``files`` (``{name: size}``)."""
    shares: list[list[str]] = [[] for _ in range(world)]
    load = [0] * world
    others = []
    for name, size in sorted(files.items()):
        match = _RANK_FILE.search(name)
        owner = int(match.group(1) or match.group(2)) if match else None
        if owner is not None and owner < world:
            shares[owner].append(name)
            load[owner] += size
        else:
            others.append(name)
    for name in sorted(others, key=lambda n: (-files[n], n)):
        rank = min(range(world), key=lambda r: (load[r], r))
        shares[rank].append(name)
        load[rank] += files[name]
    return shares


def write_manifest(folder: str, config=None, files: dict[str, dict] | None = None) -> dict:
    """Write ``<folder>/manifest.json`` (size and SHA-256 of every file, and ``config``'s architecture record);
    return it. ``files``: the digests, already computed by the ranks that wrote the files (:func:`file_digests` of
    each rank's :func:`hashing_shares`); without it every file is hashed here. Call after every other file of the
    folder is written: the manifest marks the folder complete."""
    if files is None:
        files = file_digests(folder, _files(folder))
    manifest = {
        "version": MANIFEST_VERSION,
        "architecture": architecture_record(config) if config is not None else None,
        "files": dict(sorted(files.items())),
    }
    staging = os.path.join(folder, f".{MANIFEST_NAME}.tmp")
    with open(staging, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(staging, os.path.join(folder, MANIFEST_NAME))
    return manifest


def read_manifest(folder: str) -> dict:
    """The manifest of ``folder``; :class:`CheckpointIntegrityError` if there is none (an incomplete save) or it is
    damaged (not a manifest: truncated, overwritten), naming the file."""
    path = os.path.join(folder, MANIFEST_NAME)
    if not os.path.isfile(path):
        raise CheckpointIntegrityError(
            f"{folder!r} has no {MANIFEST_NAME}: its save did not complete (or it predates manifests); "
            "resume from an earlier checkpoint."
        )
    try:
        with open(path, "rb") as f:
            manifest = json.loads(f.read().decode("utf-8"))
        entries = manifest["files"]
        if not isinstance(entries, dict) or not all(
            isinstance(e, dict) and isinstance(e.get("size"), int) and isinstance(e.get("sha256"), str) for e in entries.values()
        ):
            raise ValueError("its 'files' are not {name: {size, sha256}}")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as error:
        raise CheckpointIntegrityError(
            f"{path!r} is damaged (not a valid manifest: {type(error).__name__}: {error}), so {folder!r} cannot be "
            "verified and is not a complete checkpoint."
        ) from None
    return manifest


def check_files(folder: str, manifest: dict, names: list[str], *, hashes: bool = True) -> None:
    """Check the files ``names`` of ``folder`` against ``manifest`` (presence, size and, if ``hashes``, SHA-256);
    raise :class:`CheckpointIntegrityError` naming the first missing, resized or altered one."""
    for name in names:
        entry, path = manifest["files"][name], os.path.join(folder, name)
        if not os.path.isfile(path):
            raise CheckpointIntegrityError(f"checkpoint {folder!r} is incomplete: {name} is missing.")
        size = os.path.getsize(path)
        if size != entry["size"]:
            raise CheckpointIntegrityError(
                f"checkpoint file {path!r} has {size} bytes, the manifest says {entry['size']}: it was truncated or replaced."
            )
    if hashes:
        for name, digest in zip(names, _sha256_all([os.path.join(folder, name) for name in names])):
            if digest != manifest["files"][name]["sha256"]:
                raise CheckpointIntegrityError(
                    f"checkpoint file {os.path.join(folder, name)!r} is corrupted (SHA-256 differs from the manifest): restore "
                    "it or use another checkpoint."
                )


def verify_manifest(folder: str, *, hashes: bool = True) -> dict:
    """Check every file of ``folder`` against its manifest (presence, size and, if ``hashes``, SHA-256); return
    the manifest. Raises :class:`CheckpointIntegrityError` naming the first missing, resized or altered file."""
    manifest = read_manifest(folder)
    check_files(folder, manifest, list(manifest["files"]), hashes=hashes)
    return manifest


def verify_checkpoint(folder: str, config) -> None:
    """:func:`verify_manifest` and, when the manifest has one, :func:`check_architecture` against ``config``."""
    record = verify_manifest(folder)["architecture"]
    if record is not None:
        check_architecture(record, config)


__all__ = [
    "MANIFEST_NAME",
    "ARCHITECTURE_FIELDS",
    "ARCHITECTURE_METADATA_KEY",
    "CheckpointIntegrityError",
    "architecture_record",
    "architecture_metadata",
    "check_architecture",
    "check_files",
    "file_digests",
    "file_sizes",
    "hashing_shares",
    "write_manifest",
    "read_manifest",
    "verify_manifest",
    "verify_checkpoint",
]

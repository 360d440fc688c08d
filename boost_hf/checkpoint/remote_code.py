"""A saved folder's remote code brought up to this boost-hf's, in place.

Every folder boost-hf saves (``save_pretrained``, a checkpoint, ``final/``, ``boost-hf export``) ships the model file
and its siblings as remote code (``trust_remote_code=True`` loads it without boost-hf). A folder keeps the code of
the boost-hf that wrote it: one published before a fix (e.g. before the model read the KV cache under transformers
5.24's name ``cache``) keeps the old behaviour wherever it is loaded as remote code. :func:`refresh_remote_code`
replaces those files with this installation's copies, each atomically, and the manifest's entries for them
(``boost-hf export FOLDER --refresh-remote-code``). The weights and the config are not touched. One process.
"""

from __future__ import annotations

import json
import os
import shutil

from transformers.dynamic_module_utils import get_relative_import_files

from .. import configuration_boost_llama, modeling_boost_llama
from .integrity import MANIFEST_NAME, check_files, file_digests, read_manifest, write_manifest


def remote_code_sources() -> dict[str, str]:
    """``{file name: path in this installation}`` of the remote code a save ships: the model file, the siblings it
    imports and the configuration file (what ``save_pretrained`` copies)."""
    paths = [modeling_boost_llama.__file__, *get_relative_import_files(modeling_boost_llama.__file__),
             configuration_boost_llama.__file__]
    return {os.path.basename(path): path for path in sorted(set(map(os.path.realpath, paths)))}


def _identical(a: str, b: str) -> bool:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        return fa.read() == fb.read()


def refresh_remote_code(folder: str) -> list[str]:
    """Replace the remote code of the saved boost-hf folder ``folder`` with this installation's; return the names of
    the files that changed (empty when it is already current). Each file is written beside its target and renamed
    over it; a folder with a manifest gets new entries for exactly those files, after its other entries are checked
    (a damaged folder is not blessed). ``ValueError`` naming the fix if ``folder`` is not a boost-hf folder."""
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"{folder!r} holds no config.json: give the folder of a saved boost-hf model (e.g. outputs/demo/final).")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    if config.get("model_type") != configuration_boost_llama.BoostLlamaConfig.model_type:
        raise ValueError(f"{folder!r} holds a model of type {config.get('model_type')!r}, not a boost-hf model "
                         f"({configuration_boost_llama.BoostLlamaConfig.model_type!r}): its remote code is not boost-hf's.")
    sources = remote_code_sources()
    manifest = read_manifest(folder) if os.path.isfile(os.path.join(folder, MANIFEST_NAME)) else None
    if manifest is not None:  # the rest of the folder as its manifest says, before anything is replaced
        check_files(folder, manifest, [name for name in manifest["files"] if name not in sources])
    changed = []
    for name, source in sources.items():
        target = os.path.join(folder, name)
        if os.path.isfile(target) and _identical(source, target):
            continue
        staging = os.path.join(folder, f".{name}.refresh")
        shutil.copyfile(source, staging)
        os.replace(staging, target)
        changed.append(name)
    if manifest is not None and changed:
        write_manifest(folder, configuration_boost_llama.BoostLlamaConfig.from_pretrained(folder) if manifest["architecture"] else None,
                       files={**manifest["files"], **file_digests(folder, changed)})
    return changed


__all__ = ["refresh_remote_code", "remote_code_sources"]
